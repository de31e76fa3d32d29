# DreamBooth LoRA trainer for FLUX.2: dev venv, tests and a tiny CPU demo.
# GPU users pick their torch build, e.g.:
#   make demo TORCH=torch==2.9.1 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

PYTHON          ?= python3
TORCH           ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS     ?=

VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO  := demo

.PHONY: venv test demo clean distclean

venv: $(STAMP)

# Torch goes in first and pinned, so the requirements below never pull another build.
$(STAMP): requirements.txt tests/requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -r requirements.txt -r tests/requirements.txt
	touch $@

test: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 tests $(PYTEST_ARGS)

# Trains a LoRA on one synthetic subject with a kilobyte-sized FLUX.2 [dev] base model (built and pretrained once,
# about 45 s), in under a minute on a CPU, and prints how much closer to the subject the LoRA's samples are.
demo: venv
	rm -rf $(DEMO)/output  # a fresh run each time
	HF_HUB_OFFLINE=1 $(PY) tests/learning.py $(DEMO) \
	  --validation_prompt "a photo of sks dog" --validation_epochs 250 --num_validation_images 2 \
	  --validation_inference_steps 28 --checkpointing_steps 500
	@echo
	@echo "LoRA weights:   $(DEMO)/output/pytorch_lora_weights.safetensors"
	@echo "Progress sheet: $(DEMO)/output/validation/progress-0.png (the base model, then every 250 steps)"
	@echo "Model card:     $(DEMO)/output/README.md"

clean:
	rm -rf $(DEMO) .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
