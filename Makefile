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

# Builds a kilobyte-sized random FLUX.2 pipeline plus six images, then trains 8 steps on CPU.
demo: venv
	$(PY) tests/tiny_flux2.py $(DEMO)
	rm -rf $(DEMO)/output  # a fresh run each time
	HF_HUB_OFFLINE=1 $(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 \
	  --mixed_precision no --dynamo_backend no train_dreambooth_lora_flux2.py \
	  --pretrained_model_name_or_path $(DEMO)/tiny-flux2 --instance_data_dir $(DEMO)/images \
	  --instance_prompt "a photo of sks dog" --output_dir $(DEMO)/output \
	  --resolution 32 --use_aspect_ratio_buckets --train_batch_size 1 --max_train_steps 8 \
	  --learning_rate 1e-3 --text_encoder_out_layers 1 2 --max_sequence_length 64 \
	  --validation_prompt "a photo of sks dog in a bucket" --validation_epochs 1 \
	  --num_validation_images 2 --validation_inference_steps 4 --checkpointing_steps 4 \
	  --seed 0 --report_to none
	@echo
	@echo "LoRA weights:      $(DEMO)/output/pytorch_lora_weights.safetensors"
	@echo "Validation images: $(DEMO)/output/validation/"
	@echo "Model card:        $(DEMO)/output/README.md"

clean:
	rm -rf $(DEMO) .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
