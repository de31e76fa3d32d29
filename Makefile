# DreamBooth LoRA trainer for FLUX.2. `make install` is what a user needs (torch, then requirements.txt); the tests and
# the CPU demo add their tools on top. On a GPU machine pick the torch build:
#   make install TORCH=torch TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

PYTHON          ?= python3
TORCH           ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS     ?=

VENV  := .venv
PY    := $(VENV)/bin/python
DEMO  := demo

.PHONY: install test test-fast docs demo clean distclean

install: $(VENV)/.installed

# Torch goes in first and pinned, so requirements.txt never pulls another build.
$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -r requirements.txt
	touch $@

$(VENV)/.test-tools: $(VENV)/.installed tests/requirements.txt
	$(PY) -m pip install -r tests/requirements.txt
	touch $@

# Every test (about 20 minutes on 2 cores); it ends with its wall time and five slowest tests (tests/tiers.py).
test: $(VENV)/.test-tools
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadgroup tests $(PYTEST_ARGS)

# The unit and stage tests and one end-to-end run (about 3 minutes): the edit-and-rerun loop. `make test` before a
# commit is pushed; CI runs that.
test-fast: $(VENV)/.test-tools
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow" tests $(PYTEST_ARGS)

# docs/flags.md from the script's parser (a test fails while it is stale)
docs: install
	$(PY) tests/flags_doc.py

# Trains a LoRA on one synthetic subject with a kilobyte-sized FLUX.2 [dev] base model (built and pretrained once,
# about 45 s), in under a minute on a CPU, and prints how much closer to the subject the LoRA's samples are.
demo: $(VENV)/.test-tools
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
