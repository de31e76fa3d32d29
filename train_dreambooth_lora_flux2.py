#!/usr/bin/env python
# Copyright 2026 The train_dreambooth_lora_flux2 authors. Licensed under the Apache License, Version 2.0.
"""DreamBooth LoRA training for FLUX.2 [dev] and FLUX.2 [klein].

Trains PEFT LoRA adapters on the Flux2Transformer2DModel of a FLUX.2 checkpoint from a folder of images (a same-stem
.txt file is an image's caption). FLUX.2 [klein] base 4B:

    accelerate launch train_dreambooth_lora_flux2.py \
      --pretrained_model_name_or_path black-forest-labs/FLUX.2-klein-base-4B \
      --instance_data_dir dog --instance_prompt "a photo of sks dog" --output_dir flux2-klein-dog-lora \
      --mixed_precision bf16 --cache_latents --resolution 1024 --train_batch_size 1 --timestep_shift auto \
      --gradient_accumulation_steps 4 --max_train_steps 500 --checkpointing_steps 100 \
      --memory_plan auto \
      --validation_prompt "a photo of sks dog in a bucket" --validation_epochs 25

FLUX.2 [dev]: the same flags with --pretrained_model_name_or_path black-forest-labs/FLUX.2-dev and
--output_dir flux2-dog-lora (the family is read from model_index.json; its text-encoder layers and validation
defaults from its diffusers pipeline).
Edit (image-to-image) LoRAs add --cond_data_dir (same-stem condition images).
--memory_plan auto fits a run to the GPU (README.md: what it chooses on cards of 16 to 141 GB).

What is cached and what stays random:
- Samples are the instance images times --repeats. Each sample has an index; the dataset maps a sample and epoch to
  content keys, the caches map keys to tensors.
  With prior preservation there is at least one sample per class image.
- Prompt embeddings are precomputed once per unique text, latents (--cache_latents) once per unique (image, bucket,
  crop, orientation); the encoders are loaded only for what is missing.
  The entries go to a per-user disk cache that later runs reuse.
  With cached latents a sample's crop is drawn once; flips, and without the cache crops too, are drawn at every use,
  from generators seeded by (seed, epoch, sample).
- Every batch holds one bucket; the order of epoch e is a pure function of (seed, e). Noise and timesteps come from
  a generator seeded by (seed, micro-step, process). A checkpoint records the global step, from which the epoch and
  the position in it follow: a resumed run sees exactly the batches a straight run would have.

Reading map: three parts, drawn by what runs.
  Part 1, the recipe: everything the command above executes, top to bottom: flags; data (records, buckets, the
    dataset, the bucket sampler, collate, SampleCache); model maths (encoding, the LoRA); what the stages share (Data,
    Caches, Run); stages 1-6 (prepare_data, precompute, setup_training, checkpoints, train and its step, finish);
    main().
    The seam to the options (Option, Hooks) follows the flags.
  Part 2, the plumbing every run uses (read it when it breaks): the command line's validators, pre-flight checks,
    checkpoint files, the FLUX.2 families, image files and the folder scan, the caches, small helpers, signals,
    several processes, the outputs (progress sheet, model card).
  Part 3, the options (delete what you do not use): a section each, its banner '# Option: NAME', with its own flags,
    reached only while it is on: config, dataset, folders, masked_loss, disk_cache, manifest, class_images, edit, ema,
    adapters, trigger_words, text_encoders, prodigy, fsdp, transformer_file, block_swap, attention, compile,
    int8_weights, hub, validation_extras, validation_transformer, memory_plan, metrics, copies.
"""

# ================================================================================================================
# Part 1: the recipe (what the README's first command executes, top to bottom)
# ================================================================================================================

from __future__ import annotations

import argparse
import ast  # option: copies
import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import io
import json
import keyword  # option: copies
import math
import os
import random
import re
import secrets
import shutil
import signal
import sys
import threading
import time
import tokenize  # option: copies
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, broadcast_object_list, gather_object, set_seed
from PIL import Image, ImageOps
from safetensors import SafetensorError
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = get_logger(__name__)

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".jfif", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif"}
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
TRAINER_STATE_NAME = "trainer_state.json"  # written last into a checkpoint: its presence marks it complete
# The double-stream blocks' image attention: all that the copy of diffusers' [dev] example we checked adapts by
# default, and only 8 of [dev]'s 56 blocks. The `default` preset adds every single-stream block (about 73% of [dev]'s
# weights), as diffusers #13011 and its [klein] example do.
ATTENTION_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
LORA_PRESETS = ("attention", "default", "all-linear")

class UsageError(Exception):
    """A problem with the user's flags or files: reported as one message, exit status 2, no traceback."""

class TrainingStopped(Exception):
    """Training ended early for a reason the user can act on: reported as one message, exit status `code`."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------------------------------------
# Flags: a flag's rule is its type= (Part 2), its options' flags are declared in their sections (Part 3)

def build_parser():
    """Flags by group; names and meanings follow the diffusers example where it has them."""
    p = _Parser(description="DreamBooth LoRA training for FLUX.2 [dev] and [klein] (README.md: commands per GPU size).",
                usage="accelerate launch %(prog)s --pretrained_model_name_or_path MODEL --instance_data_dir DIR "
                      "--instance_prompt TEXT [flags]", formatter_class=_HelpFormatter)
    p.epilog = "A copy with only the options you keep: %(prog)s --write_copy FILE --keep NAMES"  # option: copies
    for add_flags in (model_flags, data_flags, caching_flags, quality_flags,
                      lora_flags, optimisation_flags, output_flags, validation_flags):
        add_flags(p)
    for option in OPTIONS:  # option: any (each option's flags, under its name)
        g = p.add_argument_group(f"option {option.name}")
        for names, settings in option.flags:
            g.add_argument(*names, **settings)
    return p

def model_flags(p):
    g = p.add_argument_group("model")
    g.add_argument("--pretrained_model_name_or_path", required=True, type=model_source,
                   help="The FLUX.2 [dev] or [klein] checkpoint; the family is read from its model_index.json.")
    g.add_argument("--revision", help="Hub revision (branch, tag or commit); default: main.")
    g.add_argument("--variant", help="Weights variant, e.g. fp16; default: the plain weights.")
    g.add_argument("--cache_dir", type=folder_to_write, help="Downloaded models and datasets; default: the HF cache.")

def data_flags(p):
    g = p.add_argument_group("data")
    g.add_argument("--instance_data_dir", type=existing_folder,
                   help="The subject's images; x.txt is x's caption (UTF-8).")
    g.add_argument("--instance_prompt", help="Prompt of images without a caption, e.g. 'a photo of sks dog'.")
    g.add_argument("--repeats", type=positive_int, default=1, help="Samples per instance image in one epoch.")
    g.add_argument("--resolution", type=sides, default=512,
                   help="Training side in pixels (several, e.g. 512,768,1024: each image at each).")
    g.add_argument("--use_aspect_ratio_buckets", action="store_true",
                   help="Train each image in the bucket of its aspect ratio (about --resolution^2 pixels).")
    g.add_argument("--aspect_ratio_buckets", type=bucket_lists, help="Explicit buckets instead of the ladder.")
    g.add_argument("--center_crop", action="store_true", help="Crop the centre (default: a random crop).")
    g.add_argument("--random_flip", action="store_true", help="Flip images horizontally at random, at every use.")
    g.add_argument("--max_sequence_length", type=positive_int, default=512,
                   help="Text tokens per prompt, the chat template's system message included.")
    # hidden_states[k] of the text encoder: 0 is the embeddings; the upper end is checked against the model's config
    g.add_argument("--text_encoder_out_layers", type=non_negative_int, nargs="+",
                   help="Text-encoder layers stacked into an embedding; default: the family's.")
    g.add_argument("--dataloader_num_workers", type=non_negative_int,
                   help="Processes decoding images; default: none with --cache_latents, else a share of the cores.")

def caching_flags(p):
    g = p.add_argument_group("caching")
    g.add_argument("--cache_latents", action="store_true", help="Encode every (image, crop) once before training.")
    g.add_argument("--latent_sampling", choices=["mode", "sample"], default="mode",
                   help="Train on the VAE posterior's mean, or a draw from it at every use.")

def quality_flags(p):
    g = p.add_argument_group("training quality")
    g.add_argument("--caption_dropout", type=probability, default=0.0,
                   help="Probability of training an instance sample on the empty prompt.")

def lora_flags(p):
    g = p.add_argument_group("LoRA")
    g.add_argument("--rank", type=positive_int, default=4, help="LoRA rank.")
    g.add_argument("--lora_alpha", type=positive_int, default=4,
                   help="The update is scaled by alpha / rank (folded into the saved file).")
    g.add_argument("--lora_dropout", type=below_one, default=0.0, help="Dropout on the LoRA path.")
    g.add_argument("--lora_layers", type=layer_list, default="default",
                   help="attention, default (and the single-stream blocks), all-linear, or module names.")

def optimisation_flags(p):
    g = p.add_argument_group("optimisation")
    g.add_argument("--learning_rate", type=positive, default=1e-4, help="Peak learning rate.")
    g.add_argument("--scale_lr", action="store_true", help="Multiply it by batch x accumulation x processes.")
    g.add_argument("--lr_scheduler", default="constant", choices=["linear", "cosine", "cosine_with_restarts",
                   "polynomial", "constant", "constant_with_warmup"], help="Learning-rate schedule.")
    g.add_argument("--lr_warmup_steps", type=non_negative_int, default=500, help="Warm-up, in optimizer steps.")
    g.add_argument("--lr_num_cycles", type=positive_int, default=1, help="Hard restarts of cosine_with_restarts.")
    g.add_argument("--lr_power", type=positive, default=1.0, help="Power of the polynomial schedule.")
    g.add_argument("--adam_beta1", type=below_one, default=0.9, help="First-moment decay.")
    g.add_argument("--adam_beta2", type=below_one, default=0.999, help="Second-moment decay.")
    g.add_argument("--adam_weight_decay", type=non_negative, default=1e-4, help="Decoupled weight decay.")
    g.add_argument("--adam_epsilon", type=positive, default=1e-8, help="Denominator epsilon.")
    g.add_argument("--max_grad_norm", type=positive, default=1.0, help="Gradient clipping norm.")
    g.add_argument("--train_batch_size", type=positive_int, default=4,
                   help="Instance samples per batch and process.")
    g.add_argument("--num_train_epochs", type=positive_int, default=1, help="Epochs without --max_train_steps.")
    g.add_argument("--max_train_steps", type=positive_int, help="Optimizer steps; default: the epochs' worth.")
    g.add_argument("--gradient_accumulation_steps", type=positive_int, default=1, help="Batches per optimizer step.")
    g.add_argument("--gradient_checkpointing", action="store_true",
                   help="Recompute activations in the backward pass: far less memory, about a third slower.")
    g.add_argument("--weighting_scheme", default="none", choices=["sigma_sqrt", "logit_normal", "mode", "cosmap",
                   "none"], help="Density of the training noise levels and their loss weighting.")
    g.add_argument("--timestep_shift", type=timestep_shift, default="none",
                   help="Shift of the training noise levels: auto as FLUX.2 was trained, pipeline as it samples.")
    g.add_argument("--logit_mean", type=finite, default=0.0, help="Mean of the logit_normal density.")
    g.add_argument("--logit_std", type=positive, default=1.0, help="Standard deviation of logit_normal.")
    g.add_argument("--mode_scale", type=mode_scale, default=1.29, help="Scale of the mode density.")
    g.add_argument("--guidance_scale", type=non_negative, default=1.0, help="[dev]'s embedded guidance in training "
                   "(the diffusers README's 1; validation: --validation_guidance_scale).")
    g.add_argument("--seed", type=seed_value, help="Seed of everything random; default: drawn and logged.")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"],
                   help="dtype of the frozen weights; default: the accelerate config's.")
    g.add_argument("--allow_tf32", action="store_true", help="TF32 matmuls on Ampere and newer GPUs.")
    g.add_argument("--offload", action="store_true", help="Keep the VAE on the CPU except while it runs.")

def output_flags(p):
    g = p.add_argument_group("checkpointing and outputs")
    g.add_argument("--output_dir", type=output_folder, default="flux2-dreambooth-lora",
                   help="Where the LoRA, checkpoints, validation images and logs go.")
    g.add_argument("--overwrite_output_dir", action="store_true", help="Start over in a folder of an earlier run.")
    g.add_argument("--checkpointing_steps", type=positive_int, default=500, help="A checkpoint every N steps.")
    g.add_argument("--checkpoints_total_limit", type=positive_int, help="Keep the newest N; default: all.")
    g.add_argument("--resume_from_checkpoint", type=checkpoint_name,
                   help="A checkpoint folder, its name in --output_dir, or 'latest'.")
    g.add_argument("--upcast_before_saving", action="store_true", help="Save the LoRA in float32.")
    g.add_argument("--report_to", type=tracker_list, default="tensorboard",
                   help="Trackers of the step figures and images; one not installed is skipped.")
    g.add_argument("--logging_steps", type=positive_int, default=50, help="A log line every N optimizer steps.")
    g.add_argument("--logging_dir", type=logging_folder, default="logs", help="Tracker folder in --output_dir.")

def validation_flags(p):
    g = p.add_argument_group("validation")
    g.add_argument("--validation_prompt", help="Prompt of the images made during and after training.")
    g.add_argument("--validation_epochs", type=positive_int, default=50, help="Validate every N epochs.")
    g.add_argument("--validation_steps", type=positive_int, help="Also validate every N optimizer steps.")
    g.add_argument("--num_validation_images", type=non_negative_int, default=4, help="Images per validation.")
    g.add_argument("--validation_batch", type=positive_int, help="Images made in one pipeline call; default: all of "
                   "a prompt's (out of GPU memory: one at a time).")
    g.add_argument("--validation_inference_steps", type=positive_int,
                   help="Denoising steps; default: the pipeline's (4 for distilled [klein]).")
    g.add_argument("--validation_guidance_scale", type=non_negative,
                   help="[dev]'s embedded guidance or [klein]'s CFG in sampling; default: the pipeline's.")
    g.add_argument("--final_validation_prompt", help="Prompt of the final images without --validation_prompt.")
    g.add_argument("--skip_final_inference", action="store_true", help="Make no validation images after training.")

def parse_args(argv=None):
    parse = build_parser().parse_args
    if "--config" in {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}:  # option: config
        parse = parse_with_config  # a config file's flags first: the command line wins
    args = parse(argv)
    args.given_flags = given_flags(argv) if args.memory_plan == "auto" else None  # option: memory_plan
    # --resolution 512,768,1024: every image is a sample at each side; the largest sizes validation and estimates
    args.resolutions = args.resolution if isinstance(args.resolution, tuple) else (args.resolution,)
    args.resolution = max(args.resolutions)
    if (resume := args.resume_from_checkpoint) not in (None, "latest") and not Path(resume).is_dir():
        refuse(not Path(args.output_dir, resume).is_dir(), f"--resume_from_checkpoint {resume}: no such checkpoint "
               "folder (expected a checkpoint folder, the name of one in --output_dir, or 'latest')")
        args.resume_from_checkpoint = str(Path(args.output_dir, resume))  # a name in --output_dir, as the example does
    return args

def validate_args(args, hooks=None):
    """The checks that combine flags (each flag's own value was checked by its type), before anything heavy loads.
    Raises UsageError.
    hooks: the run's options (default: those `args` turns on), whose checks follow."""
    hooks = hooks or Hooks(args)
    cuda = torch.cuda.is_available()
    layers = args.text_encoder_out_layers or []
    refuse(len(set(layers)) != len(layers), f"--text_encoder_out_layers {' '.join(map(str, layers))}: expected "
           "distinct layers")
    refuse(not folder_can_be(Path(args.output_dir, args.logging_dir)), f"--logging_dir {args.logging_dir}: "
           f"{Path(args.output_dir, args.logging_dir)} cannot be a folder (a file is in the way)")
    sources = ["--instance_data_dir"]  # where images can come from
    sources += [o.source for o in OPTIONS if o.source]  # option: any
    refuse(args.instance_data_dir is None and not hooks.flag("replaces_data"),
           f"give exactly one of {' or '.join(sources)} (the subject's images)")
    for option in OPTIONS:  # option: any (an option's setting without its switch would be ignored: say so)
        for name in option.stray_flags(args)[:1]:
            raise UsageError(f"--{name} has no effect without "
                             f"{option.requires or ' or '.join('--' + s for s in option.switches)}")
    hooks.each("check")
    refuse(args.mixed_precision == "fp16" and not cuda, "--mixed_precision fp16 needs a CUDA GPU; use bf16 or no on "
           "this machine")
    refuse(args.mixed_precision == "bf16" and cuda and not torch.cuda.is_bf16_supported(),
           "--mixed_precision bf16 is not supported by this GPU; use fp16")
    refuse(Path(args.output_dir, LORA_WEIGHTS_NAME).exists() and not args.overwrite_output_dir
           and not hooks.flag("prints_only") and args.resume_from_checkpoint is None, f"--output_dir "
           f"{args.output_dir} already holds a finished LoRA ({LORA_WEIGHTS_NAME}); choose another folder, pass "
           "--overwrite_output_dir, or --resume_from_checkpoint to continue it")

def freeze(args):
    """args once resolved (parse, family defaults, options, step count): a later change is an error, not a quiet one."""
    args.__class__ = FrozenArgs
    return args

class FrozenArgs(argparse.Namespace):
    def __setattr__(self, name, value):
        raise AttributeError(f"args.{name}: the flags are resolved and frozen by prepare_data")


# ----------------------------------------------------------------------------------------------------------------
# The seam: how the recipe reaches the options (Part 3)

OPTIONS = []  # the option classes in Part 3's order (chained seams run in it); each section registers its own
SEAMS = {  # what an option may define, by how the recipe combines the answers (Hooks: each, first, chain, ...)
    "check", "notes", "resolve", "check_model", "load_images", "class_images", "class_count", "images", "condition",
    "describe", "adapter_name", "validation_specs", "prompt", "extra_prompts", "prompt_encoder", "text_encoder",
    "prompt_batch_size", "cache_identity", "cache_held", "load_transformer", "quantization_config", "before_lora",
    "adapter_config", "after_lora", "optimizer", "setup", "extra_texts",
    "after_optimizer_step", "training_state", "load_training_state", "training_state_problem", "lora_state",
    "optimizer_state", "load_state", "expected_lora", "validation_scales", "lora_strength", "validation_weights",
    "save_final", "write_lora", "plan_memory", "validated", "card", "checkpoint_lora", "retagged", "resolved",
    "lora_loading", "repository", "publish", "validation_model", "validation_steps",
    # Hooks.flag's: an option that is on brings the images, no text encoder, places the transformer, ... (True)
    "replaces_data", "no_text_encoder", "places_transformer", "sharded_text_encoder", "prints_only",
    "replaces_optimizer"}

def option(cls):
    """Registers a Part 3 option (the decorator of every option class)."""
    OPTIONS.append(cls)
    return cls

def flag(*names, **settings):
    """One flag of an option, as argparse's add_argument takes it."""
    return names, settings

class Option:
    """A feature of Part 3: its flags and what it does at the recipe's seams (SEAMS; the Hooks calls in the recipe
    show what each receives). On while one of its `switches` (default: all its flags) is not its default, its `env`
    variable is "true", or a flag, prompt or caption holds its `placeholder`; never called while off, when its other
    flags are refused (they would do nothing). Another option's flag is read with vars(args).get(name): gone once
    that option is. `words`: the nouns of its text beyond its flags, which a copy without it names nowhere."""

    name, flags, switches, env, placeholder, words = "", (), (), None, None, ()
    source = None  # the flag of another source of images than --instance_data_dir, if it is one
    needs = ()  # the options it cannot do without (a copy that keeps it keeps them)
    resume_flags = ()  # its flags a resumed run must share with its checkpoint (the adapter's)
    requires = ""  # what its other flags need, in words (default: one of its switches)

    def __init__(self, args):
        self.args = args

    def __init_subclass__(cls):  # a misspelt seam would never be called: refuse it at import
        unknown = [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_") and n not in SEAMS]
        if unknown:
            raise TypeError(f"{cls.__name__}: {unknown} are not seams of the recipe")

    @classmethod
    def _set(cls, args):
        """Its flags that hold other than their default."""
        found = []
        for names, settings in cls.flags:
            default, convert = settings.get("default"), settings.get("type")
            default = convert(default) if isinstance(default, str) and convert else default
            found += [names[0][2:]] if vars(args).get(names[0][2:]) not in (None, False, default) else []
        return found

    @classmethod
    def wanted(cls, args, texts=()):
        if cls.env is not None:
            return os.environ.get(cls.env, "").lower() == "true"
        on = any(name in (cls.switches or [n[0][2:] for n, _ in cls.flags]) for name in cls._set(args))
        return on or bool(cls.placeholder and any(cls.placeholder in (t or "") for t in texts))

    @classmethod
    def stray_flags(cls, args):
        """Its flags set while none of its switches is: they would have no effect."""
        found = cls._set(args)
        return [] if not cls.switches or any(s in found for s in cls.switches) else found

class Hooks:
    """The options that are on, called at the recipe's seams; a default run has none, so each call returns at once.
    each: every answer; first: the first that is not None (else `default()`); chain: a value passed through them
    all; collect: their lists joined; context: their context managers, nested."""

    def __init__(self, args):
        texts = [v for v in vars(args).values() if isinstance(v, str)]  # a [trigger] in a flag turns its option on
        self.options = [cls(args) for cls in OPTIONS if cls.wanted(args, texts)]

    def wake(self, args, texts=()):
        """Also turn on the options now wanted: a placeholder in `texts` (captions), or flags an option set."""
        off = [cls for cls in OPTIONS if cls not in {type(o) for o in self.options}]
        self.options += [cls(args) for cls in off if cls.wanted(args, texts)]
        self.options.sort(key=lambda o: OPTIONS.index(type(o)))

    def _with(self, seam):
        """The options on that define `seam`; a misspelt seam would reach none: refused, as a misspelt definition is."""
        if seam not in SEAMS:
            raise TypeError(f"{seam!r} is not a seam of the recipe (SEAMS)")
        return [o for o in self.options if hasattr(o, seam)]

    def _calls(self, seam, *args):
        return (getattr(o, seam)(*args) for o in self._with(seam))

    def each(self, seam, *args):
        return list(self._calls(seam, *args))

    def first(self, seam, *args, default=None):
        answer = next((a for a in self._calls(seam, *args) if a is not None), None)
        return default() if answer is None and default is not None else answer

    def chain(self, seam, value, *args):
        for o in self._with(seam):
            value = getattr(o, seam)(value, *args)
        return value

    def collect(self, seam, *args):
        return [item for answer in self._calls(seam, *args) for item in answer]

    def flag(self, name):
        return any(getattr(o, name) for o in self._with(name))

    @contextlib.contextmanager
    def context(self, seam, *args):
        with contextlib.ExitStack() as stack:
            for manager in self._calls(seam, *args):
                stack.enter_context(manager)
            yield


# ----------------------------------------------------------------------------------------------------------------
# Data: image records, buckets, the dataset, the sampler, collate

@dataclass(frozen=True)
class ImageRecord:
    """One image: a file (`path`) or an in-memory PIL image (`image`). `size` is (width, height) as displayed (EXIF
    orientation applied).
    An in-memory image is a `datasets` row's.
    `conditions`: an edit target's condition images."""

    name: str
    size: tuple
    caption: str | None = None
    path: str | None = None
    image: object = None
    mask_path: str | None = None
    sha256: str | None = None  # content hash, computed at scan time
    conditions: tuple = ()
    folder: object = None  # option: folders (its --datasets entry, a Folder: prompt, repeats, caption dropout)

    def content_hash(self):
        if self.sha256 is not None:
            return self.sha256
        if self.path is not None:
            return file_digest(self.path)
        return hashlib.sha256(self.load().tobytes()).hexdigest()

    def load(self):
        image = Image.open(self.path) if self.path is not None else self.image
        return to_rgb(ImageOps.exif_transpose(image))

def caption_lines(caption):
    """A caption's alternatives: each non-empty line of a caption file (or entry of a list column), stripped."""
    return [line.strip() for line in (caption or "").splitlines() if line.strip()]

def seed_for(*parts):
    """A 63-bit seed that is a pure function of `parts` (same on every process and Python run)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1

def bucket_ladder(resolution):
    """Buckets of about resolution^2 pixels over common aspect ratios (h:w), sides multiples of 16."""
    buckets = []
    for rh, rw in ((1, 1), (4, 5), (5, 4), (3, 4), (4, 3), (2, 3), (3, 2), (9, 16), (16, 9), (1, 2), (2, 1)):
        h = math.sqrt(resolution * resolution * rh / rw)
        w = h * rw / rh
        buckets.append((max(16, round(h / 16) * 16), max(16, round(w / 16) * 16)))
    return list(dict.fromkeys(buckets))

def nearest_bucket(height, width, buckets):
    """Index of the bucket whose aspect ratio is closest (in log space) to height/width; ties go to the first."""
    target = math.log(height / width)
    return min(range(len(buckets)), key=lambda i: abs(math.log(buckets[i][0] / buckets[i][1]) - target))

def draw_crop(image_size, bucket, center_crop, rng):
    """Resize to cover the bucket (aspect kept), then crop it. Returns (resized_hw, top, left)."""
    (w, h), (bh, bw) = image_size, bucket
    scale = max(bh / h, bw / w)
    rh, rw = max(bh, round(h * scale)), max(bw, round(w * scale))
    if center_crop:
        return (rh, rw), (rh - bh) // 2, (rw - bw) // 2
    return (rh, rw), rng.randint(0, rh - bh), rng.randint(0, rw - bw)

def transform_image(image, transform, bucket):
    """PIL image + transform ((resized_hw, top, left, flip)) -> the bucket-sized PIL image."""
    (rh, rw), top, left, flip = transform
    image = image.resize((rw, rh), Image.Resampling.BICUBIC).crop((left, top, left + bucket[1], top + bucket[0]))
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image

def image_to_tensor(image, transform, bucket):
    """PIL image + transform -> float tensor [3, H, W] in [-1, 1]."""
    array = np.asarray(transform_image(image, transform, bucket), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div(127.5).sub(1.0)

# the FLUX.2 pipelines shrink larger reference (condition) images to this area
REFERENCE_MAX_PIXELS = 1024 * 1024  # option: edit

def reference_size(bucket):  # option: edit
    """(h, w) of the condition images of a target in `bucket`: the bucket, or above 1024^2 pixels what the FLUX.2
    pipelines make of a reference that large (Flux2ImageProcessor._resize_to_target_area, sides floored to multiples
    of 16), so training sees references at the size inference gives them."""
    h, w = bucket
    if h * w <= REFERENCE_MAX_PIXELS:
        return tuple(bucket)
    scale = math.sqrt(REFERENCE_MAX_PIXELS / (h * w))
    return int(h * scale) // 16 * 16, int(w * scale) // 16 * 16

def follow_crop(transform, cond_size, bucket, cond_bucket=None):  # option: edit
    """The crop of a condition image matching its target's crop `transform` ((resized_hw, top, left) in `bucket`):
    the condition resized to cover `cond_bucket` (default: the target's bucket), cropped at the same relative place.
    A condition of the target's size gets exactly the target's transform: aligned pairs stay aligned token for token."""
    (rh, rw), top, left = transform
    cond_bucket = bucket if cond_bucket is None else cond_bucket
    (ch, cw), _, _ = draw_crop(cond_size, cond_bucket, True, None)

    def place(offset, full, side, new, new_side):
        return (new - new_side) // 2 if full == side else round(offset * (new - new_side) / (full - side))
    return (ch, cw), place(top, rh, bucket[0], ch, cond_bucket[0]), place(left, rw, bucket[1], cw, cond_bucket[1])

def ladder_buckets(buckets):
    """A bucket list, or one list per --resolution -> (the ladders, all their buckets in one list)."""
    ladders = [list(ladder) for ladder in buckets] if isinstance(buckets[0][0], (tuple, list)) else [list(buckets)]
    return ladders, list(dict.fromkeys(b for ladder in ladders for b in ladder))

def image_buckets(instances, buckets):
    """[R][I]: each image's bucket per ladder, as an index into the list of all buckets (ladder_buckets)."""
    ladders, flat = ladder_buckets(buckets)
    return [[flat.index(ladder[nearest_bucket(r.size[1], r.size[0], ladder)]) for r in instances] for ladder in ladders]

def sample_images(instances, repeats, num_ladders):
    """(image, ladder) of each instance sample of an epoch, in passes: pass p holds the images repeated more than p."""
    counts = [repeats] * len(instances)
    counts = [r.folder.repeats if r.folder else repeats for r in instances]  # option: folders (each folder's)
    return [(i, r) for p in range(max(counts)) for r in range(num_ladders) for i, n in enumerate(counts) if n > p]

def sample_groups(instances, buckets, samples, num_samples):
    """The group of every sample (sample i: samples[i % len(samples)], an (image, ladder) pair) for the batch sampler,
    which batches each group apart: (its bucket id,)."""
    ids, pairs = image_buckets(instances, buckets), [samples[i % len(samples)] for i in range(num_samples)]
    groups = [(ids[ladder][i],) for i, ladder in pairs]
    # option: edit (and its number of condition images: a batch's rows have as many reference tokens)
    groups = [(g, len(instances[i].conditions)) for (g,), (i, _) in zip(groups, pairs)]  # option: edit
    return groups

class DreamBoothDataset(torch.utils.data.Dataset):
    """Samples of a DreamBooth run, addressed by (epoch, index), the pairs the batch sampler yields (so DataLoader
    workers that live for the whole run draw each epoch's crops and flips unasked); items carry their "index".
    Sample i shows pair i of sample_images (image i % I at ladder (i // I) % R) in its bucket (`buckets`: a list, or
    one per --resolution).
    Class image i % C shows in sample i's bucket under the class prompt: slot N + i, sample i's class part.
    """

    def __init__(self, instances, instance_prompt, buckets, repeats=1, classes=(), seed=0, center_crop=False,
                 random_flip=False, with_pixels=True, fixed_crops=False):
        refuse(not instances, "no instance images found")
        self.instances, self.instance_prompt = list(instances), instance_prompt
        (self.ladders, self.buckets), self.seed = ladder_buckets(buckets), seed
        self.center_crop, self.random_flip, self.with_pixels = center_crop, random_flip, with_pixels
        self.fixed_crops = fixed_crops  # crops drawn once (epoch 0), flips live
        self.with_masks = False  # option: masked_loss (sets it: each item's loss mask too)
        self.samples = sample_images(self.instances, repeats, len(self.ladders))  # one epoch's (image, ladder) pairs
        self.num_samples = len(self.samples)
        self.image_buckets = image_buckets(self.instances, self.ladders)  # [R][I]
        self.classes = list(classes)  # option: class_images
        self.num_samples = max(self.num_samples, len(self.classes))  # option: class_images (one sample or more each)
        # option: edit (condition images numbered in one list; instance image i has the ids cond_ids[i])
        self.conditions, self.cond_ids = [], []  # option: edit
        for record in self.instances:  # option: edit
            self.cond_ids.append(tuple(range(len(self.conditions), len(self.conditions) + len(record.conditions))))
            self.conditions.extend(record.conditions)

    def __len__(self):
        return self.num_samples

    def sample_buckets(self):
        return sample_groups(self.instances, self.ladders, self.samples, self.num_samples)

    def class_slots(self, indices):  # option: class_images
        """The class slots of samples `indices`: N + i is sample i's class part."""
        return [self.num_samples + i for i in indices] if self.classes else []

    def source(self, index):
        """(kind, image id, bucket) of sample `index`."""
        if index >= self.num_samples:  # option: class_images (slot N + i: class image i % C in sample i's bucket)
            return "class", index % self.num_samples % len(self.classes), self.source(index % self.num_samples)[2]
        image, ladder = self.samples[index % len(self.samples)]
        return "instance", image, self.buckets[self.image_buckets[ladder][image]]

    def record(self, kind, image_id):
        records = {"instance": self.instances}
        records["class"] = self.classes  # option: class_images
        records["cond"] = self.conditions  # option: edit
        return records[kind][image_id]

    def latent_key(self, index, epoch):
        """What the VAE sees for a sample in an epoch: (kind, image id, bucket, resized size, top, left, flip).
        A pure function of (seed, epoch, index); with fixed_crops the crop is epoch 0's."""
        kind, image_id, bucket = self.source(index)
        crop_rng = random.Random(seed_for("crop", self.seed, 0 if self.fixed_crops else epoch, index))
        crop = draw_crop(self.record(kind, image_id).size, bucket, self.center_crop, crop_rng)
        flip = self.random_flip and random.Random(seed_for("flip", self.seed, epoch, index)).random() < 0.5
        return (kind, image_id, bucket, *crop, flip)

    def condition_keys(self, key):  # option: edit
        """The latent keys of the condition images travelling with a target's key, in reference order: the target's
        bucket (capped at the pipelines' reference size), crop (follow_crop) and flip. Class images have none."""
        kind, image_id, bucket, resized, top, left, flip = key
        if kind != "instance" or not self.cond_ids[image_id]:
            return []
        size = reference_size(bucket)
        return [("cond", c, size, *follow_crop((resized, top, left), self.conditions[c].size, bucket, size), flip)
                for c in self.cond_ids[image_id]]

    def cached_latent_keys(self):
        """Every latent key training may ask for under fixed crops: epoch 0's, flipped too if flipping."""
        keys = [self.latent_key(i, 0) for i in range(self.num_samples)]
        keys += [self.latent_key(s, 0) for s in self.class_slots(range(self.num_samples))]  # option: class_images
        keys = keys + [k[:-1] + (not k[-1],) for k in keys] if self.random_flip else keys
        keys += [c for k in keys for c in self.condition_keys(k)]  # option: edit
        return keys

    def prompt_keys(self, index):
        """Every text a sample can show: its image's caption alternatives, or the instance prompt."""
        if index >= self.num_samples:  # option: class_images (a class slot's: the class prompt)
            return [self.classes[index % self.num_samples % len(self.classes)].caption]
        if (record := self.instances[self.source(index)[1]]).folder:  # option: folders (its folder's prompt)
            return caption_lines(record.caption) or [record.folder.prompt]
        return caption_lines(self.instances[self.source(index)[1]].caption) or [self.instance_prompt]

    def prompt_key(self, index, epoch):
        """The text of a sample in an epoch: an alternative drawn by (seed, epoch, index), so resumes repeat it."""
        texts = self.prompt_keys(index)
        return texts[0] if len(texts) == 1 else random.Random(seed_for("caption", self.seed, epoch, index)).choice(
            texts)

    def pixels(self, key):
        """Decode and transform the image a latent key names -> [3, H, W] in [-1, 1]."""
        kind, image_id, bucket, *transform = key
        return image_to_tensor(self.record(kind, image_id).load(), transform, bucket)

    def __getitem__(self, epoch_and_index):
        epoch, index = epoch_and_index
        item = {"index": index, "epoch": epoch}
        keys = [self.latent_key(index, epoch)]
        keys += [self.latent_key(s, epoch) for s in self.class_slots([index])]  # option: class_images
        if self.with_pixels:
            item["pixel_values"] = torch.stack([self.pixels(k) for k in keys])
            if self.with_masks:  # option: masked_loss
                item["masks"] = torch.stack([key_mask(self, k) for k in keys])
            if conditions := self.condition_keys(keys[0]):  # option: edit
                item["cond_pixels"] = torch.stack([self.pixels(k) for k in conditions])
        return item

class BucketBatchSampler(torch.utils.data.Sampler):
    """Batches of (epoch, sample index) pairs from one bucket each, reshuffled every epoch. The batches of epoch e are
    a pure function of (seed, e): shuffle within buckets, cut into batches (dropping a bucket's remainder when
    drop_last), shuffle the batches. With several processes each takes every num_replicas-th batch of that list,
    trimmed to a multiple of num_replicas so all ranks step together. Iteration is one flat stream: epoch after
    epoch from the start set by set_epoch, so a DataLoader's workers (and their read-ahead) live across epochs.

    A replacement must keep: each epoch's batches a pure function of (seed, epoch), the same on every process (exact
    resume and the precompute both rely on it); its own split over the processes (the loader is not passed to
    accelerator.prepare, which would split it again); len() as this process's batches per epoch; set_epoch(epoch,
    start) to resume mid-epoch; by_bucket ({group: sample indices}, read by check_batches)."""

    def __init__(self, sample_buckets, batch_size, seed, drop_last=True, num_replicas=1, rank=0):
        self.by_bucket = {}
        for index, bucket in enumerate(sample_buckets):
            self.by_bucket.setdefault(bucket, []).append(index)
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch, start=0):
        """Start the stream at batch `start` of this rank in epoch `epoch` (resume: the batches already trained)."""
        self.epoch, self.start = epoch, start

    def epoch_batches(self, epoch):
        rng = random.Random(seed_for("bucket-sampler", self.seed, epoch))
        batches = []
        for bucket in sorted(self.by_bucket):
            members = list(self.by_bucket[bucket])
            rng.shuffle(members)
            for i in range(0, len(members), self.batch_size):
                if len(members) - i >= self.batch_size or not self.drop_last:
                    batches.append(members[i:i + self.batch_size])
        rng.shuffle(batches)
        usable = len(batches) - len(batches) % self.num_replicas
        return batches[:usable][self.rank::self.num_replicas]

    def __len__(self):
        per_bucket = (len(m) // self.batch_size if self.drop_last else math.ceil(len(m) / self.batch_size)
                      for m in self.by_bucket.values())
        return sum(per_bucket) // self.num_replicas

    def __iter__(self):
        epoch, start = self.epoch, self.start
        while len(self):
            for batch in self.epoch_batches(epoch)[start:]:
                yield [(epoch, index) for index in batch]
            epoch, start = epoch + 1, 0

def collate(examples):
    """Items -> {"indices": [B], "epoch": e, "pixel_values": [B, 3, H, W]}: each tensor of the items, stacked."""
    batch = {"indices": [ex["index"] for ex in examples], "epoch": examples[0]["epoch"]}
    for name in (name for name, value in examples[0].items() if torch.is_tensor(value)):
        # an item's rows [k, ...] (one image; k > 1 with an option's parts): all first rows, then all second, ...
        batch[name] = torch.stack([ex[name][k] for k in range(examples[0][name].shape[0]) for ex in examples])
    return batch

def drop_captions(texts, probability, rng):
    """Replace each text by "" with `probability` (a list: text i's own)."""
    chances = probability if isinstance(probability, list) else [probability] * len(texts)
    return ["" if rng.random() < chances[i] else text for i, text in enumerate(texts)]

class SampleCache:
    """Tensors stored once per content key (a caption; an image with its bucket, crop and flip), so repeats and
    shared captions share one entry. The dataset turns a batch's slots into keys; the cache turns keys into one
    batch tensor. `store` is a dict in memory or a DiskStore; either way never on the GPU: GPU memory does not grow
    with the dataset, the loop moves each batch's rows over."""

    def __init__(self, store=None):
        self.store = {} if store is None else store

    def todo(self, keys):
        """Keys without a value yet, unique, in first-seen order."""
        return [k for k in dict.fromkeys(keys) if k not in self.store]

    def put(self, key, value):
        self.store[key] = value.detach().to("cpu")

    def __getitem__(self, key):
        return self.store[key]

    def gather_unique(self, keys):
        """-> (each distinct entry of `keys` once, concatenated [U, ...]; rows [len(keys)] long, key i -> entry).
        A batch whose rows share a prompt reads and moves that embedding once; unique[rows] expands it."""
        distinct = list(dict.fromkeys(keys))
        missing = [k for k in distinct if k not in self.store]
        if missing:
            raise KeyError(f"cache has no entry for {missing[:3]}: precompute did not cover them")
        position = {k: i for i, k in enumerate(distinct)}
        return torch.cat([self.store[k] for k in distinct]), torch.tensor([position[k] for k in keys])


# ----------------------------------------------------------------------------------------------------------------
# Model maths: the VAE's latents, the LoRA

def encode_images(vae, pixels, latent_mean, latent_std, sampling="mode"):
    """[B, 3, H, W] in [-1, 1] -> the VAE posterior, patchified and normalised as FLUX.2 trains on it:
    mode: its mean [B, 4C, H/16, W/16]; sample: mean and std [B, 2, 4C, H/16, W/16], drawn from at each use."""
    from diffusers import Flux2Pipeline
    posterior = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist  # diagonal Gaussian, [B, C, H/8, W/8]
    mean = Flux2Pipeline._patchify_latents(posterior.mean)  # 2x2 patches into channels
    mean = (mean - latent_mean.to(mean)) / latent_std.to(mean)
    if sampling == "mode":
        return mean
    std = Flux2Pipeline._patchify_latents(posterior.std) / latent_std.to(mean)
    return torch.stack([mean, std], dim=1)

def peft_matches(name, targets):
    """Whether PEFT's target_modules `targets` name module `name`: the whole name or a dotted suffix."""
    return any(name == t or name.endswith("." + t) for t in targets)

def lora_target_modules(spec, num_single_layers, block_linears):
    """--lora_layers -> PEFT target_modules. spec: comma-separated presets and module names; num_single_layers: from
    the transformer's config; block_linears: full names of the linear layers inside its blocks ('all-linear')."""
    targets = []
    for entry in (t.strip() for t in (spec or "default").split(",")):
        if entry in ("attention", "default"):
            targets += ATTENTION_LORA_TARGETS
        if entry == "default":  # single-stream blocks: the fused QKV+MLP input and the output projection.
            # Their `attn.to_out` is named per block: in double-stream blocks that name is a ModuleList
            targets += ["to_qkv_mlp_proj", *(f"single_transformer_blocks.{i}.attn.to_out"
                                             for i in range(num_single_layers))]
        elif entry == "all-linear":
            targets += block_linears
        elif entry and entry != "attention":
            targets.append(entry)
    return list(dict.fromkeys(targets))

def lora_config(args, transformer):
    """The run's PEFT config: a LoRA on --lora_layers (options may replace it: adapter_config)."""
    from peft import LoraConfig
    targets = lora_target_modules(args.lora_layers, transformer.config.num_single_layers,
                                  block_linear_names(transformer))
    return LoraConfig(r=args.rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      init_lora_weights="gaussian", target_modules=targets)

def add_lora(transformer, config):
    """Attach the adapter and keep its parameters in float32 whatever the base dtype (fp16/bf16 updates of
    small LoRA deltas lose precision; the frozen base stays in the low-precision dtype)."""
    transformer.add_adapter(config)
    for param in transformer.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return transformer

@contextlib.contextmanager
def adapters_off(model):
    """The base model inside the block (the one way to switch adapters off): LoRA layers pass their input through."""
    model.disable_adapters()
    try:
        yield model
    finally:
        model.enable_adapters()


# ----------------------------------------------------------------------------------------------------------------
# What the stages share

@dataclass(frozen=True)  # a misspelt field is an error, not a new attribute
class Data:
    """What prepare_data settles before any weights load."""

    family: Family
    checkpoint: Path | None  # the checkpoint to resume from
    seed: int
    dataset: DreamBoothDataset
    sampler: BucketBatchSampler
    loader: torch.utils.data.DataLoader
    condition: tuple | None = None  # option: edit (validation's condition images, in reference order; their bucket)
    hooks: Hooks | None = None  # the options that are on
    specs: tuple = ()  # the options' validation prompts (ValidationSpec), beside --validation_prompt
    run_id: str = ""  # every file of this run's checkpoints carries it: files of two runs never form one
    images: dict = dataclasses.field(default_factory=dict)  # image name -> SHA-256, recorded in each checkpoint

@dataclass(frozen=True)
class Caches:
    """Precomputed inputs on the CPU or disk, never the GPU: prompt embeddings; with --cache_latents latents."""

    prompts: SampleCache
    latents: SampleCache | None = None
    masks: SampleCache | None = None  # option: masked_loss

@dataclass(frozen=True)
class Run:
    """What training carries from stage to stage, built once by setup_training. The loop changes the objects
    (weights, optimizer state), never the fields; its counters (step, micro-step, epoch) stay local to train()."""

    data: Data
    caches: Caches
    weight_dtype: torch.dtype
    vae: torch.nn.Module | None  # None when nothing needs it (all latents cached, no validation)
    latent_stats: tuple | None  # the VAE's batch-norm mean and std, [1, 4C, 1, 1] each
    transformer: torch.nn.Module  # as accelerate prepared it (wrapped under DDP/FSDP)
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    noise_scheduler: object  # FlowMatchEulerDiscreteScheduler; validation builds its pipeline from its config
    sigmas: torch.Tensor  # [T] training sigmas, highest first
    named_params: dict  # trainable (LoRA) parameters by name
    guidance: float | None  # --guidance_scale for a checkpoint with a guidance embedding ([dev]), else None
    shift_steps: int  # the family's sampling steps, which --timestep_shift pipeline matches
    clock: Clock = dataclasses.field(default_factory=lambda: Clock())  # where the run's time goes

    @property
    def hooks(self):
        return self.data.hooks

def charged(part):
    """A stage whose time goes to `part` of its run's clock (its third argument's: args, accelerator, run, ...)."""
    def wrap(stage):
        @functools.wraps(stage)
        def timed(args, accelerator, run, *rest, **kwargs):
            with run.clock.charged(part):
                return stage(args, accelerator, run, *rest, **kwargs)
        return timed
    return wrap


# ----------------------------------------------------------------------------------------------------------------
# Stage 1: data (prepare_data)

def setup_accelerator(args):
    import logging

    import diffusers
    import transformers
    trackers, missing = available_trackers(args.report_to)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=args.mixed_precision,
        log_with=trackers or None, project_config=ProjectConfiguration(
            project_dir=args.output_dir, logging_dir=str(Path(args.output_dir, args.logging_dir))))
    check_launch(accelerator, os.environ)  # a launcher's processes that accelerate left apart
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    for tracker in missing:  # accelerate's logger works once the Accelerator exists
        logger.warning(f"--report_to {tracker}: not installed, not reporting to it")
    for library in (transformers, diffusers):  # a default run shows this script's lines and bars alone
        library.utils.logging.set_verbosity_error()
        library.utils.logging.disable_progress_bar()
    if args.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    return accelerator

def resolve_model_flags(args, hooks, instances=()):
    """The flags that depend on the checkpoint: the family's defaults, the options' (a LoRA to start from sets the
    rank, the trigger word its prompts), what must fit the model (its config files only), then the memory plan's
    choices (for `instances`' shapes) -> the family."""
    family = detect_family(args)
    resolve_family_defaults(args, family)
    hooks.each("resolve", family)
    check_model_fit(args, hooks)
    if any(hooks.each("plan_memory", family, instances)):  # --memory_plan auto set flags: their options turn on
        hooks.wake(args)
    return family

def build_data(args, instances, classes, seed, accelerator):
    """Dataset, sampler and loader. Raises UsageError when the batch size leaves no batch."""
    dataset = DreamBoothDataset(instances, args.instance_prompt, resolve_buckets(args), repeats=args.repeats,
                                classes=classes, seed=seed, center_crop=args.center_crop, random_flip=args.random_flip,
                                with_pixels=not args.cache_latents, fixed_crops=args.cache_latents)
    dataset.with_masks = args.masked_loss  # option: masked_loss
    sampler = BucketBatchSampler(dataset.sample_buckets(), args.train_batch_size, seed, drop_last=True,
                                 num_replicas=accelerator.num_processes, rank=accelerator.process_index)
    if accelerator.is_main_process:
        warn_small_images(dataset)
    check_batches(args.train_batch_size, sampler, dataset.buckets)
    # One iterator for the whole run (the sampler is a flat stream of epochs), so workers start once. Own
    # generator: iter() draws a worker seed, which must not consume the global RNG (LoRA init and dropout).
    workers = loader_workers(args.dataloader_num_workers, args.cache_latents, local_processes(accelerator))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                                         generator=torch.Generator().manual_seed(seed))
    return dataset, sampler, loader

def prepare_data(args, accelerator, cache, hooks=None):
    """Everything that can fail on the user's input, before any weights load: images, resume point, seed, the flags
    the family resolves; then the data. Resolves, then freezes `args`.
    Class images are generated, if they are, just before the data.
    hooks: the run's options (default: those `args` turns on)."""
    hooks = hooks or Hooks(args)
    instances = agreed_refusal(accelerator, lambda: hooks.first("load_images", cache, accelerator, default=lambda: (
        load_instance_images(args, cache, accelerator))))  # a machine's own folder refused: every process says why
    hooks.wake(args, [r.caption for r in instances] + [s.prompt for s in hooks.collect("validation_specs")])
    checkpoint = find_resume_checkpoint(args, hooks.flag("prints_only"))
    check_resume_processes(args, checkpoint, accelerator)
    seed = agree_seed(args, checkpoint, accelerator)
    set_seed(seed)  # LoRA init and dropout draw from the global generators
    # the batch size, before class images are generated: more class images than asked for only add samples
    batches = check_batches_early(args, instances, seed, accelerator.num_processes, hooks.first("class_count") or 0)
    family = resolve_model_flags(args, hooks, instances)
    hooks.each("resolved", seed, batches, accelerator)  # before class images are generated and any model loads
    check_resume_flags(args, checkpoint)  # the adapter a checkpoint was trained with
    instances = hooks.chain("images", instances)  # its refusals, and the prompts file's, before class images are made
    specs = option_validation_specs(hooks)
    classes = hooks.first("class_images", accelerator, seed, family, cache) or []
    check_same_images(accelerator, instances, classes)
    dataset, sampler, loader = build_data(args, instances, classes, seed, accelerator)
    if args.max_train_steps is None:
        args.max_train_steps = optimizer_steps(args.num_train_epochs, len(sampler), args.gradient_accumulation_steps)
    condition = hooks.first("condition", dataset, bool(args.validation_prompt or args.final_validation_prompt or specs))
    images = {f"instance/{r.name}": r.content_hash() for r in dataset.instances}
    images.update({f"class/{r.name}": r.content_hash() for r in dataset.classes})  # option: class_images
    check_resume_point(args, checkpoint, images)
    freeze(args)
    return Data(family, checkpoint, seed, dataset, sampler, loader, hooks=hooks, specs=specs,
                condition=condition,  # option: edit
                run_id=agree_run_id(accelerator), images=images)


# ----------------------------------------------------------------------------------------------------------------
# Stage 2: precompute (prompt embeddings, latents)

def open_cache(args):
    """The run's cache (Part 2): its entries in memory.
    The disk cache, on by default, keeps them on disk, per user."""
    cache = MemoryCache()
    if (root := resolve_cache_dir(args.precompute_cache_dir, os.environ)) is not None:  # option: disk_cache
        cache = DiskCache.open(root, args)
    return cache

def option_validation_specs(hooks):
    """The options' validation prompts, as the options fill them."""
    return tuple(dataclasses.replace(s, prompt=hooks.chain("prompt", s.prompt))
                 for s in hooks.collect("validation_specs"))

def validation_specs(args, data):
    """What every validation generates (the sheet's columns compare the same rows): --validation_prompt, else
    --final_validation_prompt (the diffusers example's rule), then the options' prompts."""
    prompt = args.validation_prompt or args.final_validation_prompt
    return ([ValidationSpec(prompt)] if prompt else []) + list(data.specs)

def validation_prompts(args, data):
    """Prompts whose embeddings the run needs after the text encoder is gone."""
    return list(dict.fromkeys(s.prompt for s in validation_specs(args, data)))

def needed_prompts(args, data):
    """Every text whose embedding the run reads: training samples', the options', validation prompts, and the empty
    prompt for dropped captions and the negative prompt of [klein] validation with CFG."""
    dataset = data.dataset
    samples = list(range(len(dataset)))
    samples += dataset.class_slots(samples)  # option: class_images
    keys = [text for i in samples for text in dataset.prompt_keys(i)]
    keys += data.hooks.collect("extra_prompts", keys) + validation_prompts(args, data)
    cfg = validation_prompts(args, data) and uses_cfg(args, data)
    return list(dict.fromkeys(keys + ([""] if args.caption_dropout > 0 or cfg else [])))

def encode_missing(accelerator, cache, todo, batches, encode, progress, unit, lockstep=False):
    """Encode `todo` (agreed by every process) into `cache`, each process todo[rank::world] in batches(share), then
    share what was written. Every process runs the longest share's rounds: the stop check is a collective (with
    `lockstep` so is `encode`: an idle process encodes a stand-in)."""
    world = accelerator.num_processes
    shares = [batches(todo[r::world]) for r in range(world)]
    mine = shares[accelerator.process_index]
    bar = tqdm(total=sum(map(len, mine)), desc=f"Encoding {unit}s", unit=unit,
               disable=not accelerator.is_local_main_process)
    for r in range(max(map(len, shares))):
        progress.check(accelerator)
        keys = mine[r] if r < len(mine) else []
        if keys or (lockstep and todo):
            for key, value in zip(keys, encode(keys or todo[:1])):  # todo[:1]: a stand-in keeping the shards in step
                cache.put(key, value[None])  # [1, ...]
            progress.written += len(keys)
        bar.update(len(keys))
    bar.close()
    share_entries(cache, todo, accelerator)
    return sum(map(len, mine))

def chunks(keys, size):
    return [keys[i:i + size] for i in range(0, len(keys), size)]

def prompt_encoder(args, accelerator, family, weight_dtype, hooks):
    """-> texts -> embeddings [B, L, D]: the text encoder on the device (or an option's); dropping it frees it."""
    import transformers
    remote = hooks.first("prompt_encoder")
    if remote is not None:
        return remote
    logger.info("loading the text encoder", main_process_only=False)
    tokenizer = load_pipeline_tokenizer(args)
    load = functools.partial(getattr(transformers, family.text_encoder).from_pretrained,
                             args.pretrained_model_name_or_path, subfolder="text_encoder", revision=args.revision,
                             variant=args.variant, torch_dtype=weight_dtype, cache_dir=args.cache_dir)
    text_encoder = hooks.first("text_encoder", load, accelerator, weight_dtype,
                               default=lambda: load().eval().to(accelerator.device))
    return functools.partial(encode_prompts, family, text_encoder, tokenizer,
                             max_sequence_length=args.max_sequence_length, out_layers=args.text_encoder_out_layers)

@torch.no_grad()
def precompute_prompts(args, accelerator, data, weight_dtype, cache, progress):
    """Encode every prompt the run reads and `cache` lacks, once; the text encoder is loaded only if something is
    missing here, and freed afterwards.
    A sharded text encoder is loaded by every process, which joins every pass."""
    keys = needed_prompts(args, data)
    todo = agreed_todo(cache, keys, accelerator)
    sharded = data.hooks.flag("sharded_text_encoder") and bool(todo)
    mine = todo[accelerator.process_index::accelerator.num_processes]
    encode = prompt_encoder(args, accelerator, data.family, weight_dtype, data.hooks) if mine or sharded else None
    size = data.hooks.first("prompt_batch_size") or args.train_batch_size
    done = encode_missing(accelerator, cache, todo, lambda keys: chunks(keys, size), encode, progress, "prompt",
                          sharded)
    logger.info(f"encoded {done} of {len(todo)} missing prompts ({len(keys)} unique)", main_process_only=False)
    if encode is not None:
        from diffusers.training_utils import free_memory
        del encode
        free_memory()

def load_vae(args, accelerator, weight_dtype):
    from diffusers import AutoencoderKLFlux2
    logger.info("loading the VAE", main_process_only=False)
    vae = AutoencoderKLFlux2.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae",
                                             revision=args.revision, variant=args.variant, cache_dir=args.cache_dir,
                                             torch_dtype=weight_dtype)
    vae.requires_grad_(False).eval()
    # FLUX.2 normalises patchified latents with the VAE's batch-norm running statistics: [1, 4C, 1, 1]
    mean = vae.bn.running_mean.view(1, -1, 1, 1).float()
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).float() + vae.config.batch_norm_eps)
    return vae.to("cpu" if args.offload else accelerator.device), mean, std

def latent_batches(keys, batch_size):
    """VAE batches of latent keys: grouped by bucket (key[2]; one shape per batch), then cut to batch_size."""
    by_shape = {}
    for key in keys:
        by_shape.setdefault(key[2], []).append(key)
    return [batch for group in by_shape.values() for batch in chunks(group, batch_size)]

@torch.no_grad()
def prepare_latents(args, accelerator, data, weight_dtype, cache, progress):
    """With --cache_latents, encode every (image, bucket, crop, flip) `cache` lacks, once. Loads the VAE only if
    something needs it (missing entries, uncached training, validation) -> (the VAE or None, its statistics)."""
    dataset, validates = data.dataset, bool(validation_prompts(args, data))
    todo = agreed_todo(cache, dataset.cached_latent_keys(), accelerator) if args.cache_latents else []
    if args.cache_latents and not todo and not validates:
        logger.info("all latents cached; the VAE is not loaded")
        return None, None
    vae, mean, std = load_vae(args, accelerator, weight_dtype)
    if args.cache_latents:
        def encode(keys):
            with on_device(vae, accelerator.device, args.offload):
                return encode_images(vae, torch.stack([dataset.pixels(k) for k in keys]), mean, std,
                                     args.latent_sampling)

        # [1, 4C, h, w] each, or [1, 2, 4C, h, w] with --latent_sampling sample
        done = encode_missing(accelerator, cache, todo, lambda keys: latent_batches(keys, args.train_batch_size),
                              encode, progress, "image")
        logger.info(f"encoded {done} of {len(todo)} missing images", main_process_only=False)
    return (vae if validates or not args.cache_latents else None), (mean, std)

def precompute(args, accelerator, data, weight_dtype, cache):
    """Prompt embeddings (always) and latents (--cache_latents) into the run's cache -> (Caches, the VAE if still
    needed, its statistics). A signal stops every process once the entries being written are complete."""
    dataset, hooks = data.dataset, data.hooks
    prompts, latents = cache.stores(args, data, weight_dtype)
    needed = {"prompts": (prompts, needed_prompts(args, data))}
    if latents is not None:
        needed["latents"] = (latents, list(dict.fromkeys(dataset.cached_latent_keys())))
    todo = cache.hold(accelerator, needed)  # before anyone looks: no other run's eviction takes what this one found
    total = sum(len(keys) for _, keys in needed.values())
    hooks.each("cache_held", cache, dataset, todo, total)
    missing = sum(map(len, todo.values()))
    with StopRequest("once the entries being written are complete") as stop:
        progress = Progress(total, total - missing, cache.persistent, stop)
        precompute_prompts(args, accelerator, data, weight_dtype, prompts, progress)
        vae, latent_stats = prepare_latents(args, accelerator, data, weight_dtype, latents, progress)
        progress.check(accelerator)  # a signal during the last batch still stops before training
    caches = Caches(prompts, latents)
    if latents is not None and args.masked_loss:  # option: masked_loss (the masks of the cached crops)
        caches = dataclasses.replace(caches, masks=prepare_masks(dataset, latents))
    cache.settle(args, accelerator, data, caches)
    return caches, vae, latent_stats


# ----------------------------------------------------------------------------------------------------------------
# Stage 3: model and optimizer (setup_training)

def load_transformer(args, weight_dtype, hooks=None):
    """The checkpoint's transformer in the training dtype, on the CPU.
    A quantised one is on the GPU.
    hooks: the run's options (default: those `args` turns on)."""
    from diffusers import Flux2Transformer2DModel
    hooks = hooks or Hooks(args)
    return Flux2Transformer2DModel.from_pretrained(
        args.pretrained_model_name_or_path, subfolder="transformer", revision=args.revision, variant=args.variant,
        torch_dtype=weight_dtype, cache_dir=args.cache_dir,
        quantization_config=hooks.first("quantization_config", weight_dtype))

def prepare_transformer(args, accelerator, transformer, hooks=None):
    """A loaded transformer -> frozen, with float32 adapters (a LoRA on --lora_layers), on the device.
    benchmarks/gpu_step.py calls it on real-shaped random transformers.
    hooks: the run's options (default: those `args` turns on): another adapter, placement, precision, speed."""
    hooks = hooks or Hooks(args)
    transformer.requires_grad_(False)
    # the whole model goes to the device now, unless an option places it (swapped blocks, FSDP shards, 4-bit)
    if not hooks.flag("places_transformer"):
        transformer.to(accelerator.device)
    transformer = hooks.chain("before_lora", transformer, accelerator)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    add_lora(transformer, hooks.chain("adapter_config", lora_config(args, transformer), transformer))
    return hooks.chain("after_lora", transformer, accelerator)

def setup_optimizer(args, params, accelerator, hooks=None):
    """AdamW on the LoRA parameters.
    hooks: the run's options (default: those `args` turns on), one of which may bring another optimizer."""
    lr = args.learning_rate
    if args.scale_lr:
        lr *= args.gradient_accumulation_steps * args.train_batch_size * accelerator.num_processes
    hyper = dict(lr=lr, betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.adam_weight_decay,
                 eps=args.adam_epsilon)
    # fused: one kernel for all LoRA tensors instead of several per tensor. Not under FSDP, whose sharded
    # (DTensor) parameters it has not been verified with here.
    fused = accelerator.device.type == "cuda" and not is_fsdp(accelerator)
    hooks = hooks or Hooks(args)
    return hooks.first("optimizer", params, hyper, default=lambda: torch.optim.AdamW(params, **hyper,
                                                                                      fused=fused or None))

def setup_training(args, accelerator, data, caches, vae, latent_stats, weight_dtype, clock=None):
    """Transformer with LoRA, optimizer, LR schedule and noise schedule (clock: the run's, since its start)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.optimization import get_scheduler
    hooks = data.hooks
    transformer = hooks.first("load_transformer", accelerator, weight_dtype,
                              default=lambda: load_transformer(args, weight_dtype, hooks))
    transformer = prepare_transformer(args, accelerator, transformer, hooks)
    noise_scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        args.pretrained_model_name_or_path, subfolder="scheduler", revision=args.revision, cache_dir=args.cache_dir)
    optimizer = setup_optimizer(args, [p for p in transformer.parameters() if p.requires_grad], accelerator, hooks)
    # stepped once per optimizer step by the loop, so not passed to prepare() (which would step it per process)
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps,
                                 num_training_steps=args.max_train_steps, num_cycles=args.lr_num_cycles,
                                 power=args.lr_power)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    named_params = {n: p for n, p in accelerator.unwrap_model(transformer).named_parameters() if p.requires_grad}
    guidance = args.guidance_scale if accelerator.unwrap_model(transformer).config.guidance_embeds else None
    run = Run(data=data, caches=caches, weight_dtype=weight_dtype, vae=vae, latent_stats=latent_stats,
              transformer=transformer, optimizer=optimizer, lr_scheduler=lr_scheduler, noise_scheduler=noise_scheduler,
              sigmas=noise_scheduler.sigmas.float(), named_params=named_params, guidance=guidance,
              shift_steps=default_sampling_steps(data.family), clock=clock or Clock())
    hooks.each("setup", run)
    return run


# ----------------------------------------------------------------------------------------------------------------
# Stage 4: checkpoints

def lora_state_dict(accelerator, transformer, hooks):
    """The adapter's tensors, complete and on the CPU, keyed as diffusers' FLUX.2 LoRA loader expects (before its
    "transformer." prefix): copies, never the parameters.
    An option may gather them (FSDP: a collective; EMA swaps the parameters)."""
    from peft.utils import get_peft_model_state_dict
    state = hooks.first("lora_state", accelerator, transformer, default=lambda: get_peft_model_state_dict(
        accelerator.unwrap_model(transformer)))
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}

@charged("saving")
def save_checkpoint(args, accelerator, run, global_step):
    """Write checkpoint-N atomically: a temporary folder, renamed once every process has written its part. Holds the
    LoRA (a portable diffusers file, float32, for users who pick a checkpoint), the raw adapter, optimizer, LR
    schedule, grad scaler, the options' state and each process's RNG state as safetensors + JSON, and
    trainer_state.json (written last) with the step, seed, adapter flags and images. Every file carries the run's
    identity, checked before the rename: files of two runs never form one checkpoint."""
    final, run_id = Path(args.output_dir, f"checkpoint-{global_step}"), run.data.run_id
    partial = final.with_name(f"{final.name}.partial-{run_id}")  # this run's own: two runs never share one
    try:  # a full disk or quota, or --output_dir removed under the run: one line, and no half checkpoint
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()  # not its parents: a vanished --output_dir stops the run rather than being remade
        accelerator.wait_for_everyone()
        # every process's generators, written by the main process: with an --output_dir per machine, only its exists
        rngs = gather_object([rng_state()]) if accelerator.num_processes > 1 else [rng_state()]
        lora = lora_state_dict(accelerator, run.transformer, run.hooks)  # an option's gathering (FSDP): a collective
        optimizer = run.hooks.first("optimizer_state", accelerator, run, default=run.optimizer.state_dict)
        if accelerator.is_main_process:
            for rank, state in enumerate(rngs):
                write_state(partial, f"rng-{rank}", state, run_id)
            run.hooks.first("checkpoint_lora", accelerator, run, partial, default=lambda: save_lora(
                accelerator, run.transformer, lora, partial, run_id=run_id))  # the file a user picks from the sheet
            scaler = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
            training = {"lora": lora, "optimizer": optimizer, "lr_scheduler": run.lr_scheduler.state_dict(),
                        "scaler": scaler}  # the raw adapter: resumes bit for bit
            for extra in run.hooks.each("training_state"):
                training.update(extra)
            write_state(partial, "training", training, run_id)
            write_config(args, run.data, partial, accelerator, run_id)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            state = {"global_step": global_step, "seed": run.data.seed, "run": run_id or None,
                     "flags": flags_to_keep(args), "images": run.data.images}
            (partial / TRAINER_STATE_NAME).write_text(json.dumps(state))
            problem = checkpoint_problem(partial)  # every file whole and this run's
            if problem:
                raise TrainingStopped(f"could not write {final}: {problem} (does another run write to --output_dir?)")
            replace_folder(partial, final)
    except WRITE_ERRORS as e:
        shutil.rmtree(partial, ignore_errors=True)
        if not Path(args.output_dir).is_dir():
            raise TrainingStopped(f"could not write {final}: --output_dir {args.output_dir} is gone (removed during "
                                  "the run?); its checkpoints went with it") from None
        found = list_checkpoints(args.output_dir)
        raise TrainingStopped(f"could not write {final} ({e}); earlier checkpoints are intact "
                              f"(latest: {found[-1] if found else 'none'})") from None
    if accelerator.is_main_process:
        if args.checkpoints_total_limit is not None:
            older = [c for c in list_checkpoints(args.output_dir) if c != final]
            for old in older[: max(0, len(older) + 1 - args.checkpoints_total_limit)]:
                try:  # a checkpoint that cannot be deleted (read-only) stays; the run goes on
                    shutil.rmtree(old)
                except OSError as e:
                    logger.warning(f"--checkpoints_total_limit: could not delete {old} ({e}); it stays")
        logger.info(f"saved {final}")
    accelerator.wait_for_everyone()

def load_checkpoint(checkpoint, accelerator, run):
    """Restore what save_checkpoint wrote; returns the global step to continue from. A checkpoint whose tensors do
    not fit this model and these flags (another --rank, --lora_layers or model) is refused before anything changes."""
    training = read_state(checkpoint, "training")
    check_checkpoint_fits(checkpoint, accelerator, run, training)
    try:
        if not run.hooks.first("load_state", accelerator, run, training):  # an option's (FSDP: each process its shard)
            from peft import set_peft_model_state_dict
            set_peft_model_state_dict(accelerator.unwrap_model(run.transformer), training["lora"],
                                      adapter_name="default")
            run.optimizer.load_state_dict(training["optimizer"])
        run.lr_scheduler.load_state_dict(training["lr_scheduler"])
        run.hooks.each("load_training_state", training)
        if accelerator.scaler is not None and training["scaler"] is not None:
            accelerator.scaler.load_state_dict(training["scaler"])
    except torch.OutOfMemoryError:
        raise
    except (KeyError, ValueError, RuntimeError, TypeError) as e:  # e.g. another optimizer's state (AdamW vs Prodigy)
        raise UsageError(f"--resume_from_checkpoint {checkpoint}: its training state does not fit this run "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    restore_rng(checkpoint, accelerator.process_index)
    global_step = json.loads((checkpoint / TRAINER_STATE_NAME).read_text())["global_step"]
    logger.info(f"resumed from {checkpoint} at step {global_step}")
    return global_step


# ----------------------------------------------------------------------------------------------------------------
# Stage 5: the loop (train) and its batch-to-device path

def start_logging(args, accelerator, run, global_step):
    """Start the trackers and say, in one summary, what the run is about to do."""
    if accelerator.is_main_process:
        accelerator.init_trackers("dreambooth-flux2-lora", config=tracker_config(args))
    data, caches = run.data, run.caches
    images = (f", {len(caches.latents.store)} unique latents" if caches.latents is not None else
              f", images decoded by {data.loader.num_workers} DataLoader workers" if data.loader.num_workers else
              ", images decoded in the main process")
    lines = [f"{distributed_mode(accelerator)}, mixed precision {accelerator.mixed_precision}",
             describe_lora(adapted_modules(accelerator.unwrap_model(run.transformer)),
                           sum(p.numel() for p in run.named_params.values()), args.rank),
             f"{len(data.dataset)} samples, {len(data.sampler)} batches of {args.train_batch_size} per epoch and "
             f"process (the rest of each epoch is dropped, a different rest every epoch), {args.max_train_steps} "
             f"steps from step {global_step}, seed {data.seed}, {len(caches.prompts.store)} unique prompts{images}",
             describe_captions(data.dataset), *run.hooks.collect("describe", data.dataset)]
    for line in lines:
        logger.info(line)

@dataclass
class StepInputs:
    """A micro-batch's inputs as gathered on the host: each distinct cache entry once, and which entry each row takes
    (rows of a batch sharing a prompt move one embedding, 15.7 MB for [dev], not B of them)."""

    embeds: torch.Tensor  # [U, L, D] distinct prompt embeddings
    embed_rows: torch.Tensor  # [B] long, row -> embeds
    images: torch.Tensor  # cached: [V, 4C, h, w] latents ([V, 2, 4C, h, w] mean and std); else pixels [B, 3, H, W]
    image_rows: torch.Tensor  # [B] long, row -> images
    encoded: bool  # images are cached latents (else pixels the VAE encodes on the device)
    # option: class_images (B = 2 x the batch size: the instance rows, then their class rows)
    references: int = 0  # option: edit (condition images R per row: image_rows holds B(1 + R), the B targets first)
    extra_rows: int = 0  # option: trigger_words (output preservation's prompts: the last P of embed_rows)
    masks: torch.Tensor | None = None  # option: masked_loss ([V, 1, h, w] beside cached `images`, else [B, 1, H, W])

def gather_inputs(batch, dataset, caches, caption_dropout, rng, extra_texts=None):
    """Host side of a step: a collated batch -> StepInputs from the caches; `rng` draws caption dropout."""
    rows = list(batch["indices"])
    texts = [dataset.prompt_key(i, batch["epoch"]) for i in rows]
    extra = extra_texts(texts) if extra_texts else []  # option: trigger_words (output preservation's prompts)
    if dataset.instances[0].folder:  # option: folders (each row's folder's caption dropout)
        caption_dropout = [dataset.record(*dataset.source(i)[:2]).folder.caption_dropout for i in rows]
    texts = drop_captions(texts, caption_dropout, rng)
    rows += dataset.class_slots(rows)  # option: class_images
    texts += [dataset.prompt_key(s, batch["epoch"]) for s in rows[len(texts):]]  # option: class_images
    texts += extra  # option: trigger_words
    embeds, embed_rows = caches.prompts.gather_unique(texts)
    if caches.latents is None:
        inputs = StepInputs(embeds, embed_rows, batch["pixel_values"], torch.arange(len(rows)), encoded=False)
        if "cond_pixels" in batch:  # option: edit (the condition images after the targets, reference by reference)
            inputs.images = torch.cat([inputs.images, batch["cond_pixels"]])
            inputs.image_rows = torch.arange(len(inputs.images))
            inputs.references = len(batch["cond_pixels"]) // len(rows)
        inputs.masks = batch.get("masks")  # option: masked_loss
    else:
        keys = [dataset.latent_key(s, batch["epoch"]) for s in rows]
        references = [dataset.condition_keys(k) for k in keys]  # option: edit ([B][R]: each row's condition images)
        keys += [refs[r] for r in range(len(references[0])) for refs in references]  # option: edit (reference-major)
        latents, image_rows = caches.latents.gather_unique(keys)
        inputs = StepInputs(embeds, embed_rows, latents, image_rows, encoded=True)
        inputs.references = len(references[0])  # option: edit
        inputs.masks = caches.masks.gather_unique(keys)[0] if caches.masks is not None else None  # option: masked_loss
    inputs.extra_rows = len(extra)  # option: trigger_words
    return inputs

def each_tensor(inputs, fn):
    """A copy of StepInputs with fn applied to every tensor field (pin, move to the device): a field added to
    StepInputs travels without a list to edit."""
    fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    return dataclasses.replace(inputs, **{name: fn(v) for name, v in fields.items() if torch.is_tensor(v)})

class Prefetcher:
    """Runs a loader one micro-batch ahead: the next batch is fetched, gathered, pinned and copied to the GPU on a side
    stream while this step computes; the step calls prefetch() once its GPU work is queued and before anything
    waits for the GPU, so host work hides behind it. Yields (micro-step, batch, StepInputs on the device)."""

    def __init__(self, loader, first_micro, prepare, device):
        self.batches = enumerate(loader, start=first_micro)
        self.prepare, self.device = prepare, device  # prepare(micro, batch) -> StepInputs on the host
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead = None  # (micro, batch, inputs, copy-done event) of the next step

    def prefetch(self):
        if self.ahead is not None:
            return
        micro, batch = next(self.batches)
        inputs = self.prepare(micro, batch)
        if self.stream is None:
            self.ahead = (micro, batch, each_tensor(inputs, lambda t: t.to(self.device)), None)
            return
        with torch.cuda.stream(self.stream):  # pinned host memory: the copy is asynchronous
            inputs = each_tensor(inputs, lambda t: t.pin_memory().to(self.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record()
        self.ahead = (micro, batch, inputs, done)

    def __iter__(self):
        while True:
            self.prefetch()
            (micro, batch, inputs, done), self.ahead = self.ahead, None
            if done is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(done)
                each_tensor(inputs, lambda t: t.record_stream(stream))  # made on the side stream, used on this one
            yield micro, batch, inputs

def draw_latents(params, generator):
    """Cached posteriors -> training latents. params: [B, C, h, w] (mode: the mean, used as is) or
    [B, 2, C, h, w] (sample: mean and std, drawn z = mean + std * eps from `generator`)."""
    if params.ndim == 4:
        return params
    mean, std = params.unbind(1)
    eps = torch.randn(mean.shape, generator=generator, device=generator.device).to(mean)
    return mean + std * eps

def sample_sigmas(scheduler_sigmas, batch_size, weighting_scheme, logit_mean, logit_std, mode_scale, generator):
    """Draw one training sigma per sample from the timestep density (diffusers' SD3/FLUX recipe) -> [B].
    scheduler_sigmas: [T] the training schedule (timestep / 1000 of the untouched scheduler, highest first). A
    replacement draws from `generator` alone: a resumed run must draw what a straight run drew."""
    from diffusers.training_utils import compute_density_for_timestep_sampling
    u = compute_density_for_timestep_sampling(weighting_scheme, batch_size, logit_mean, logit_std, mode_scale,
                                              device=generator.device, generator=generator)
    num_timesteps = scheduler_sigmas.shape[0]
    index = (u * num_timesteps).long().clamp(0, num_timesteps - 1)
    return scheduler_sigmas.to(u.device)[index]

def shift_sigmas(sigmas, shift):
    """FLUX's time shift: sigma -> shift * sigma / (1 + (shift - 1) * sigma). It is the scheduler's exponential
    shift exp(mu) / (exp(mu) + 1 / sigma - 1) with shift = exp(mu): it moves noise levels up, keeping 0 and 1."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)

def timestep_shift_for(mode, image_tokens, num_steps):
    """--timestep_shift -> the shift of a batch of `image_tokens` (h * w) noisy tokens, None for none. auto: FLUX.2's
    training schedule; pipeline: the FLUX.2 pipelines' shift for `num_steps` sampling steps."""
    if mode == "auto":  # mu linear from 0.5 at 256 tokens to 1.15 at 4,096, unclamped (512²: shift 1.9; 1024²: 3.2)
        return math.exp(0.5 + (1.15 - 0.5) * (image_tokens - 256) / (4096 - 256))
    if mode == "pipeline":
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu  # [klein]'s is a copy of it
        return math.exp(compute_empirical_mu(image_tokens, num_steps))
    return None if mode == "none" else float(mode)

def flow_matching_loss(model_pred, target, weighting):
    """The weighted MSE of the velocity prediction, per sample, in float32: model_pred, target [B, L, C] packed
    tokens; weighting [B] -> [B]."""
    return (weighting.float().view(-1, 1, 1) * (model_pred.float() - target.float()) ** 2).flatten(1).mean(1)

def training_step(args, accelerator, run, micro, batch, inputs, prefetch, stop):
    """One micro-batch, top to bottom: the noisy input, the prediction, the loss and its backward; at the last
    micro-batch of an accumulation, the update (clipping, optimizer, learning rate) -> (the loss, detached; the stop
    signal the processes agreed at an update, else 0; the latents' (h, w)). Noise, timesteps and posterior draws come
    from a generator seeded by (seed, micro-step, process): a resumed run draws what a straight run drew."""
    from diffusers import Flux2Pipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3
    generator = torch.Generator(accelerator.device).manual_seed(
        seed_for("step", run.data.seed, micro, accelerator.process_index))
    if inputs.encoded:  # cached posteriors, [V, 4C, h, w] (or [V, 2, 4C, h, w]: mean and std) -> one per row
        params = inputs.images[inputs.image_rows]
    else:  # pixels [B, 3, H, W], encoded here
        with torch.no_grad(), on_device(run.vae, inputs.images.device, args.offload):
            params = encode_images(run.vae, inputs.images, *run.latent_stats, args.latent_sampling)
    params = params.float()  # the path and its target in float32; only the transformer's input is cast
    prompt_embeds = inputs.embeds.to(run.weight_dtype)[inputs.embed_rows]  # [B, L, D], expanded on the device
    bsz = len(inputs.embed_rows)
    bsz -= inputs.extra_rows  # option: trigger_words (output preservation's P rows come last)
    model_input = draw_latents(params[:bsz], generator)  # [B, 4C, h, w]
    noise = torch.randn(model_input.shape, generator=generator, device=generator.device).to(model_input.device)
    sigmas = sample_sigmas(run.sigmas, bsz, args.weighting_scheme, args.logit_mean, args.logit_std, args.mode_scale,
                           generator)  # [B]
    shift = timestep_shift_for(args.timestep_shift, model_input.shape[-2] * model_input.shape[-1], run.shift_steps)
    sigmas = (sigmas if shift is None else shift_sigmas(sigmas, shift)).to(model_input.device)
    s = sigmas.view(-1, 1, 1, 1)
    noisy_model_input = (1.0 - s) * model_input + s * noise  # the straight path from data (s=0) to noise (s=1)
    packed = Flux2Pipeline._pack_latents(noisy_model_input).to(run.weight_dtype)  # [B, 4C, h, w] -> [B, h*w, 4C]
    guidance = None if run.guidance is None else torch.full((bsz,), run.guidance, device=model_input.device)
    model_kwargs = dict(hidden_states=packed, timestep=sigmas, guidance=guidance,  # timestep / 1000 == sigma
                        encoder_hidden_states=prompt_embeds[:bsz], img_ids=Flux2Pipeline._prepare_latent_ids(
                            model_input).to(model_input.device),  # [B, h*w, 4]
                        txt_ids=Flux2Pipeline._prepare_text_ids(prompt_embeds[:bsz]).to(model_input.device))
    if inputs.references:  # option: edit (the clean references' tokens after the noisy target's, as the pipeline)
        means = params if params.ndim == 4 else params[:, 0]  # a reference: its posterior mean
        references = [means[bsz * r: bsz * (r + 1)] for r in range(1, 1 + inputs.references)]  # R of [B, 4C, h, w]
        model_kwargs = with_references(model_kwargs, references, run.weight_dtype)
    if inputs.extra_rows:  # option: trigger_words (P more rows, pulled toward the base model's prediction)
        model_kwargs, preservation_loss = with_preservation(run.transformer, model_kwargs, prompt_embeds[bsz:],
                                                            args.output_preservation_weight)
    model_pred = run.transformer(**model_kwargs, return_dict=False)[0]
    model_pred = model_pred[:, :packed.shape[1]]  # option: edit (the references' tokens are not trained)
    if inputs.extra_rows:  # option: trigger_words
        model_pred, preserved_pred = model_pred[:bsz], model_pred[bsz:]
    target = Flux2Pipeline._pack_latents(noise - model_input)  # the velocity, packed like the prediction
    weighting = compute_loss_weighting_for_sd3(args.weighting_scheme, sigmas)  # [B]
    per_sample = flow_matching_loss(model_pred, target, weighting)  # [B]
    if inputs.masks is not None:  # option: masked_loss (each sample's mean over its mask)
        per_sample = masked_loss(model_pred, target, weighting, token_mask(inputs, bsz, model_input.shape[-2:]))
    loss = per_sample.mean()
    if (n := len(batch["indices"])) < bsz:  # option: class_images (the class rows' loss, weighted, and the rest's)
        loss = per_sample[:n].mean() + args.prior_loss_weight * per_sample[n:].mean()
    if inputs.extra_rows:  # option: trigger_words
        loss = loss + preservation_loss(preserved_pred)
    accelerator.backward(loss)
    prefetch()  # the next batch's host work, while the GPU runs this one
    stop.finite = stop.finite & torch.isfinite(loss)  # every micro-batch of the update (read below: no sync here)
    if not accelerator.sync_gradients:
        return loss.detach(), 0, list(model_input.shape[-2:])
    signum, bad = stop.agreed(accelerator, (~stop.finite).long())  # the update's one host-device sync
    if bad:
        raise TrainingStopped(non_finite_loss(args, accelerator.mixed_precision == "fp16",
                                              micro // args.gradient_accumulation_steps + 1, batch["indices"]))
    accelerator.clip_grad_norm_(list(run.named_params.values()), args.max_grad_norm)
    run.optimizer.step()
    run.lr_scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.hooks.each("after_optimizer_step", run)
    return loss.detach(), signum, list(model_input.shape[-2:])

def log_step(args, accelerator, run, bar, global_step, loss, epoch, seconds):
    """Every step's figures go to the progress bar and the trackers; a log line at the first and last step, every
    --logging_steps and at each checkpoint or step validation (a thousand steps print a screen, not a thousand)."""
    logs = {"loss": loss.item(), "lr": run.lr_scheduler.get_last_lr()[0], "step_seconds": seconds, "epoch": epoch}
    line = f"step {global_step}/{args.max_train_steps} loss {logs['loss']:.4f} lr {logs['lr']:.2e} {seconds:.2f} s/step"
    if torch.cuda.is_available():
        logs["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        line += f" peak {logs['peak_gpu_gib']:.1f} GiB"
    bar.update(1)
    bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['lr']:.2e}")
    if global_step in (1, args.max_train_steps) or any(global_step % n == 0 for n in (
            args.logging_steps, args.checkpointing_steps, args.validation_steps) if n):
        logger.info(line)
    accelerator.log(logs, step=global_step)

def sample_log(args, accelerator, resumed):
    """Which samples this process trained on, a JSON line per micro-batch: cheap, and answers "what did it see?".
    Line-buffered, so readable while training runs; a fresh run's starts empty (an earlier run's is overwritten)."""
    path = Path(args.output_dir, args.logging_dir, f"samples-{accelerator.process_index}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("a" if resumed else "w", buffering=1)

def train(args, accelerator, run, global_step):
    """The loop: one flat stream of micro-batches across epochs; micro-step m is batch m % len(sampler) of epoch
    m // len(sampler), so a resumed run skips exactly the batches already trained -> a stop signal's number, or 0."""
    if global_step >= args.max_train_steps:  # resumed from the last step's checkpoint: only `finish` is left
        return 0
    data, micro = run.data, global_step * args.gradient_accumulation_steps
    accelerator.step = micro  # accelerate's accumulation counter: sync on every accum-th micro-step
    data.sampler.set_epoch(*divmod(micro, len(data.sampler)))
    extra_texts = run.hooks.first("extra_texts")
    prefetcher = Prefetcher(data.loader, micro, lambda m, batch: gather_inputs(
        batch, data.dataset, run.caches, args.caption_dropout,
        random.Random(seed_for("caption-dropout", data.seed, m, accelerator.process_index)), extra_texts),
        accelerator.device)
    bar = tqdm(total=args.max_train_steps, initial=global_step, desc="Steps",
               disable=not accelerator.is_local_main_process)
    stop = StopRequest("after this step and saving a checkpoint")
    run.transformer.train()
    tic = time.perf_counter()
    # log lines print above the progress bar, which closes first
    with sample_log(args, accelerator, data.checkpoint) as samples, stop, logging_redirect_tqdm(), bar:
        for micro, batch, inputs in prefetcher:
            with accelerator.accumulate(run.transformer):
                loss, signum, latent_hw = training_step(args, accelerator, run, micro, batch, inputs,
                                                        prefetcher.prefetch, stop)
            samples.write(json.dumps({"micro_step": micro, "epoch": batch["epoch"], "indices": batch["indices"],
                                      "latent_hw": latent_hw}) + "\n")
            if accelerator.sync_gradients:
                global_step += 1
                log_step(args, accelerator, run, bar, global_step, loss, batch["epoch"], time.perf_counter() - tic)
                tic = time.perf_counter()
                after_optimizer_step(args, accelerator, run, global_step, signum)
            if (micro + 1) % len(data.sampler) == 0:
                after_epoch(args, accelerator, run, global_step, batch["epoch"])
            if global_step >= args.max_train_steps:
                break
        late = stop.agreed(accelerator)[0]  # a signal after the last step's agreement counts too
        if late and not signum and global_step % args.checkpointing_steps:  # a checkpoint for the resume's `latest`
            save_checkpoint(args, accelerator, run, global_step)
        return late  # for `finish`: the LoRA and the card, not the final images

def validates_in_training(args, accelerator, run, global_step):
    """Whether a validation during training shows anything: prompts, images asked for, the final validation not
    about to show the same weights, and this process takes part."""
    final_follows = global_step >= args.max_train_steps and not args.skip_final_inference
    return (bool(args.validation_prompt or run.data.specs) and args.num_validation_images > 0 and not final_follows
            and validates_here(accelerator))

def after_optimizer_step(args, accelerator, run, global_step, signum):
    """Checkpoint every --checkpointing_steps (and on a stop signal), validate every --validation_steps."""
    if global_step % args.checkpointing_steps == 0 or signum:
        save_checkpoint(args, accelerator, run, global_step)
    if (args.validation_steps and global_step % args.validation_steps == 0
            and validates_in_training(args, accelerator, run, global_step)):
        run_validation(args, accelerator, run, f"step-{global_step:06d}", global_step)
    if signum and global_step < args.max_train_steps:  # at the last step, `finish` saves the LoRA first
        raise TrainingStopped(f"stopped by {signal.Signals(signum).name} at step {global_step}; continue "
                              "with the same command plus --resume_from_checkpoint latest", 128 + signum)

def after_epoch(args, accelerator, run, global_step, epoch):
    """Validate after epochs N, 2N, ... of --validation_epochs (1-based), unless --validation_steps just did."""
    just_validated = args.validation_steps and global_step % args.validation_steps == 0
    if ((epoch + 1) % args.validation_epochs == 0 and not just_validated
            and validates_in_training(args, accelerator, run, global_step)):
        run_validation(args, accelerator, run, f"epoch-{epoch + 1:04d}", global_step)


# ----------------------------------------------------------------------------------------------------------------
# Stage 6: validation and outputs (finish)

@dataclass(frozen=True)
class ValidationSpec:
    """One validation prompt and what it overrides (None: the run's --resolution, steps, guidance and noise)."""

    prompt: str
    height: int | None = None
    width: int | None = None
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None

def samples_with_cfg(family, guidance):
    """Whether the family's pipeline samples with classifier-free guidance at `guidance`: [klein] base above 1
    (its negative prompt: the empty one); [dev] embeds guidance and distilled [klein] takes none."""
    return family.pipeline == "Flux2KleinPipeline" and not family.distilled and guidance > 1

def uses_cfg(args, data):
    """Whether any validation of the run samples with classifier-free guidance."""
    guidances = [args.validation_guidance_scale] + [s.guidance for s in data.specs if s.guidance]
    return samples_with_cfg(data.family, max(guidances))

def pipeline_call(args, run, spec, device, family, steps):
    """The pipeline's arguments for one validation spec: its cached embeddings (and [klein] CFG's empty prompt), size
    steps, guidance, and the seed and device of its noise.
    Edit mode: the conditions, in their bucket."""
    guidance = spec.guidance if spec.guidance is not None else args.validation_guidance_scale
    call = {"prompt_embeds": run.caches.prompts[spec.prompt].to(device, run.weight_dtype),
            "height": spec.height or args.resolution, "width": spec.width or args.resolution,
            "num_inference_steps": spec.steps or steps, "guidance_scale": guidance,
            "seed": spec.seed if spec.seed is not None else seed_for("validation", run.data.seed), "device": device}
    if samples_with_cfg(family, guidance):
        call["negative_prompt_embeds"] = run.caches.prompts[""].to(device, run.weight_dtype)
    if run.data.condition is not None:  # option: edit (the pipeline appends the conditions' tokens, as training did)
        conditions, (height, width) = run.data.condition
        call.update(image=list(conditions), height=spec.height or height, width=spec.width or width)
    return call

def generate_images(pipeline, call, count, batch=None):
    """`count` images of one spec, `batch` (default: all) a pipeline call (out of memory: one by one), image k's
    noise from (seed, k) alone, whatever the batch."""
    call, images = dict(call), []
    device, seed = call.pop("device"), call.pop("seed")
    for first in range(0, count, batch or count):
        ks = range(first, min(count, first + (batch or count)))
        noise = lambda: [torch.Generator(device).manual_seed(seed_for(seed, k)) for k in ks]  # noqa: E731
        try:
            images.extend(pipeline(**call, num_images_per_prompt=len(ks), generator=noise()).images)
            continue
        except torch.OutOfMemoryError:  # caught here, so the batch's tensors are freed before the images one by one
            logger.warning_once("out of GPU memory making a validation's images in one batch: made one at a time")
        images.extend(pipeline(**call, generator=g).images[0] for g in noise())
    return images

@torch.no_grad()
@charged("validation")
def run_validation(args, accelerator, run, tag, step):
    """Generate validation images with the transformer being trained, without moving, casting or hooking it (or an
    option's, holding the same LoRA), for each of validation_specs at each of the options' strengths (default: 1); the
    first time, also the base model's (adapters off, same noise). Saves them in <output_dir>/validation/
    (<tag>-<row>.png, a row per prompt, strength and image) and shows them (progress sheet, trackers) -> their paths."""
    import diffusers
    # FSDP: the wrapped model's forward gathers its shards, a collective, so every process generates
    trained = run.transformer if is_fsdp(accelerator) else accelerator.unwrap_model(run.transformer)
    was_training, device = trained.training, accelerator.device
    trained.eval()
    # what samples, and in how many steps: this transformer, or an option's (on the CPU but while it samples)
    model, family, steps = run.hooks.chain("validation_model", (trained, run.data.family,
                                                                 args.validation_inference_steps))
    lora_steps, unwrapped = run.hooks.chain("validation_steps", steps, tag), accelerator.unwrap_model(model)
    extra = {"is_distilled": family.distilled} if family.pipeline == "Flux2KleinPipeline" else {}
    pipeline = getattr(diffusers, family.pipeline)(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_config(run.noise_scheduler.config), vae=run.vae,
        text_encoder=None, tokenizer=None, transformer=model, **extra)
    pipeline.set_progress_bar_config(disable=True)
    conditions = None
    conditions = run.data.condition[0] if run.data.condition is not None else None  # option: edit
    folder, specs = Path(args.output_dir, "validation"), validation_specs(args, run.data)
    scales = run.hooks.first("validation_scales", default=lambda: [1.0])
    made_from = base_record(args, run, specs, scales, unwrapped, steps, conditions)  # a change remakes base-i.png
    make_base = base_images_missing(accelerator, folder, made_from)
    base, images, sampling = [], [], on_device(model, device, model is not trained)
    with accelerator.autocast(), on_device(run.vae, device, args.offload), validation_oom(step), sampling:
        for spec in specs:
            if make_base:  # (its call moves the prompt's embeddings to the device: only when base images are made)
                with adapters_off(unwrapped):  # the same base images in every strength's rows, at the final's steps
                    base += generate_images(pipeline, pipeline_call(args, run, spec, device, family, steps),
                                            args.num_validation_images, args.validation_batch) * len(scales)
            call = pipeline_call(args, run, spec, device, family, lora_steps)
            for scale in scales:
                with run.hooks.context("lora_strength", unwrapped, scale), run.hooks.context("validation_weights"):
                    images += generate_images(pipeline, call, args.num_validation_images, args.validation_batch)
    trained.train(was_training)
    if not accelerator.is_main_process:
        return []
    with writing(folder):
        validation_folder(folder, tag, step, run.hooks)
        for name, batch in (("base", base), (tag, images)):
            for i, image in enumerate(batch):
                image.save(folder / f"{name}-{i}.png")
    show_validation(accelerator, folder, tag, step, specs, scales, images, made_from if make_base else None, conditions)
    run.hooks.each("validated", accelerator, folder, tag, step, specs, scales, images)  # scores (and keeps) them
    return [folder / f"{tag}-{i}.png" for i in range(len(images))]

def write_lora_files(accelerator, transformer, state, folder, dtype, hooks):
    """The final LoRA: diffusers' file, or what an option writes instead."""
    hooks.first("write_lora", accelerator, transformer, state, folder, dtype,
                default=lambda: save_lora(accelerator, transformer, state, folder, dtype))

def finish(args, accelerator, run, signum=0):
    """Save the LoRA (or the options' files), the final validation images (none after a stop signal: `signum`) and
    the model card. The main process writes; the fingerprint needs all.
    An option's gathering of the LoRA (FSDP) needs all too."""
    state = lora_state_dict(accelerator, run.transformer, run.hooks)
    fingerprint = hashlib.sha256(b"".join(v.numpy().tobytes() for _, v in sorted(state.items())))
    logger.info(f"LoRA fingerprint {fingerprint.hexdigest()[:16]}", main_process_only=False)  # all must agree
    dtype = torch.float32 if args.upcast_before_saving else run.weight_dtype
    if accelerator.is_main_process:
        with writing(Path(args.output_dir, LORA_WEIGHTS_NAME)), run.clock.charged("saving"):
            run.hooks.first("save_final", accelerator, run, state, args.output_dir, dtype,
                            default=lambda: write_lora_files(accelerator, run.transformer, state, args.output_dir,
                                                             dtype, run.hooks))
        logger.info(f"LoRA weights: {Path(args.output_dir, LORA_WEIGHTS_NAME)}")
    paths, stopped = [], None
    if signum:
        stopped = TrainingStopped(f"stopped by {signal.Signals(signum).name} at the last step: the LoRA is saved and "
                                  "the model card written without the final images", 128 + signum)
    elif (validation_specs(args, run.data) and not args.skip_final_inference and args.num_validation_images > 0
            and validates_here(accelerator)):
        try:  # a signal here stops the images, not the model card: the LoRA is saved already
            with StopRequest("", interrupt=True):
                paths = run_validation(args, accelerator, run, "final", args.max_train_steps)
        except TrainingStopped as e:
            stopped = e
    with StopRequest("once the model card is written") as stop:  # a process waiting here too (Slurm signals all)
        if accelerator.is_main_process:  # an option's repository first: the card's snippet loads the LoRA from it
            with run.clock.charged("saving"):
                repo_id = run.hooks.first("repository", stopped is None)
                with writing(Path(args.output_dir, "README.md")):
                    write_model_card(args, paths, run, repo_id)
                run.hooks.each("publish", repo_id)
        logger.info(run.clock.line())  # the main process's
        # a collective after the card: no process ends first (torchrun stops the rest once one fails), all stop alike
        signum = stop.join(accelerator, stopped.code - 128 if stopped is not None and stopped.code > 128 else 0)
        if stopped is not None or signum:
            raise stopped or TrainingStopped(f"stopped by {signal.Signals(signum).name} at the end: the LoRA is "
                                             "saved and the model card written", 128 + signum)


# ----------------------------------------------------------------------------------------------------------------
# Main

def main(argv=None):
    if "--write_copy" in {a.split("=")[0] for a in argv or sys.argv[1:]}:  # option: copies (a copy, no run)
        return write_copy(argv or sys.argv[1:])
    umask()  # settled while no thread runs
    quiet_library_imports()
    args = parse_args(argv)
    hooks = Hooks(args)
    validate_args(args, hooks)
    accelerator = setup_accelerator(args)
    for note in surprising_values(args, hooks):
        logger.warning(note)
    weight_dtype = DTYPES.get(accelerator.mixed_precision, torch.float32)
    clock = Clock()  # start-up from the process's start; its line ends the run
    try:  # out of memory anywhere (class images, precompute, loading, a step, validation) -> the advice, exit 1
        cache = open_cache(args)
        data = prepare_data(args, accelerator, cache, hooks)  # resolves the flags, then freezes them
        lock = hold_output_dir(args, accelerator)  # noqa: F841 - held while it is open: one run per output folder
        write_config(args, data, args.output_dir, accelerator)  # the resolved flags: a config to repeat the run
        with clock.charged("precompute"):
            caches, vae, latent_stats = precompute(args, accelerator, data, weight_dtype, cache)
        run = setup_training(args, accelerator, data, caches, vae, latent_stats, weight_dtype, clock)
        global_step = load_checkpoint(data.checkpoint, accelerator, run) if data.checkpoint is not None else 0
        start_logging(args, accelerator, run, global_step)
        clock.switch("training")  # the loop and what follows, less validation and saving
        signum = train(args, accelerator, run, global_step)
        finish(args, accelerator, run, signum)
    except torch.OutOfMemoryError:
        raise TrainingStopped(OOM_ADVICE) from None
    finally:  # the model is freed before the process group: a gloo group DDP frees last hangs or aborts at exit
        hooks = None  # noqa: F841  # option: any (an option may keep the run)
        run = data = None  # noqa: F841
        if accelerator.num_processes > 1:  # an error's frames hold it too (one process keeps them, for a debugger)
            traceback.clear_frames(sys.exc_info()[2])
        accelerator.free_memory()
        accelerator.end_training()


# ================================================================================================================
# Part 2: plumbing every run uses (read it when it breaks)
# ================================================================================================================


# ----------------------------------------------------------------------------------------------------------------
# The command line: what a flag accepts, --help, one-line errors

class Accepts:
    """A flag's type=: `convert` turns the text into a value, `ok(value)` says whether the flag takes it, `what` says
    what it takes: --help shows it, a refusal quotes it. `text(value)`: the text config.yaml records, where the value
    is not one `convert` reads back (a size in bytes)."""

    def __init__(self, what, ok=None, convert=str, text=None):
        self.what, self.ok, self.convert, self.text, self.__name__ = what, ok, convert, text, convert.__name__

    def __call__(self, text):
        return self.convert(text)

def integer(low, high=None):
    return Accepts(f"an integer >= {low}" if high is None else f"an integer from {low} to {high}",
                   lambda v: v >= low and (high is None or v <= high), int)

def number(low=-math.inf, high=math.inf, low_open=False, high_open=False):
    what = ("a finite number" if (low, high) == (-math.inf, math.inf) else
            f"a number {'>' if low_open else '>='} {low}" if high == math.inf else
            f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")
    return Accepts(what, lambda v: math.isfinite(v) and (v > low if low_open else v >= low) and (
        v < high if high_open else v <= high), float)

def boolean(text):
    if text.lower() not in ("1", "true", "yes", "y", "0", "false", "no", "n"):
        raise ValueError(text)
    return text.lower() in ("1", "true", "yes", "y")

def shift(text):
    return text if text in ("none", "auto", "pipeline") else float(text)

def numbers(text):
    return [float(x) for x in text.split(",")]

def side_list(text):
    """'512' -> 512; '512,768,1024' -> (512, 768, 1024)."""
    values = tuple(int(v) for v in text.split(","))
    return values[0] if len(values) == 1 else values

def sides_ok(value):
    values = (value,) if isinstance(value, int) else value
    return len(set(values)) == len(values) and all(16 <= v <= 4096 and v % 16 == 0 for v in values)

def folder_can_be(path, writable=False):
    """Whether `path` is a folder (writable, if asked) or could be made: its nearest existing parent writable."""
    path = Path(path).absolute()
    if path.exists():
        return path.is_dir() and (not writable or os.access(path, os.W_OK | os.X_OK))
    parent = next(p for p in path.parents if p.exists())
    return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)

TRACKERS = ("tensorboard", "wandb", "aim", "trackio", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab")
positive_int, non_negative_int, seed_value = integer(1), integer(0), integer(0, 2**32 - 1)  # numpy seeds: 32 bits
probability, below_one = number(0, 1), number(0, 1, high_open=True)
positive, non_negative, finite = number(0, low_open=True), number(0), number()
mode_scale = number(-1, 1.75)  # the mode density is monotonic on [0, 1] only for -1 <= scale <= 1 / (pi / 2 - 1)
model_source = Accepts("a local checkpoint folder or a Hub id (name or owner/name)", lambda v: Path(v).is_dir() or (
    not Path(v).exists() and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", v) is not None))
existing_folder = Accepts("an existing, readable folder",
                          lambda v: Path(v).is_dir() and os.access(v, os.R_OK | os.X_OK))
readable_file = Accepts("a readable file", lambda v: Path(v).is_file() and os.access(v, os.R_OK))
# existing download and class folders may be read-only (a shared model cache, class images all there)
folder_to_write = Accepts("a folder, existing or to be created", folder_can_be)
output_folder = Accepts("a folder, existing or to be created, that this user can write",
                        lambda v: folder_can_be(v, writable=True))
cache_folder = Accepts(  # option: disk_cache
    "none, or a folder (one that cannot be written warns and keeps entries in memory)")
checkpoint_name = Accepts("a checkpoint folder, the name of one in --output_dir, or 'latest' "
                          "(checked with --output_dir)")
logging_folder = Accepts("a folder, relative to --output_dir (checked with it)")
# FLUX.2 samples up to 4 MP (2048^2); 4096 leaves room for buckets, beyond it one image is over 65k tokens
sides = Accepts("sides from 16 to 4096, multiples of 16, distinct, comma-separated", sides_ok, side_list)
bucket_lists = Accepts("'h,w;h,w;...' with sides multiples of 16 (with several --resolution sides, a list per side, "
                       "separated by |)", lambda v: all(map(parse_buckets, v.split("|"))))
layer_list = Accepts("presets and module names, comma-separated", lambda v: any(t.strip() for t in v.split(",")))
timestep_shift = Accepts("none, auto, pipeline or a number from 1e-7 to 1e38", lambda v: v in (
    "none", "auto", "pipeline") or 1e-7 <= v <= 1e38, shift)  # beyond, float32 sigmas overflow (test_learning)
tracker_list = Accepts(f"none, all, or trackers among {', '.join(TRACKERS)} (comma-separated)",
                       lambda v: v in ("none", "all") or all(t in TRACKERS for t in v.split(",")))

class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's help, then what it accepts and its default (a help that says what its absence means holds
    'default:' itself)."""

    def _get_default_metavar_for_optional(self, action):
        return {"int": "N", "float": "X", "boolean": "BOOL"}.get(getattr(action.type, "__name__", "")) or (
            "DIR" if action.dest.endswith("_dir") else "VALUE")

    def _get_help_string(self, action):
        text = action.help or ""
        if isinstance(action.type, Accepts):
            text += f" Accepts {action.type.what}."
        if action.default is not None and action.default is not False and action.default is not argparse.SUPPRESS:
            text += " Default: %(default)s."
        elif action.default is None and not action.required and "default:" not in text:
            text += " Default: none."
        return text

def refuse(condition, message):
    """A check: `message` (built whether or not it is needed: keep it cheap and safe) when `condition` holds."""
    if condition:
        raise UsageError(message)

class Switch(argparse._StoreTrueAction):  # option: config
    """action="store_true": on when given bare (the diffusers example's command lines), and it also takes true or
    false, so the command line can turn off what a config file turned on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nargs, self.type = "?", Accepts("nothing (on), true or false", None, boolean)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)  # the const (True) when bare

class _Parser(argparse.ArgumentParser):
    """A bad flag is one line and exit 2 (argparse would print its usage of 100 flags first); a refused value names
    the flag, the value and what the flag accepts. A default is not checked: it is the script's own choice."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)  # no prefixes: they read --keep as --keep_best
        self.register("action", "store_true", Switch)  # option: config

    def error(self, message):
        raise UsageError(f"{message} (see --help)")

    def _get_value(self, action, text):
        rule, shown = action.type, text if text.isprintable() else repr(text)  # one line, whatever the value holds
        try:
            value = super()._get_value(action, text)
        except argparse.ArgumentError:  # "invalid memory_size value": say what the flag takes
            refuse(isinstance(rule, Accepts), f"{action.option_strings[0]} {shown}: expected {rule.what}")
            raise
        if isinstance(rule, Accepts) and rule.ok is not None and text is not action.default:
            ok = False
            with contextlib.suppress(TypeError, ValueError, OSError, RuntimeError):
                ok = rule.ok(value)
            refuse(not ok, f"{action.option_strings[0]} {shown}: expected {rule.what}")
        return value

VERSION = "2026.11.26"  # written into every resolved config

def resolved_config(args, seed, accelerator, max_train_steps=None, run_id=None):
    """Every flag's final value (what the family and the options resolved included, never the Hub token), the seed
    used and the script's version: a config file that repeats the run."""
    config = {}
    for action in build_parser()._actions:
        value = vars(args).get(action.dest)
        if action.option_strings and action.dest not in ("help", "config", "print_config", "hub_token"):
            to_text = getattr(action.type, "text", None) if value is not None else None
            config[action.dest] = to_text(value) if to_text else list(value) if isinstance(value, tuple) else value
    config.update(resolution=",".join(map(str, args.resolutions)), seed=seed,
                  max_train_steps=config["max_train_steps"] or max_train_steps, version=VERSION)
    config["mixed_precision"] = accelerator.mixed_precision  # without the flag, accelerate's config or environment's
    if vars(args).get("transformer_sha256"):  # option: transformer_file (its content, beside its name)
        config["transformer_file_sha256"] = args.transformer_sha256
    return {**config, "run": run_id} if run_id else config

def write_config(args, data, folder, accelerator, run_id=None):
    """<folder>/config.yaml: the resolved config (a checkpoint's carries its run's identity)."""
    import yaml
    if accelerator.is_main_process:
        config = resolved_config(args, data.seed, accelerator, run_id=run_id)
        Path(folder, "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))

def parse_buckets(text):
    """'h1,w1;h2,w2' -> [(h1, w1), (h2, w2)]; every side a positive multiple of 16."""
    buckets = []
    for pair in filter(None, (s.strip() for s in text.split(";"))):
        m = re.fullmatch(r"(\d+)\s*,\s*(\d+)", pair)
        refuse(not m, f"--aspect_ratio_buckets {text}: {pair!r} is not 'height,width'")
        h, w = int(m.group(1)), int(m.group(2))
        if h <= 0 or w <= 0 or h % 16 or w % 16:
            raise UsageError(f"--aspect_ratio_buckets {text}: sides must be positive multiples of 16, got {h},{w}")
        buckets.append((h, w))
    refuse(not buckets, f"--aspect_ratio_buckets {text}: no bucket given (expected 'h,w;h,w;...')")
    return list(dict.fromkeys(buckets))

def resolve_buckets(args):
    """The buckets: a list, or with several --resolution sides one list per side (--aspect_ratio_buckets: lists
    separated by |, one per side)."""
    if args.aspect_ratio_buckets:
        ladders = [parse_buckets(part) for part in args.aspect_ratio_buckets.split("|")]
        refuse(len(ladders) != len(args.resolutions), f"--aspect_ratio_buckets gives {len(ladders)} bucket list(s) "
               f"for {len(args.resolutions)} --resolution side(s); separate one list per side with |")
    else:
        ladders = [bucket_ladder(r) if args.use_aspect_ratio_buckets else [(r, r)] for r in args.resolutions]
    return ladders[0] if len(ladders) == 1 else ladders


# ----------------------------------------------------------------------------------------------------------------
# Pre-flight checks: the model's configs, checkpoints, the batch size, surprising values

def empty_transformer(args):
    """The checkpoint's transformer on the meta device: its modules and shapes from its config, no weights read."""
    from accelerate import init_empty_weights
    from diffusers import Flux2Transformer2DModel
    config = read_model_json(args, "transformer/config.json", "transformer config")
    for key, p in inspect.signature(Flux2Transformer2DModel).parameters.items():  # diffusers: a TypeError
        kind = {int: int, float: (int, float)}.get(type(p.default))
        refuse(kind and not isinstance(config.get(key, p.default), kind), f"--pretrained_model_name_or_path "
               f"{args.pretrained_model_name_or_path}: transformer/config.json's {key} is {config.get(key)!r}, "
               f"expected {'an integer' if kind is int else 'a number'}")
    with init_empty_weights():
        return Flux2Transformer2DModel.from_config(config)

def check_model_fit(args, hooks=None):
    """The flags that must fit this checkpoint, from its config files (no weights are read): the text-encoder layers
    exist and stack to the width the transformer takes; every --lora_layers entry is a preset or names linear layers
    of the transformer; then the options'. hooks: the run's options (default: those `args` turns on)."""
    hooks = hooks or Hooks(args)
    model = empty_transformer(args)
    if not hooks.flag("no_text_encoder"):  # a remote encoder or a manifest's embeddings: no text encoder here
        text = read_model_json(args, "text_encoder/config.json", "text_encoder config")
        text = text.get("text_config", text)  # [dev]'s Mistral 3 nests its language model's config
        try:
            depth, width, joint = text["num_hidden_layers"], text["hidden_size"], model.config["joint_attention_dim"]
        except (KeyError, TypeError) as e:
            raise UsageError(f"--pretrained_model_name_or_path {args.pretrained_model_name_or_path}: its text_encoder "
                             f"or transformer config lacks {e}") from None
        layers = args.text_encoder_out_layers
        flag = f"--text_encoder_out_layers {' '.join(map(str, layers))}"
        refuse(max(layers) > depth, f"{flag}: this text encoder has layers 0 to {depth} (0: its embeddings)")
        refuse(len(layers) * width != joint, f"{flag}: {len(layers)} layers of width {width} make "
               f"{len(layers) * width} features; this transformer takes {joint} ({joint // width} layers)")
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if n}
    targets = lora_target_modules(args.lora_layers, model.config.num_single_layers, block_linear_names(model))
    problems = unusable_lora_targets(targets, kinds)
    if problems:
        valid = sorted({re.sub(r"^(single_)?transformer_blocks\.\d+\.", "", n)
                        for n, k in kinds.items() if k == "Linear"})
        raise UsageError(f"--lora_layers {'; '.join(f'{t}: {why}' for t, why in problems.items())}; presets: "
                         f"{', '.join(LORA_PRESETS)}; valid names include {', '.join(valid[:16])}")
    hooks.each("check_model", model)

def unusable_lora_targets(targets, kinds):
    """PEFT target names it cannot adapt -> {name: why}. kinds: {module name: class name}. A name must match (as PEFT
    matches) linear layers and nothing else: PEFT refuses anything else it matches, e.g. `to_out`, a ModuleList in
    the double-stream blocks, and only once the model is loaded."""
    problems = {}
    for target in targets:
        matched = [n for n in kinds if peft_matches(n, [target])]
        others = [n for n in matched if kinds[n] != "Linear"]
        if len(others) == len(matched):
            problems[target] = "no linear layer of the transformer has that name"
        elif others:
            problems[target] = (f"also names {others[0]} ({kinds[others[0]]}), which LoRA cannot adapt; name the "
                                "linear layers more exactly (e.g. attn.to_out.0, "
                                "single_transformer_blocks.0.attn.to_out)")
    return problems

def block_linear_names(model):
    """Full names of the linear layers inside the double- and single-stream blocks (not the embedders, the shared
    modulation, norm_out or proj_out)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and re.match(r"(single_)?transformer_blocks\.\d+\.", n)]

def transformer_blocks(transformer):
    """The repeated blocks in execution order: double-stream, then single-stream."""
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

def adapted_modules(model):
    """Names of the modules that carry an adapter (without the prefixes of the wrappers: checkpointing, options')."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    return [re.sub(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.", "", n)
            for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]

def describe_lora(modules, num_params, rank):
    """'LoRA rank R on M modules (D double-stream, S single-stream blocks), P M trainable parameters'."""
    blocks = collections.defaultdict(set)
    for name in modules:
        kind, block = (name.split(".") + [""])[:2]
        blocks[kind if kind in ("transformer_blocks", "single_transformer_blocks") else "other"].add(block)
    other = f", {len(blocks['other'])} outside them" if blocks["other"] else ""
    return (f"LoRA rank {rank} on {len(modules)} modules ({len(blocks['transformer_blocks'])} double-stream, "
            f"{len(blocks['single_transformer_blocks'])} single-stream blocks{other}), {num_params / 1e6:.3g} M "
            "trainable parameters")

def checkpoint_problem(folder):
    """Why checkpoint `folder` cannot be resumed from (None: it can): a file missing or unreadable, JSON that does not
    parse, a tensor file cut short, or a tensor its JSON names that the tensor file lacks. Headers only: checked in
    milliseconds, before any model loads. Whether its tensors fit the model is load_checkpoint's test."""
    folder = Path(folder)

    def tensor_names(skeleton):
        if isinstance(skeleton, dict):
            return [skeleton["__tensor__"]] if "__tensor__" in skeleton else [
                n for _, v in skeleton["__items__"] for n in tensor_names(v)]
        return [n for v in skeleton for n in tensor_names(v)] if isinstance(skeleton, list) else []

    name = TRAINER_STATE_NAME
    try:
        state = json.loads((folder / name).read_text())
        if not (isinstance(state, dict) and isinstance(state.get("global_step"), int) and state["global_step"] >= 0
                and isinstance(state.get("seed"), int)):
            return f"{name} has no global_step and seed"
        run = state.get("run")  # checkpoints before run identities have none
        for stem in ("training", *sorted(p.stem for p in folder.glob("rng-*.json"))):
            name = f"{stem}.json"
            data = json.loads((folder / name).read_text())
            if run is not None and (not isinstance(data, dict) or data.get("run") != run):
                return f"{name} was written by another run than {TRAINER_STATE_NAME} (files of two runs)"
            skeleton = skeleton_of(data)
            name = f"{stem}.safetensors"
            header = safetensors_header(folder / name)
            missing = [n for n in tensor_names(skeleton) if n not in header]
            if missing:
                return f"{name} lacks {len(missing)} tensors that {stem}.json names (e.g. {missing[0]})"
            if stem == "training" and "lora" not in dict(skeleton["__items__"]):
                return f"{stem}.json holds no LoRA"
        for path in sorted(folder.glob("*.safetensors")) if run is not None else []:
            name = path.name
            if safetensors_header(path).get("__metadata__", {}).get("run") != run:
                return f"{name} was written by another run than {TRAINER_STATE_NAME} (files of two runs)"
        name = "config.yaml"
        if run is not None and (folder / name).is_file() and not re.search(  # YAML quotes an all-digit identity
                rf"^run: '?{run}'?$", (folder / name).read_text(), re.M):
            return f"{name} was written by another run than {TRAINER_STATE_NAME} (files of two runs)"
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror or e})"
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        return f"{name} is damaged ({type(e).__name__}: {e})"
    return None

def state_fit_problem(saved, expected):
    """Saved tensors (name -> tensor) against what the model has (name -> shape, or None where the model cannot tell)
    -> what differs, or None."""
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    resized = [f"{n} {tuple(saved[n].shape)} vs {tuple(expected[n])}" for n in sorted(set(saved) & set(expected))
               if expected[n] is not None and tuple(saved[n].shape) != tuple(expected[n])]
    parts = [f"{len(missing)} tensors missing (e.g. {missing[0]})" if missing else "",
             f"{len(unexpected)} it has and this model has not (e.g. {unexpected[0]})" if unexpected else "",
             f"{len(resized)} of another shape (e.g. {resized[0]})" if resized else ""]
    return "; ".join(filter(None, parts)) or None

def check_checkpoint_fits(checkpoint, accelerator, run, training):
    """Refuse a checkpoint whose LoRA, optimizer or options' state does not fit this model and these flags."""
    from peft.utils import get_peft_model_state_dict
    expected = run.hooks.first("expected_lora", accelerator, run, default=lambda: {
        k: v.shape for k, v in get_peft_model_state_dict(accelerator.unwrap_model(run.transformer)).items()})
    problem = state_fit_problem(training["lora"], expected) or run.hooks.first("training_state_problem", training)
    saved_groups = [len(g["params"]) for g in training["optimizer"].get("param_groups", [])]
    groups = [len(g["params"]) for g in run.optimizer.param_groups]
    if problem is None and not is_fsdp(accelerator) and saved_groups != groups:
        problem = f"its optimizer holds {saved_groups} parameters per group, this run's optimizer other numbers"
    refuse(problem, f"--resume_from_checkpoint {checkpoint}: its LoRA does not fit this model and these flags "
                    f"({problem}); was it trained with another --rank, --lora_layers or model?")

def surprising_values(args, hooks=None):
    """Legal values that are probably not what the user meant -> one warning line each (the options' too).
    hooks: the run's options (default: those `args` turns on)."""
    hooks, cores = hooks or Hooks(args), cpu_cores()
    notes = [
        (args.caption_dropout > 0.5, f"--caption_dropout {args.caption_dropout}: most instance samples train on the "
                                     "empty prompt, so the subject is barely tied to its prompt"),
        (args.max_sequence_length < 64, f"--max_sequence_length {args.max_sequence_length}: the chat template's system "
                                        "message fills about 25 tokens first, so captions are cut short or away"),
        (args.resolution > 2048, f"--resolution {args.resolution}: beyond FLUX.2's 4-megapixel range (2048^2)"),
        (not hooks.flag("replaces_optimizer") and args.learning_rate > 1e-2, f"--learning_rate {args.learning_rate} "
         "with AdamW: LoRA runs use 1e-4 to 1e-3 and usually diverge above 1e-2"),
        (args.dataloader_num_workers is not None and args.dataloader_num_workers > cores,
         f"--dataloader_num_workers {args.dataloader_num_workers}: more workers than this machine's {cores} cores"),
        (args.max_train_steps is not None and args.checkpointing_steps > args.max_train_steps,
         f"--checkpointing_steps {args.checkpointing_steps} > --max_train_steps {args.max_train_steps}: no checkpoint "
         "is written before the end"),
        (args.lr_scheduler != "constant" and args.max_train_steps is not None
         and args.lr_warmup_steps >= args.max_train_steps, f"--lr_warmup_steps {args.lr_warmup_steps} >= "
         f"--max_train_steps {args.max_train_steps}: the learning rate never reaches its peak"),
        (args.validation_prompt is not None and args.num_validation_images == 0,
         "--validation_prompt with --num_validation_images 0: no validation images are made"),
        (args.validation_prompt and args.final_validation_prompt, "--final_validation_prompt is ignored with "
         "--validation_prompt (as in the diffusers example): every validation, the final one too, uses the latter"),
        (args.rank > 256, f"--rank {args.rank}: a LoRA this large trains like a full fine-tune, at its memory cost"),
    ]
    return [note for surprising, note in notes if surprising] + hooks.collect("notes")

def find_resume_checkpoint(args, prints_only=False):
    """The checkpoint to resume from, checked before any model loads. `latest` passes over damaged checkpoints (with
    a warning each) to the newest whole one; a damaged checkpoint named by path is refused. prints_only: the run
    prints and stops (an option's), so an earlier run's checkpoints are no obstacle."""
    if args.resume_from_checkpoint is None:  # a fresh run among an earlier run's checkpoints would mix with them
        found = [] if args.overwrite_output_dir or prints_only else list_checkpoints(args.output_dir)
        if found:
            raise UsageError(f"--output_dir {args.output_dir} holds an earlier run's checkpoints (newest: "
                             f"{found[-1].name}); continue it with --resume_from_checkpoint latest, choose another "
                             "--output_dir, or pass --overwrite_output_dir to start over (its checkpoints are deleted)")
        return None
    if args.resume_from_checkpoint == "latest":
        found = list_checkpoints(args.output_dir)
        if not found:  # a finished run without checkpoints: starting again would overwrite its LoRA and seed
            refuse(Path(args.output_dir, LORA_WEIGHTS_NAME).exists() and not args.overwrite_output_dir,
                   f"--resume_from_checkpoint latest: {args.output_dir} holds a finished LoRA and no checkpoint to "
                   "continue from; choose another --output_dir, or pass --overwrite_output_dir to train it again")
            logger.warning(f"--resume_from_checkpoint latest: no checkpoint in {args.output_dir}; starting from "
                           "scratch")
            return None
        for path in reversed(found):
            problem = checkpoint_problem(path)
            if problem is None:
                return path
            logger.warning(f"--resume_from_checkpoint latest: skipping {path}: {problem}")
        raise UsageError(f"--resume_from_checkpoint latest: none of the {len(found)} checkpoints in {args.output_dir} "
                         f"can be resumed from (newest, {found[-1].name}: {checkpoint_problem(found[-1])}); move them "
                         "away to start from scratch")
    path = Path(args.resume_from_checkpoint)
    if not (path / TRAINER_STATE_NAME).is_file():
        raise UsageError(f"--resume_from_checkpoint {path}: not a complete checkpoint (no {TRAINER_STATE_NAME})")
    problem = checkpoint_problem(path)
    refuse(problem, f"--resume_from_checkpoint {path}: a damaged checkpoint: {problem}")
    return path

def check_resume_processes(args, checkpoint, accelerator):
    """Refuse a resume that cannot continue the checkpointed run: processes that found different checkpoints (an
    --output_dir per machine without the checkpoint copied to each), or a checkpoint another number of processes
    wrote (one rng-<rank> file each): each process's data, its random streams and the effective batch depend on it.
    The number of machines may change (2 x 1 = 1 x 2 processes)."""
    if args.resume_from_checkpoint is None:
        return
    step = json.loads((checkpoint / TRAINER_STATE_NAME).read_text())["global_step"] if checkpoint is not None else None
    if accelerator.num_processes > 1:
        found = gather_object([(step, str(checkpoint) if checkpoint is not None else f"none in {args.output_dir}")])
        listed = "; ".join(f"process {r}: {c}" for r, (_, c) in enumerate(found))
        refuse(len({s for s, _ in found}) > 1, f"--resume_from_checkpoint {args.resume_from_checkpoint}: the "
               f"processes found different checkpoints ({listed}); every process reads the checkpoint: share "
               "--output_dir between machines, or copy checkpoint-N into each machine's --output_dir")
    saved = len(list(checkpoint.glob("rng-*.json"))) if checkpoint is not None else 0
    refuse(saved and saved != accelerator.num_processes, f"--resume_from_checkpoint: {checkpoint} was written by "
           f"{saved} process{'es' * (saved > 1)}, this run has {accelerator.num_processes}; resume on {saved} (any "
           "number of machines), or start a new run")

def check_batches_early(args, instances, seed, processes, classes_wanted):
    """The batch size, before the model's files are read.
    Class images are counted as wanted, before they are generated: more than that only add samples."""
    buckets = resolve_buckets(args)
    samples = sample_images(instances, args.repeats, len(args.resolutions))
    groups = sample_groups(instances, buckets, samples, max(len(samples), classes_wanted))
    sampler = BucketBatchSampler(groups, args.train_batch_size, seed, num_replicas=processes)
    check_batches(args.train_batch_size, sampler, ladder_buckets(buckets)[1])
    return len(sampler)

def check_batches(batch_size, sampler, buckets):
    """Refuse a batch size that leaves a process no full batch in an epoch (each batch holds one bucket)."""
    if len(sampler) == 0:
        sizes = {buckets[group[0]]: len(members) for group, members in sorted(sampler.by_bucket.items())}
        sizes = {(*buckets[b], f"{r} references") if r else buckets[b]: len(members)  # option: edit
                 for (b, r), members in sorted(sampler.by_bucket.items())}
        raise UsageError(f"--train_batch_size {batch_size} leaves no full batch: samples per bucket (h, w) are {sizes} "
                         f"over {sampler.num_replicas} process(es); lower --train_batch_size, raise --repeats, or use "
                         "fewer buckets")

def warn_small_images(dataset):
    small = list(dict.fromkeys(r.name for ids in dataset.image_buckets for r, b in zip(dataset.instances, ids)
                               if r.size[0] < dataset.buckets[b][1] or r.size[1] < dataset.buckets[b][0]))
    if small:
        logger.warning(f"{len(small)} image(s) are smaller than their bucket and will be upscaled "
                       f"({', '.join(small[:5])}{', ...' if len(small) > 5 else ''})")


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint and LoRA files: safetensors and JSON (nothing is unpickled), atomic writes, file modes, the seed

def adapter_settings(accelerator, transformer):
    """The PEFT config of the run's adapter (PEFT names it "default")."""
    return accelerator.unwrap_model(transformer).peft_config["default"]

def portable_lora(state, config):
    """Fold each module's scale (alpha / its rank; rank_pattern: an option's ranks per module) into its lora_B, so
    the file means the same to every loader: diffusers and PEFT read alpha from the file's metadata (written as
    alpha = rank: scale 1), while ComfyUI, the main consumer of FLUX.2 LoRAs, reads it only from `.alpha` tensors,
    else applies scale 1. -> (state, config): the file's tensors and its PEFT config."""
    ranks = {m.strip("^$"): r for m, r in config["rank_pattern"].items()}
    state = {k: v.float() * (config["lora_alpha"] / ranks.get(k.rsplit(".lora_", 1)[0], config["r"]))
             if ".lora_B." in k else v for k, v in state.items()}
    return state, {**config, "lora_alpha": config["r"], "alpha_pattern": dict(config["rank_pattern"])}  # scales 1

def save_lora(accelerator, transformer, state, folder, dtype=None, weight_name=LORA_WEIGHTS_NAME, run_id=None):
    """The adapter as diffusers' FLUX.2 LoRA file (what Flux2Pipeline.save_lora_weights writes: transformer.<name>
    tensors, the PEFT config as lora_adapter_metadata), a LoRA's scale folded in (portable_lora), in `dtype`
    (default: its own); in a checkpoint, with the run's identity."""
    from safetensors.torch import save_file
    config = adapter_settings(accelerator, transformer).to_dict()
    if config["peft_type"] == "LORA":
        state, config = portable_lora(state, config)
    if config["peft_type"] in ("LOKR", "LOHA"):  # option: adapters
        state, config = portable_lycoris(state, config)
    config.update(target_modules=sorted(config["target_modules"]))
    config = {f"transformer.{k}": sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    metadata = {"format": "pt", "lora_adapter_metadata": json.dumps(config, indent=2, sort_keys=True)}
    save_file({f"transformer.{k}": v.to(dtype or v.dtype).contiguous() for k, v in state.items()},
              str(Path(folder, weight_name)), metadata={**metadata, **({"run": run_id} if run_id else {})})
    follow_umask(Path(folder, weight_name))

WRITE_ERRORS = (OSError, SafetensorError)  # safetensors reports an I/O failure (a full disk) as its own error
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)(\.partial(-\w+)?)?$")  # checkpoint-N.partial-<run>: being written
RUN_LOCK = ".run.lock"  # in --output_dir: locked by the main process of the run writing there

def flatten_state(obj, tensors, path="t"):
    """Nested state (dicts, lists, tensors, scalars) -> a JSON-able skeleton; tensors go into `tensors` by path."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": path}
    if isinstance(obj, dict):  # items as pairs: optimizer state is keyed by int
        return {"__items__": [[k, flatten_state(v, tensors, f"{path}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [flatten_state(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {path}")

def unflatten_state(obj, tensors):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        return {k: unflatten_state(v, tensors) for k, v in obj["__items__"]}
    if isinstance(obj, list):
        return [unflatten_state(v, tensors) for v in obj]
    return obj

def write_state(folder, name, state, run_id=None):
    """state -> <name>.json + <name>.safetensors, both holding the run's identity."""
    from safetensors.torch import save_file
    tensors = {}
    skeleton = flatten_state(state, tensors)
    save_file(tensors, str(Path(folder, f"{name}.safetensors")), metadata={"run": run_id} if run_id else None)
    follow_umask(Path(folder, f"{name}.safetensors"))
    Path(folder, f"{name}.json").write_text(json.dumps({"run": run_id, "state": skeleton} if run_id else skeleton))

def skeleton_of(data):
    """A state's JSON -> its skeleton (checkpoints before run identities hold the bare skeleton)."""
    return data["state"] if isinstance(data, dict) and "state" in data and "run" in data else data

def read_state(folder, name):
    from safetensors.torch import load_file
    return unflatten_state(skeleton_of(json.loads(Path(folder, f"{name}.json").read_text())),
                           load_file(str(Path(folder, f"{name}.safetensors"))))

def rng_state():
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    return {"torch": torch.get_rng_state(), **cuda}  # LoRA dropout draws from the global generators

def restore_rng(checkpoint, rank):
    """This process's RNG state from a checkpoint (one file per process; check_resume_processes checked the count)."""
    if (checkpoint / f"rng-{rank}.json").is_file():
        rng = read_state(checkpoint, f"rng-{rank}")
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])

@contextlib.contextmanager
def writing(path):
    """A write that fails (a full disk or quota, --output_dir removed under the run) ends the run with one line naming
    `path` (exit 1), not a traceback. A folder that vanished is not made again (an empty one would hide the loss)."""
    if not Path(path).parent.is_dir():
        raise TrainingStopped(f"could not write {path}: {Path(path).parent} is gone (removed during the run?)")
    try:
        yield
    except WRITE_ERRORS as e:
        raise TrainingStopped(f"could not write {path} ({e})") from None

@functools.cache
def umask():
    """The process's umask (reading it means setting it: done once, before any thread starts)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

def follow_umask(path):
    """Give a written file the ordinary mode 0o666 & ~umask: safetensors >= 0.8 writes 0600 files, which another
    user or container cannot read when the LoRA is copied into a shared model folder."""
    os.chmod(path, 0o666 & ~umask())

def write_json_atomic(path, data):
    write_text_atomic(path, json.dumps(data, indent=1, ensure_ascii=False))

def write_text_atomic(path, text):
    """A file that is either its old or its new text, never cut short (a kill mid-write leaves the old one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)

def replace_folder(new, target):
    """Put folder `new` in `target`'s place: the old one is renamed aside and deleted last, so a kill at any moment
    leaves a whole folder at `target` (or, between the two renames, beside it), never a half one."""
    old = target.with_name(f"{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)

def list_checkpoints(output_dir):
    """Complete checkpoints of output_dir, oldest first; incomplete ones (no trainer state) are skipped."""
    found = []
    for path in Path(output_dir).glob("checkpoint-*"):
        m = CHECKPOINT_RE.match(path.name)
        if m and path.is_dir():
            if not m.group(2) and (path / TRAINER_STATE_NAME).is_file():
                found.append((int(m.group(1)), path))
            else:
                logger.warning(f"{path} is incomplete (killed while writing?); ignoring it")
    return [p for _, p in sorted(found)]

def agree_run_id(accelerator):
    """This run's identity, the same on every process."""
    run_id = secrets.token_hex(8)
    return broadcast_object_list([run_id])[0] if accelerator.num_processes > 1 else run_id

def hold_output_dir(args, accelerator):
    """One run per output folder: the main process holds an exclusive lock on <output_dir>/.run.lock while it runs
    and writes who holds it; a second run is refused, exit 2, naming the holder. A POSIX record lock (lockf), which
    the kernel drops when the process dies, even on SIGKILL (no stale lock to clear), and which forked DataLoader
    workers do not inherit (an flock would live on in them). Holding it, the partial checkpoints killed runs left
    are deleted: nobody else writes here. -> the open lock file (the lock lives as long as it stays open)."""
    import fcntl
    import socket
    held, problem = None, None
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        held = open(Path(args.output_dir, RUN_LOCK), "a+")  # noqa: SIM115 - held open for the run: it is the lock
        try:
            fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
            held.seek(0)
            problem = (f"--output_dir {args.output_dir} is in use by {held.read().strip() or 'another run'}: one run "
                       "per output folder; wait for it to end, stop it, or choose another --output_dir")
            held.close()
        except OSError as e:  # a file system without locks: nothing to hold
            logger.warning(f"--output_dir {args.output_dir} cannot be locked ({e}): nothing stops a second run there")
        if problem is None:
            held.truncate(0)
            held.write(f"the run of process {os.getpid()} on {socket.gethostname()} since {time.strftime('%c')}")
            held.flush()
            fresh = args.overwrite_output_dir and args.resume_from_checkpoint is None  # the earlier run's go too
            for stale in Path(args.output_dir).glob("checkpoint-*" if fresh else "checkpoint-*.partial*"):
                shutil.rmtree(stale, ignore_errors=True)
            if fresh:  # and its validation history (images, progress sheet, scores), which would mix with this run's
                shutil.rmtree(Path(args.output_dir, "validation"), ignore_errors=True)
                shutil.rmtree(Path(args.output_dir, "best"), ignore_errors=True)  # option: metrics
    problem = broadcast_object_list([problem])[0] if accelerator.num_processes > 1 else problem
    if problem:
        raise UsageError(problem)
    return held

def flags_to_keep(args):
    """The flags a resumed run must share with its checkpoint: the adapter's rank, scale, layers and kind, the
    optimizer's settings (its restored state carries the checkpoint's: a new value would be ignored), and the batches'
    shape (a resume starts at step x accumulation batches: another shape would retrain or skip samples)."""
    names = ["rank", "lora_alpha", "lora_layers", "learning_rate", "scale_lr", "adam_beta1", "adam_beta2",
             "adam_weight_decay", "adam_epsilon", "train_batch_size", "gradient_accumulation_steps"]
    names += [n for o in OPTIONS for n in o.resume_flags]  # option: any
    return {name: vars(args).get(name) for name in names}

def check_resume_flags(args, checkpoint):
    """Refuse to resume with another adapter than the checkpoint's (another --lora_alpha would change the LoRA's
    scale mid-run), before any model loads."""
    if checkpoint is None:
        return
    saved, now = json.loads((checkpoint / TRAINER_STATE_NAME).read_text()).get("flags", {}), flags_to_keep(args)
    changed = [f"--{k} {now[k]} (the checkpoint's: {saved[k]})" for k in now if k in saved and saved[k] != now[k]]
    refuse(changed, f"--resume_from_checkpoint {checkpoint}: {', '.join(changed)}; resume with the flags that "
                    "trained it")
    warn_edited_config(Path(args.output_dir, "config.yaml"), checkpoint / "config.yaml")

def warn_edited_config(folder_config, checkpoint_config):
    """A config.yaml in --output_dir that differs from its checkpoint's (edited by hand, say) is not what a resume
    trains with: say so, naming the differences (a missing or unreadable one: nothing to compare)."""
    import yaml
    with contextlib.suppress(OSError, yaml.YAMLError, AttributeError):
        here, saved = (yaml.safe_load(Path(p).read_text(encoding="utf-8")) for p in (folder_config, checkpoint_config))
        changed = sorted(k for k in here.keys() | saved.keys() if k != "run" and here.get(k) != saved.get(k))
        listed = ", ".join(f"{k}: {here.get(k)!r} there, {saved.get(k)!r} in the checkpoint" for k in changed[:3])
        if changed:
            logger.warning(f"{folder_config} differs from {checkpoint_config} ({listed}): this run follows its command "
                           "line and the checkpoint's flags, and writes config.yaml anew; a file edited to train "
                           "otherwise is read only when given as the run's config file")

def check_resume_point(args, checkpoint, images):
    """Refuse a checkpoint past the run's last step (its LoRA would be saved as the earlier step's); warn, naming
    them, when images changed, were added or were removed since `checkpoint` was written."""
    state = json.loads((checkpoint / TRAINER_STATE_NAME).read_text()) if checkpoint else {}
    refuse(state.get("global_step", 0) > args.max_train_steps, f"--resume_from_checkpoint {checkpoint} is at step "
           f"{state.get('global_step')}, past this run's {args.max_train_steps} steps (--max_train_steps, or "
           "--num_train_epochs'); raise them, or resume from an earlier checkpoint")
    saved = state.get("images")
    if saved is None or saved == images:
        return
    changed = sorted({n for n in saved.keys() | images.keys() if saved.get(n) != images.get(n)})
    logger.warning(f"--resume_from_checkpoint {checkpoint}: {len(changed)} image(s) changed, added or removed since "
                   f"it was written ({', '.join(n.split('/', 1)[1] for n in changed[:5])}"
                   f"{', ...' if len(changed) > 5 else ''}): the resumed run does not continue the original exactly")

def agree_seed(args, checkpoint, accelerator):
    """The run's seed: --seed, else the resumed checkpoint's, else drawn on the main process and broadcast."""
    seed = args.seed
    if checkpoint is not None:
        saved = json.loads((checkpoint / TRAINER_STATE_NAME).read_text())["seed"]
        if seed is not None and seed != saved:
            logger.warning(f"--seed {seed} differs from the checkpoint's seed {saved}: the resumed run will not "
                           "continue the original one exactly")
        seed = saved if seed is None else seed
    if seed is None:
        seed = secrets.randbelow(2**31)
        seed = broadcast_object_list([seed])[0] if accelerator.num_processes > 1 else seed
        logger.info(f"no --seed given; drew seed {seed} (pass --seed {seed} to repeat this run)")
    return seed


# ----------------------------------------------------------------------------------------------------------------
# The FLUX.2 families ([dev], [klein]): what differs, read from the checkpoint and its pipeline

@dataclass(frozen=True)
class Family:
    """What differs between FLUX.2 checkpoints, read from their model_index.json; the rest is shared."""

    name: str
    pipeline: str  # diffusers class
    text_encoder: str  # transformers class
    distilled: bool = False  # [klein] distilled checkpoints sample in a few steps without CFG

FAMILIES = {f.pipeline: f for f in (Family("FLUX.2 [dev]", "Flux2Pipeline", "Mistral3ForConditionalGeneration"),
                                    Family("FLUX.2 [klein]", "Flux2KleinPipeline", "Qwen3ForCausalLM"))}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # a precision flag's word -> dtype

def read_model_json(args, name, what):
    """A small JSON file of the checkpoint (for a Hub id only that file is fetched) -> dict; UsageError naming `what`
    when it cannot be read."""
    try:
        if Path(args.pretrained_model_name_or_path).is_dir():
            path = Path(args.pretrained_model_name_or_path, name)
        else:
            from huggingface_hub import hf_hub_download
            path = hf_hub_download(args.pretrained_model_name_or_path, name, revision=args.revision,
                                   cache_dir=args.cache_dir)
        return json.loads(Path(path).read_text())
    except Exception as e:  # noqa: BLE001 - missing, unreachable or not JSON: the same advice
        raise UsageError(f"--pretrained_model_name_or_path {args.pretrained_model_name_or_path}: cannot read its "
                         f"{what} ({e})") from None

def detect_family(args):
    """The checkpoint's family from its model_index.json (a small file; no weights are read)."""
    config = read_model_json(args, "model_index.json", "model_index.json")
    if config.get("_class_name") not in FAMILIES:
        raise UsageError(f"--pretrained_model_name_or_path {args.pretrained_model_name_or_path} is a "
                         f"{config.get('_class_name')}; this script trains {', '.join(FAMILIES)} checkpoints")
    return dataclasses.replace(FAMILIES[config["_class_name"]], distilled=bool(config.get("is_distilled", False)))

def pipeline_default(family, method, parameter):
    """A default of the family's diffusers pipeline (so ours cannot drift from it, unlike a copied constant)."""
    import diffusers
    return inspect.signature(getattr(getattr(diffusers, family.pipeline), method)).parameters[parameter].default

def default_sampling_steps(family):
    return 4 if family.distilled else pipeline_default(family, "__call__", "num_inference_steps")

def resolve_family_defaults(args, family):
    """Fill the flags whose right value depends on the family; say so where the user chose otherwise."""
    layers = list(pipeline_default(family, "encode_prompt", "text_encoder_out_layers"))
    if args.text_encoder_out_layers is None:
        args.text_encoder_out_layers = layers
    elif list(args.text_encoder_out_layers) != layers:
        logger.warning(f"--text_encoder_out_layers {args.text_encoder_out_layers} overrides the {family.name} "
                       f"default {layers}")
    if family.distilled:
        size = re.search(r"(\d+B)\b", str(args.pretrained_model_name_or_path))
        base = f"black-forest-labs/FLUX.2-klein-base-{size.group(1)}" if size else "the base [klein] checkpoint"
        logger.warning(f"{args.pretrained_model_name_or_path} is a distilled FLUX.2 [klein] (few-step) checkpoint: "
                       f"train LoRAs on {base}, as its authors recommend; the LoRA then works on both, and distilled "
                       "validation here shows what it gives at 4 steps")
    if args.validation_inference_steps is None:
        args.validation_inference_steps = default_sampling_steps(family)
    if args.validation_guidance_scale is None:
        args.validation_guidance_scale = 1.0 if family.distilled else pipeline_default(family, "__call__",
                                                                                          "guidance_scale")
    logger.info(f"{family.name}{' (distilled)' if family.distilled else ''}: text-encoder layers "
                f"{args.text_encoder_out_layers}, validation with {args.validation_inference_steps} steps")

def load_pipeline_tokenizer(args):
    """The FLUX.2 tokenizer without torchvision: the Hub's PixtralProcessor folder holds a plain fast tokenizer."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer",
                                              revision=args.revision, cache_dir=args.cache_dir)
    refuse(not tokenizer.chat_template, f"{args.pretrained_model_name_or_path}/tokenizer has no chat template "
                                        "(chat_template.jinja or chat_template.json); FLUX.2 prompts are built with it")
    return tokenizer

def encode_prompts(family, text_encoder, tokenizer, prompts, max_sequence_length, out_layers):
    """Prompts -> embeddings [B, max_sequence_length, hidden * len(out_layers)], exactly as the family's pipeline
    encodes them ([dev]: Mistral chat with FLUX.2's system message; [klein]: Qwen3 chat)."""
    import diffusers
    kwargs = dict(text_encoder=text_encoder, tokenizer=tokenizer, prompt=list(prompts),
                  max_sequence_length=max_sequence_length, hidden_states_layers=list(out_layers))
    if family.pipeline == "Flux2KleinPipeline":
        return diffusers.Flux2KleinPipeline._get_qwen3_prompt_embeds(**kwargs)
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    return diffusers.Flux2Pipeline._get_mistral_3_small_prompt_embeds(system_message=SYSTEM_MESSAGE, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Image files: decoding, EXIF, modes, the folder scan

NEUTRAL_GREY = (128, 128, 128)  # what transparent pixels become: black would teach the model dark borders
# a file modified this close to its scan is not indexed: a same-size edit could share its mtime
RACY_SECONDS = 2.0  # option: disk_cache

def to_rgb(image):
    """Any Pillow mode -> 8-bit RGB: 16/32-bit grey scaled (not clipped) to 8 bits, palettes expanded, CMYK
    converted, transparency composited on a neutral grey."""
    image = grey8(image)
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*NEUTRAL_GREY, 255)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")

def grey8(image):
    """16/32-bit grey -> 8-bit L, scaled (not clipped: 16-bit data 65535 -> 255); other modes as they are."""
    if image.mode not in ("I", "I;16", "I;16B", "I;16L", "F"):
        return image
    array = np.asarray(image, dtype=np.float64)
    scale = 257.0 if image.mode != "F" and array.max() > 255 else 1.0
    return Image.fromarray(np.clip(array / scale, 0, 255).round().astype(np.uint8), "L")

def oriented_size(image, size=None):
    """(width, height) of ImageOps.exif_transpose(image), ImageRecord.load's pixels. Loads `image`, then reads its
    orientation as exif_transpose does: a TIFF turns its size at open and its pixels in load() (dropping the tag), the
    other formats leave orientations 5-8 to exif_transpose. `size`: the size before a JPEG's draft shrank it."""
    image.load()
    w, h = size or image.size
    return (h, w) if image.getexif().get(0x0112, 1) in (5, 6, 7, 8) else (w, h)

def inspect_image(path):
    """Decode and hash one file -> ((width, height) as displayed, sha256). Decoding catches corrupt, truncated and
    oversized files now rather than hours into training; JPEGs decode at 1/8 scale (every entropy-coded byte is
    still read; the inverse DCT and colour conversion run on 1/64 of the pixels). Pillow and hashlib release the
    GIL: threads scale."""
    data = Path(path).read_bytes()
    if not data:
        raise ValueError("empty file")
    with Image.open(io.BytesIO(data)) as im:  # over MAX_IMAGE_PIXELS: raises (scan_image_folder's filter)
        size = None
        if im.format == "JPEG":
            size = im.size  # before the draft shrinks it
            im.draft(im.mode, (max(1, im.width // 8), max(1, im.height // 8)))
        return oriented_size(im, size), hashlib.sha256(data).hexdigest()

def scan_image_folder(folder, read_captions=True, index=None, progress=False, with_masks=False):
    """Sorted image records of `folder`; hidden and non-image files are ignored, `stem.txt` is the caption,
    `stem_mask.*` the loss mask (read only `with_masks`, for the masked loss: then decoded like the images and
    refused unless of its image's displayed shape, which training would stretch it to).

    Every image is decoded and hashed once, on as many threads as cores, so a corrupt, truncated, empty or oversized
    (decompression-bomb) file is reported now, all of them in one message; files `index` (a ScanIndex, updated in
    place; the disk cache's) knows unchanged are neither decoded nor hashed again. `progress` shows a bar."""
    folder = Path(folder)
    refuse(not folder.is_dir(), f"{folder}: no such folder")
    scanned_at = time.time()  # option: disk_cache
    records, bad, empty_captions, found = [], [], [], {}
    entries = [p for p in sorted(folder.iterdir()) if not p.name.startswith(".")]
    candidates = [p for p in entries if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()]
    captions = {p.stem: p for p in entries if p.suffix.lower() == ".txt"}  # x.TXT too (x.txt, sorted last, first)
    stems = {p.stem for p in candidates}
    masks = {p.stem[:-5]: p for p in candidates if p.stem.endswith("_mask") and p.stem[:-5] in stems}  # x_mask: x's
    images = [p for p in candidates if p not in set(masks.values())]  # x_mask.png beside x.png is x's mask
    files = images + ([masks[p.stem] for p in images if p.stem in masks] if with_masks else [])
    stats = {p: p.stat() for p in files}
    known = dict.fromkeys(files)  # path -> (size, sha256) where an earlier scan knows the file unchanged
    if index is not None:  # option: disk_cache
        known = {p: index.lookup(p.name, stats[p]) for p in files}
    todo = [p for p in files if known[p] is None]
    # the filter is process-wide, so the threads see it; only this thread enters and leaves it
    with warnings.catch_warnings(), concurrent.futures.ThreadPoolExecutor(cpu_cores()) as pool:
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        jobs = {p: pool.submit(inspect_image, p) for p in todo}
        for path in tqdm(files, desc="Scanning images", unit="image", disable=not (progress and todo)):
            try:
                found[path.name] = (stats[path], *(known[path] or jobs[path].result()))  # (stat, size, sha256)
            except Exception as e:  # noqa: BLE001 - any decoder failure means the same thing to the user
                bad.append(f"{path}: {e}")
    for path in (p for p in images if p.name in found):
        _, size, sha = found[path.name]
        caption, txt, mask = None, captions.get(path.stem, path.with_suffix(".txt")), masks.get(path.stem)
        if with_masks and mask is not None and mask.name in found:  # option: masked_loss
            bad += mask_problem(mask, found[mask.name][1], path.name, size)
        if read_captions and txt.is_file():
            try:
                caption = txt.read_text(encoding="utf-8-sig").strip() or None  # BOM, CRLF, trailing blanks
            except UnicodeDecodeError as e:
                bad.append(f"{txt}: caption is not UTF-8 ({e.reason} at byte {e.start}); re-save it as UTF-8")
            if caption is None:  # an undecodable one is refused below, before this list is shown
                empty_captions.append(txt.name)
        records.append(ImageRecord(name=path.name, size=size, caption=caption, path=str(path),
                                   mask_path=str(mask) if mask else None, sha256=sha))
    if index is not None:  # option: disk_cache
        index.keep(found, scanned_at, hits=len(files) - len(todo), decoded=len(todo))
    refuse(bad, f"cannot use {len(bad)} file(s) in {folder}; fix or remove them:\n  " + "\n  ".join(bad))
    if empty_captions:
        warnings.warn(f"{len(empty_captions)} empty caption file(s) in {folder} ({', '.join(empty_captions[:5])}); "
                      "those images use --instance_prompt", stacklevel=2)
    return records

class ScanIndex:  # option: disk_cache
    """What the scan learnt about each image file, keyed by name and trusted while the file's size and modification
    time are unchanged (git's index does the same): a warm start neither decodes nor hashes an unchanged file.
    `files`: name -> [bytes, mtime_ns, width, height, sha256]; `hits` and `decoded` count the last scan's files."""

    VERSION = 2  # 2: EXIF-rotated TIFFs' sizes as load() gives them (unversioned indexes hold them transposed)

    def __init__(self, files=None):
        self.files, self.hits, self.decoded = dict(files or {}), 0, 0

    @classmethod
    def read(cls, document):
        """An index read back from the disk cache; one another version wrote is empty: its sizes may be wrong."""
        return cls(document["files"] if isinstance(document, dict) and document.get("version") == cls.VERSION else None)

    def lookup(self, name, stat):
        entry = self.files.get(name)
        if isinstance(entry, list) and len(entry) == 5 and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            return tuple(entry[2:4]), entry[4]
        return None

    def keep(self, found, scanned_at, hits, decoded):
        """Keep the entries of `found` ({name: (stat, size, sha256)}), dropping files no longer there; a file changed
        within RACY_SECONDS of the scan is left out (a same-size edit in the same tick would look unchanged)."""
        self.hits, self.decoded = hits, decoded
        self.files = {name: [st.st_size, st.st_mtime_ns, *size, sha] for name, (st, size, sha) in found.items()
                      if st.st_mtime_ns < (scanned_at - RACY_SECONDS) * 1e9}

def scan_folder(folder, cache, accelerator, read_captions=True, with_masks=False):
    """scan_image_folder with what earlier scans learnt about the folder's files: unchanged ones are not decoded.
    The disk cache's index is where it learns."""
    tic = time.perf_counter()
    with cache.scan_index(folder, accelerator) as index:
        records = scan_image_folder(folder, read_captions, index, accelerator.is_local_main_process, with_masks)
    found = ""
    found = f" with {sum(r.mask_path is not None for r in records)} masks" if with_masks else ""  # option: masked_loss
    decoded = "decoded and hashed"
    if index is not None:  # option: disk_cache
        decoded = f"{index.hits} unchanged since the last scan, {index.decoded} decoded and hashed"
    logger.info(f"scanned {folder}: {len(records)} images{found}, {decoded} in {time.perf_counter() - tic:.1f} s",
                main_process_only=False)
    return records

def load_instance_images(args, cache, accelerator):
    """The instance images: --instance_data_dir's files, each with a caption or --instance_prompt."""
    masks = False
    masks = args.masked_loss  # option: masked_loss
    records = scan_folder(args.instance_data_dir, cache, accelerator, with_masks=masks)
    refuse(not records, f"--instance_data_dir {args.instance_data_dir}: no images found "
                        f"({', '.join(sorted(IMAGE_EXTENSIONS))})")
    check_captioned(records, args.instance_prompt, f"--instance_data_dir {args.instance_data_dir}", "image(s) have "
                    "no .txt caption")
    return records

def check_captioned(records, instance_prompt, source, what):
    """Refuse records without a caption when --instance_prompt does not stand in: `source` has N `what`."""
    missing = [r.name for r in records if not r.caption]
    refuse(missing and not instance_prompt, f"{source}: {len(missing)} {what} ({', '.join(missing[:5])}"
           f"{', ...' if len(missing) > 5 else ''}); give --instance_prompt for them")

# ----------------------------------------------------------------------------------------------------------------
# Caches: the entries in memory, and what a cache offers the recipe

DUPLICATED_RAM_WARN_BYTES = 8e9  # in-memory cache copies over all processes of a host above this: warn

class MemoryCache:
    """Entries in each process's memory: a run holds and leaves nothing.
    So does the disk cache's run with --precompute_cache_dir none; DiskCache implements this interface too.
    The recipe reaches a cache only through it:
    scan_index(folder, accelerator) (a context: what earlier scans learnt about a folder's files), stores() (the
    prompt and latent mappings), hold() (before anyone looks at the entries: -> what is missing) and settle()."""

    persistent = False  # a stopped precompute keeps its entries

    @contextlib.contextmanager
    def scan_index(self, folder, accelerator):
        yield None  # nothing learnt: every file is decoded and hashed

    def stores(self, args, data, weight_dtype):
        return SampleCache(), SampleCache() if args.cache_latents else None

    def hold(self, accelerator, needed):
        return {name: store.todo(keys) for name, (store, keys) in needed.items()}

    def settle(self, args, accelerator, data, caches):
        report_memory_copies(caches, local_processes(accelerator))

def report_memory_copies(caches, processes):
    """The in-memory cache is copied into every process: say what that costs, as a warning once it is large."""
    if processes < 2:
        return
    stores = [c.store for c in (getattr(caches, f.name) for f in dataclasses.fields(caches)) if c is not None]
    per_process = sum(v.numel() * v.element_size() for store in stores for v in store.values())
    note = (f"in-memory precompute cache: {human_bytes(per_process)} per process, copied into each of {processes} "
            f"processes on this machine ({human_bytes(per_process * processes)} of host RAM)")
    if per_process * processes >= DUPLICATED_RAM_WARN_BYTES:
        logger.warning("".join([
            note,
            "; the disk cache (leave out --precompute_cache_dir none) keeps one copy on disk "  # option: disk_cache
            "and each process reads the entries of its batch",
        ]))
    else:
        logger.info(note)

def safetensors_header(path):
    """The header of a safetensors file, checked against the file's length (no tensor bytes read) -> dict of tensor
    name -> {dtype, shape, data_offsets} (and __metadata__). Raises ValueError (or OSError) for a file that is not
    one, or is cut short."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 2 <= length <= 100 << 20:
            raise ValueError(f"not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    tensors = [t for k, t in header.items() if k != "__metadata__"] if isinstance(header, dict) else None
    if tensors is None or not isinstance(header.get("__metadata__", {}), dict) or not all(
            isinstance(t, dict) and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
            and all(isinstance(o, int) for o in t["data_offsets"]) for t in tensors):
        raise ValueError("not a safetensors file")
    end = max((t["data_offsets"][1] for t in tensors), default=0)
    if os.path.getsize(path) != 8 + length + end:
        raise ValueError(f"{os.path.getsize(path)} bytes where its header says {8 + length + end}: cut short?")
    return header

# The disk cache, an option on by default (--precompute_cache_dir): every run uses it, so it is here, each of
# its definitions marked for it; a copy without it keeps its entries in memory.
RECOMPUTE_ADVICE = "; ".join([  # option: disk_cache
    "rerunning the same command recomputes it (add --resume_from_checkpoint latest to keep the steps done",
    "a --from_manifest run cannot recompute: rerun the command that wrote its manifest first",  # option: manifest
]) + ")"

class DiskStore:  # option: disk_cache
    """A persistent, content-addressed mapping: key -> <folder>/<digest[:2]>/<digest>.safetensors, `digest(key)`
    hashing all that determines the value (content, transform, model identity, settings): renamed inputs hit, edited
    ones miss. Writes are atomic (a unique temporary file, then a rename): a killed run or two runs sharing the folder
    leave only complete entries. A presence test reads the entry's header alone (a truncated or foreign file is
    reported, deleted and recomputed): a warm start costs a few syscalls per entry, not a read of the cache (1,000
    [dev] captions are 15.7 GB). An entry's SHA-256 is checked at its first read in a run; a mismatch (bit rot, an
    edited file) deletes it and stops the run, whose rerun recomputes it. Values are read at every lookup: host memory
    does not grow with the cache. A read sets the entry's mtime, eviction's LRU clock (atime is often off). A failed
    write never stops the run: `owner` warns once and entries stay in memory from then on."""

    def __init__(self, folder, digest, owner):
        self.folder, self.digest, self.owner = Path(folder), digest, owner
        self.present, self.verified, self.touched = set(), set(), set()  # entry paths: whole, checksummed, used
        self.memory = {}  # entries that could not be written

    def path(self, key):
        name = self.digest(key)
        return self.folder / name[:2] / f"{name}.safetensors"

    def visible(self, key):
        """Cheap presence test (no checksum): in memory, or a file (perhaps another process's) on disk."""
        return key in self.memory or self.path(key).is_file()

    def mark_used(self, path):
        if path not in self.touched:
            self.touched.add(path)
            with contextlib.suppress(OSError):  # a read-only cache is still readable
                os.utime(path)

    def __contains__(self, key):
        if key in self.memory:
            return True
        path = self.path(key)
        if path in self.present:
            return True
        if not path.is_file():
            return False
        try:  # one tensor "value", its SHA-256 in the metadata, and a file as long as its header says
            header = safetensors_header(path)
            if "value" not in header or len(header.get("__metadata__", {}).get("sha256", "")) != 64:
                raise ValueError("not a cache entry of this trainer (no value or checksum)")
        except Exception as e:  # noqa: BLE001 - truncated, corrupt or foreign: all mean "recompute"
            logger.warning(f"cache entry {path} is damaged ({e}); recomputing it", main_process_only=False)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return False
        self.present.add(path)
        self.mark_used(path)
        return True

    def __getitem__(self, key):
        from safetensors import safe_open
        if key in self.memory:
            return self.memory[key]
        path = self.path(key)
        try:
            with safe_open(str(path), "pt") as f:
                value, expected = f.get_tensor("value"), f.metadata()["sha256"]
        except FileNotFoundError:  # only a damaged entry is deleted under a live run (leases keep eviction away)
            raise TrainingStopped(f"cache entry {path} is gone: another process of this run found it damaged and "
                                  f"deleted it, or it was removed by hand; {RECOMPUTE_ADVICE}") from None
        if path not in self.verified:
            if tensor_digest(value) != expected:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                raise TrainingStopped(f"cache entry {path} changed on disk since it was written (checksum mismatch: "
                                      f"bit rot, or an edited file); it is deleted: {RECOMPUTE_ADVICE}")
            self.verified.add(path)
        self.mark_used(path)
        return value

    def __setitem__(self, key, value):
        from safetensors.torch import save_file
        if self.owner.write_error is not None:
            self.memory[key] = value
            return
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"value": value.contiguous()}, str(tmp), metadata={"sha256": tensor_digest(value)})
            follow_umask(tmp)  # entries are shared by runs (and users of a shared cache folder)
            os.replace(tmp, path)
        except OSError as e:
            self.owner.unwritable(e)
            self.memory[key] = value
            return
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        self.present.add(path)
        self.verified.add(path)
        self.touched.add(path)  # just written: its mtime is now

    def __len__(self):
        return len(self.present) + len(self.memory)

@contextlib.contextmanager  # option: disk_cache
def folder_lock(root):
    """Exclusive lock of a cache folder (flock on <root>/.lock, dropped by the kernel if the holder dies): taking a
    lease and evicting exclude each other. Where the file system has no locks (ENOLCK), runs sharing the folder are
    not protected (the README says so)."""
    import fcntl
    with open(Path(root, ".lock"), "a") as f:
        with contextlib.suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_EX)
        yield

def lease_is_live(path):  # option: disk_cache
    """A lease is live while its run holds the flock on it; the kernel drops the lock when the process dies (even on
    SIGKILL), so no heartbeat or clock is needed. Locks that cannot be probed count as live."""
    import fcntl
    try:
        with open(path) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return False
    except OSError:  # BlockingIOError: held by its run; anything else: cannot tell, so keep its entries
        return True
    return False

def take_lease(root, entries):  # option: disk_cache
    """Record that this process uses `entries` (paths relative to `root`) until it exits: <root>/leases/<host>-<pid>-
    <random>.json names them, and this process keeps an exclusive flock on it -> the open lease file (the lock lives
    as long as it stays open). Raises OSError when the folder cannot be written."""
    import fcntl
    import socket
    (Path(root) / "leases").mkdir(parents=True, exist_ok=True)
    with folder_lock(root):
        path = Path(root, "leases", f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}.json")
        f = open(path, "w")  # noqa: SIM115 - held open for the run's lifetime: the open file is the lock
        with contextlib.suppress(OSError):  # no locks here: the lease counts as live until its run deletes it
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                   "entries": sorted(entries)}, f)
        f.flush()
    return f

def release_lease(lease):  # option: disk_cache
    with contextlib.suppress(OSError):
        Path(lease.name).unlink()
        lease.close()

@dataclass  # option: disk_cache
class Eviction:
    """What evict_lru found and did (bytes)."""

    size_before: int
    size_after: int
    evicted: int
    evicted_bytes: int
    protected_bytes: int  # entries this or another live run uses: never deleted
    strays: int = 0  # temporary files of writes a killed run never finished, deleted
    stray_bytes: int = 0

def cache_entries(root):  # option: disk_cache
    """-> [(mtime, bytes, path relative to root)] of every entry under root (prompts/, latents/, ...)."""
    found = []
    for path in Path(root).glob("*/*/*.safetensors"):  # <kind>/<shard>/<entry>
        if not path.name.startswith(".") and path.parts[-3] not in ("leases", "scans"):
            st = path.stat()
            found.append((st.st_mtime, st.st_size, path.relative_to(root).as_posix()))
    return found

# a temporary entry file this old is a killed run's: a live write takes seconds
STRAY_SECONDS = 3600  # option: disk_cache

def remove_stray_writes(root):  # option: disk_cache
    """Delete the temporary files (.<entry>.<pid>.<hex>.tmp) that runs killed while writing left behind (an hour
    old: a write takes seconds) -> (how many, bytes)."""
    count = nbytes = 0
    for path in Path(root).glob("*/*/.*.tmp"):
        with contextlib.suppress(OSError):
            st = path.stat()
            if st.st_mtime < time.time() - STRAY_SECONDS:
                path.unlink()
                count, nbytes = count + 1, nbytes + st.st_size
    return count, nbytes

def evict_lru(root, max_bytes, keep=()):  # option: disk_cache
    """Delete least-recently-used entries of `root` until it holds at most `max_bytes`, never one in `keep` (the
    calling run's) or in a live lease (another run's); stale leases (their run is gone) are removed. -> Eviction."""
    protected, blind = set(keep), False
    with folder_lock(root):
        for lease in sorted(Path(root, "leases").glob("*.json")):
            if not lease_is_live(lease):
                lease.unlink(missing_ok=True)
                continue
            try:
                protected.update(json.loads(lease.read_text())["entries"])
            except (OSError, ValueError, KeyError):  # live but unreadable: its entries are unknown, delete nothing
                blind = True
        strays = remove_stray_writes(root)
        entries = cache_entries(root)
        size = before = sum(e[1] for e in entries)
        evicted = evicted_bytes = 0
        for _, nbytes, rel in sorted(entries):  # oldest use first
            if size <= max_bytes or blind:
                break
            if rel in protected:
                continue
            with contextlib.suppress(FileNotFoundError):
                Path(root, rel).unlink()
                evicted, evicted_bytes, size = evicted + 1, evicted_bytes + nbytes, size - nbytes
    return Eviction(before, size, evicted, evicted_bytes, sum(e[1] for e in entries if e[2] in protected), *strays)

class DiskCache:  # option: disk_cache
    """The disk cache of a run (--precompute_cache_dir): its entry stores, the scan index of image folders, its lease
    and bound; the recipe reaches it through the interface MemoryCache describes. Nothing here may stop a run: the
    first write that fails warns once, naming the folder and the error, and from then on new entries stay in memory
    (and nothing more is written: no lease, no index, no eviction)."""

    persistent = True

    def __init__(self, root, max_bytes=None):
        self.root, self.max_bytes = Path(root), max_bytes
        self.write_error, self.lease, self.identity = None, None, None
        self.paths, self.missing = {}, set()  # {"prompts"/"latents": {key: entry}}; entries not cached at the start

    @classmethod
    def open(cls, root, args):
        cache = cls(root, int(args.precompute_cache_max_gb * 1e9))
        try:
            cache.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            cache.unwritable(e)
        return cache

    @contextlib.contextmanager
    def scan_index(self, folder, accelerator):
        """<root>/scans/<digest of the folder's path>.json; each machine's first process scans first, the others find
        its index warm. An index that cannot be read is empty; one that cannot be written warns."""
        path = self.root / "scans" / f"{json_digest('scan', str(Path(folder).resolve()))[:32]}.json"
        with accelerator.local_main_process_first():
            index = ScanIndex()
            with contextlib.suppress(OSError, ValueError, TypeError):
                index = ScanIndex.read(json.loads(path.read_text()))
            yield index
            if self.write_error is None:
                try:
                    write_json_atomic(path, {"version": ScanIndex.VERSION, "folder": str(Path(folder).resolve()),
                                             "files": index.files})
                except OSError as e:
                    self.unwritable(e)

    def stores(self, args, data, weight_dtype):
        """-> (prompt cache, latent cache or None) over this folder: entries named by their key and the run's identity
        (the models, the settings and the code that make them; an option's, e.g. the manifest's)."""
        dataset, hooks = data.dataset, data.hooks
        self.identity = identity = hooks.first("cache_identity", weight_dtype, data.family, default=lambda: (
            cache_identity(args, weight_dtype, data.family)))
        prompts = self.store("prompts", lambda text: json_digest("prompt", identity.prompts, text))
        latents = self.store("latents", lambda key: json_digest(  # the image by its bytes: stable across renames
            "latent", identity.latents, [dataset.record(*key[:2]).content_hash(), *key[2:]]))
        return SampleCache(prompts), SampleCache(latents) if args.cache_latents else None

    def hold(self, accelerator, needed):
        """Lease the entries the run reads (each machine's first process) before anyone looks at them, so no other
        run's eviction removes what this one has found -> the missing keys. needed: {name: (SampleCache, keys)}."""
        self.paths = {name: {k: self.relative(cache.store.path(k)) for k in keys}
                      for name, (cache, keys) in needed.items()}
        if accelerator.is_local_main_process and self.write_error is None and self.lease is None:
            try:
                self.lease = take_lease(self.root, [entry for paths in self.paths.values() for entry in paths.values()])
                atexit.register(release_lease, self.lease)
            except OSError as e:
                self.unwritable(e)
        accelerator.wait_for_everyone()
        todo = {name: cache.todo(keys) for name, (cache, keys) in needed.items()}
        self.missing = {self.paths[name][k] for name, keys in todo.items() for k in keys}
        return todo

    def settle(self, args, accelerator, data, caches):
        """After precompute: bound the folder, say what was reused and written.
        The dataset manifest is left there too."""
        settle_cache(accelerator, self, [entry for paths in self.paths.values() for entry in paths.values()])
        write_manifest(args, accelerator, data, self)  # option: manifest

    def unwritable(self, error):
        if self.write_error is None:
            self.write_error = error
            logger.warning(f"cannot write the precompute cache {self.root} ({error}); this run keeps new entries in "
                           "memory (free space, or choose another --precompute_cache_dir)", main_process_only=False)

    def store(self, name, digest):
        return DiskStore(self.root / name, digest, self)

    def relative(self, path):
        return Path(path).relative_to(self.root).as_posix()

def resolve_cache_dir(value, environ):  # option: disk_cache
    """--precompute_cache_dir: None -> the per-user folder ($XDG_CACHE_HOME when absolute, as the XDG spec asks,
    else ~/.cache); 'none' -> None (in memory); else the folder given."""
    if value is None:
        base = environ.get("XDG_CACHE_HOME", "")
        return Path(base if os.path.isabs(base) else Path(environ.get("HOME") or Path.home(), ".cache"), TRAINER_NAME)
    return None if value.lower() == "none" else Path(value).expanduser()

def component_folder(args, subfolder):  # option: disk_cache
    """Local folder of a checkpoint component; for a Hub id, the snapshot loading would use (downloaded if absent)."""
    root = Path(args.pretrained_model_name_or_path)
    if root.is_dir():
        return root / subfolder
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(args.pretrained_model_name_or_path, revision=args.revision, cache_dir=args.cache_dir,
                                  allow_patterns=[f"{subfolder}/*"])) / subfolder

@functools.lru_cache(maxsize=None)  # option: disk_cache
def fingerprint_folder(folder):
    """Identity of a model component without loading it: every file's name and size, small files whole, the first and
    last MiB of larger ones (other or retrained weights differ there). Milliseconds, even for 48 GB."""
    digest, sample = hashlib.sha256(), 1 << 20  # bytes read at each end of a large file
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder)}:{size};".encode())
        with path.open("rb") as f:
            if size <= 2 * sample:
                digest.update(f.read())
            else:
                digest.update(f.read(sample))
                f.seek(-sample, os.SEEK_END)
                digest.update(f.read())
    return digest.hexdigest()

@dataclass  # option: disk_cache
class CacheIdentity:
    """What shapes the cache entries besides their key: the models and settings, hashed into every entry's name."""

    prompts: list  # text encoder and tokenizer fingerprints (or an option's), length, layers, dtype, family
    latents: list | None  # VAE fingerprint, dtype, --latent_sampling; None without --cache_latents

def cache_identity(args, weight_dtype, family, encoder=None):  # option: disk_cache
    """The identity of this run's entries; `encoder` identifies the text encoder (default: its files' and the
    tokenizer's fingerprints)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    encoder = encoder or [fingerprint_folder(component_folder(args, name)) for name in ("text_encoder", "tokenizer")]
    prompts = [*encoder, args.max_sequence_length, list(args.text_encoder_out_layers), str(weight_dtype),
               family.pipeline, SYSTEM_MESSAGE if family.pipeline == "Flux2Pipeline" else None,
               code_identity(PROMPT_CODE)]
    latents = ([fingerprint_folder(component_folder(args, "vae")), str(weight_dtype), args.latent_sampling,
                code_identity(LATENT_CODE)] if args.cache_latents else None)
    return CacheIdentity(prompts, latents)

# The code between a file (or a text) and its entry: these definitions (outer.inner: a closure) and, found by
# covered_code, every function, class and constant of the script they name, transitively (docs/design.md: Copy and edit)
PROMPT_CODE = ("prompt_encoder", "encode_prompts", "encode_missing")  # option: disk_cache
LATENT_CODE = (  # option: disk_cache
    "load_vae", "prepare_latents.encode", "DreamBoothDataset.pixels", "ImageRecord.load", "encode_missing")

def code_identity(names):  # option: disk_cache
    """What computes an entry besides the models: the code it runs (covered_code: a copy edited to encode otherwise
    makes other entries, never the old ones) and the versions of the libraries that run it."""
    import diffusers
    import transformers
    code = covered_code(script_definitions(Path(__file__).read_text(encoding="utf-8")), names)
    return [json_digest(sorted(code.items())), torch.__version__, diffusers.__version__, transformers.__version__]

def covered_code(defs, names):  # option: disk_cache
    """{name: code} of the definitions `names` (in `defs`, a script's script_definitions) and of every function, class
    or constant of the script that their code names (NAME, Class.NAME, self.NAME in a method), transitively: followed,
    not listed, so a function moved or newly called stays covered. The code as parsed (ast.unparse): a comment or
    layout edit does not count."""
    import ast
    found, todo = {}, list(names)
    while todo:
        if (name := todo.pop()) in found or name not in defs:
            continue
        node, owner = defs[name]
        found[name] = ast.unparse(node)
        local = {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)} | {
            n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id not in local:
                todo.append(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                todo.append(f"{owner if n.value.id in ('self', 'cls') else n.value.id}.{n.attr}")
    return found

@functools.lru_cache(maxsize=1)  # option: disk_cache (one parse a run: 0.2 s)
def script_definitions(source):
    """{name: (its node, the class whose `self` it sees)} of the script's functions, classes and constants (by their
    assignment); methods and closures as outer.inner."""
    import ast
    defs = {}
    for node in ast.parse(source).body:
        targets = getattr(node, "targets", [getattr(node, "target", None)])
        for target in (n for t in targets for n in getattr(t, "elts", [t]) if isinstance(n, ast.Name)):
            defs[target.id] = node, None  # a, b = ...: both
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            owner = node.name if isinstance(node, ast.ClassDef) else None
            defs[node.name] = node, owner
            for inner in (n for n in ast.walk(node) if n is not node and isinstance(n, ast.FunctionDef)):
                defs.setdefault(f"{node.name}.{inner.name}", (inner, owner))
    return defs

def settle_cache(accelerator, disk, entries):  # option: disk_cache
    """After precompute: each machine's first process bounds the folder (evict_lru), the main one logs what it did."""
    accelerator.wait_for_everyone()  # every process has written its share
    if not accelerator.is_local_main_process:
        return
    sizes = {rel: (disk.root / rel).stat().st_size for rel in entries if (disk.root / rel).is_file()}
    reused = [sizes.get(rel, 0) for rel in entries if rel not in disk.missing]
    wrote = [sizes[rel] for rel in disk.missing if rel in sizes]
    line = (f"precompute cache {disk.root}: reused {len(reused)} entries ({human_bytes(sum(reused))}), wrote "
            f"{len(wrote)} ({human_bytes(sum(wrote))})")
    if len(wrote) < len(disk.missing):
        line += f", kept {len(disk.missing) - len(wrote)} in memory (the folder could not be written)"
    try:
        eviction = evict_lru(disk.root, disk.max_bytes, entries) if disk.write_error is None else None
    except OSError as e:  # e.g. another user's entries in a shared folder: the run goes on
        logger.warning(f"could not bound the precompute cache {disk.root} ({e})", main_process_only=False)
        eviction = None
    if eviction is not None:
        line += f"; {human_bytes(eviction.size_after)} of the {human_bytes(disk.max_bytes)} bound"
        if eviction.evicted:
            line += f", {eviction.evicted} least-recently-used entries deleted ({human_bytes(eviction.evicted_bytes)})"
        if eviction.strays:
            line += f", {eviction.strays} files killed runs left deleted ({human_bytes(eviction.stray_bytes)})"
        if eviction.size_after > disk.max_bytes:
            line += (f"; over the bound: {human_bytes(eviction.protected_bytes)} are entries this or another live run "
                     "uses (raise --precompute_cache_max_gb)")
    logger.info(line)  # the main process's

# The dataset manifest every run writes beside its LoRA, for the manifest option (--from_manifest: train again from
# the disk cache alone); every run writes it, so it is here, each definition marked for that option.
MANIFEST_NAME = "dataset_manifest.json"  # option: manifest

MANIFEST_FORMAT = "train_dreambooth_lora_flux2 dataset manifest"  # option: manifest

# the flags that shaped a manifest's cache entries or the samples drawn from them (--from_manifest takes them from it:
# a replay with another caption dropout trains another LoRA); an option's may be absent
MANIFEST_DATA_FLAGS = ("instance_prompt", "class_prompt", "with_prior_preservation", "repeats",  # option: manifest
                       "resolution", "center_crop", "random_flip", "max_sequence_length", "text_encoder_out_layers",
                       "latent_sampling", "caption_dropout")

def manifest_record(record):  # option: manifest
    row = {"name": record.name, "size": list(record.size), "caption": record.caption, "sha256": record.content_hash()}
    if record.folder:  # option: folders (its entry as trained: prompt, repeats, caption dropout)
        row["folder"] = dataclasses.asdict(record.folder)
    return {**row, "conditions": [manifest_record(c) for c in record.conditions]} if record.conditions else row

def build_manifest(data, model, instances, classes, prompt_entries, latent_entries, cache):  # option: manifest
    """The dataset manifest: the settings that shaped the data, the model identity, every source image (name, size,
    caption, SHA-256) and every cache entry training reads. prompt_entries: [(text, entry)]; latent_entries:
    [((kind, image name, bucket, resized, top, left, flip), entry)]."""
    fields = ("kind", "image", "bucket", "resized", "top", "left", "flip")
    return {"format": MANIFEST_FORMAT, "version": 1, "cache": str(cache), "data": data, "model": model,
            "instances": [manifest_record(r) for r in instances], "classes": [manifest_record(r) for r in classes],
            "entries": {"prompts": [{"text": text, "entry": entry} for text, entry in prompt_entries],
                        "latents": [{**dict(zip(fields, key)), "entry": entry} for key, entry in latent_entries]}}

def write_manifest(args, accelerator, data, disk):  # option: manifest
    """<output_dir>/dataset_manifest.json (main process): enough to train again from the cache alone
    (--from_manifest), with the images gone."""
    if not accelerator.is_main_process:
        return
    dataset = data.dataset
    settings = {name: vars(args).get(name) for name in MANIFEST_DATA_FLAGS}  # an option's flag may be absent
    settings.update(buckets=[list(b) for b in dataset.buckets], seed=dataset.seed,
                    validation_prompts=validation_prompts(args, data), resolutions=list(args.resolutions),
                    ladders=[[list(b) for b in ladder] for ladder in dataset.ladders])
    model = {"pretrained_model_name_or_path": args.pretrained_model_name_or_path, "revision": args.revision,
             "family": data.family.pipeline, "prompt_identity": disk.identity.prompts,
             "latent_identity": disk.identity.latents}
    latents = [((k[0], dataset.record(k[0], k[1]).name, *k[2:]), e) for k, e in disk.paths.get("latents", {}).items()]
    write_json_atomic(Path(args.output_dir, MANIFEST_NAME), build_manifest(
        settings, model, dataset.instances, getattr(dataset, "classes", ()),  # none in a copy without class images
        list(disk.paths["prompts"].items()), latents, disk.root))


# ----------------------------------------------------------------------------------------------------------------
# Small helpers: digests, sizes, cores, the VAE's placement, library noise

def tensor_digest(tensor):
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

@functools.lru_cache(maxsize=None)
def file_digest(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

def json_digest(*parts):
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

def optimizer_steps(epochs, batches, accumulation):
    """The optimizer steps of `epochs` epochs of `batches` batches: accumulation windows run on across epochs (the
    loop is one stream of micro-batches), so not epochs x ceil(batches / accumulation), which trains extra epochs."""
    return math.ceil(epochs * batches / accumulation)

def human_bytes(n):
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000

def cpu_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

def loader_workers(requested, cache_latents, local_processes):
    """DataLoader workers: as requested; by default none with --cache_latents (a batch is a list of indices, all
    inputs come from the caches), else a share of this machine's cores so decoding overlaps training."""
    if requested is not None:
        return requested
    return 0 if cache_latents else max(1, min(8, cpu_cores() // local_processes - 1))

@contextlib.contextmanager
def on_device(module, device, offload):
    """--offload: `module` lives on the CPU and comes to `device` only while it runs (cost: one host-device copy of
    its weights each time, about 0.2 GB for the FLUX.2 VAE)."""
    if not offload or module is None:
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to("cpu")

class Clock:
    """Where a run's time goes, each moment charged to one part, so the parts add up to the run: start-up (from the
    process's start: imports, flags, the scan, class images, loading the models), precompute, training (the loop,
    less validation and saving), validation, saving (checkpoints, the final LoRA, the model card)."""

    PARTS = ("start-up", "precompute", "training", "validation", "saving")

    def __init__(self, start=None):
        self.seconds, self.part = dict.fromkeys(self.PARTS, 0.0), "start-up"
        self.since = process_start() if start is None else start

    def switch(self, part):
        now = time.time()
        self.seconds[self.part] += now - self.since
        self.part, self.since = part, now

    @contextlib.contextmanager
    def charged(self, part):
        previous = self.part
        self.switch(part)
        try:
            yield
        finally:
            self.switch(previous)

    def line(self):
        self.switch(self.part)
        total = sum(self.seconds.values())
        return "where the time went: " + ", ".join(f"{part} {s:.1f} s ({100 * s / max(total, 1e-9):.0f}%)" for part, s
                                                   in self.seconds.items()) + f"; {total:.1f} s in all"

def process_start():
    """When this process started (time.time()), from /proc (clock ticks since boot); elsewhere: now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.time() - float(Path("/proc/uptime").read_text().split()[0]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()

LIBRARY_NOISE = (  # what other libraries log at import that says nothing about a run (FLUX2_VERBOSE=1 shows it)
    ("torchao", "Failed to load "),  # its CUDA extensions (_C_mxfp8, _C_cutlass_90a) without their CUDA: unused
    ("torch.utils._pytree", "Calling register_constant() on Enum subclasses is deprecated"),  # torchao's enums
    ("torchao.kernel.intmm", "Detected no triton"),  # its Triton int8 matmuls, absent on a CPU: unused
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao`"),  # torchao-saved models: unused
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"))  # its Hub kernel, kept from loading

def quiet_library_imports(environ=os.environ):
    """Runs import torchao and bitsandbytes (diffusers imports peft, which imports them): LIBRARY_NOISE is dropped,
    never an error. Importing bitsandbytes on an AVX512-BF16 CPU fetches a Hub kernel (its code run): not here."""
    import logging
    for name, words in () if environ.get("FLUX2_VERBOSE") == "1" else LIBRARY_NOISE:
        logging.getLogger(name).addFilter(lambda r, w=words: r.levelno >= logging.ERROR or w not in r.getMessage())
    if importlib.util.find_spec("bitsandbytes"):
        held = sys.modules.pop("kernels", None)
        sys.modules["kernels"] = None  # `from kernels import get_kernel` raises ImportError: bitsandbytes' own code
        import bitsandbytes  # noqa: F401
        del sys.modules["kernels"]
        sys.modules.update({"kernels": held} if held else {})

@contextlib.contextmanager
def validation_oom(step):
    """Out of GPU memory making validation images: advice for them (OOM_ADVICE's training flags would not help), and
    finish still writes the model card."""
    try:
        yield
    except torch.OutOfMemoryError:
        less = ", ".join(["--offload (the VAE waits on the CPU)",
                          "smaller images (--size WxH in a --validation_prompts_file)",  # option: validation_extras
                          "or none (--skip_final_inference, no --validation_prompt)"])
        raise TrainingStopped(f"out of GPU memory making the validation images of step {step} (the checkpoints are "
                              "intact; at the end the LoRA is saved and the model card written without them). Less "
                              f"validation memory: {less}") from None

OOM_ADVICE = ", ".join([
    "out of GPU memory. Flags that reduce memory: --gradient_checkpointing",
    "--cache_latents (the VAE is freed)",
    "a smaller --resolution or --train_batch_size (raise --gradient_accumulation_steps to keep the effective batch)",
    "--use_8bit_adam",  # option: compile
    "--mixed_precision bf16",
    "a lower --rank",
    "--blocks_to_swap (with --gradient_checkpointing)",  # option: block_swap
    "8-bit frozen weights: --transformer_quantization int8",  # option: int8_weights
    "a 4-bit --bnb_quantization_config_path",  # option: compile
])

def non_finite_loss(args, fp16, step, samples):
    """A NaN or infinite loss's message: the run's flags that can cause it, where to resume, what to change."""
    return (f"the loss became NaN or infinite at step {step} (samples {samples}); stopped before applying that "
            f"update, no final LoRA written. Flags that can cause it: --learning_rate {args.learning_rate:g}, "
            f"--max_grad_norm {args.max_grad_norm:g}, --timestep_shift {args.timestep_shift}, --weighting_scheme "
            f"{args.weighting_scheme}{', --mixed_precision fp16 (bf16 has the range)' * fp16}. Last good checkpoint: "
            f"{(list_checkpoints(args.output_dir) or ['none'])[-1]}: resume from it with a lower --max_grad_norm, or "
            "start over (--overwrite_output_dir) with a lower --learning_rate or other values of those")


# ----------------------------------------------------------------------------------------------------------------
# Signals: a stop request lets the work in flight finish, then every process stops at the same point

class StopRequest:
    """While active (a `with` block), SIGTERM and SIGINT (preemption, Ctrl-C) let the work in flight finish, then
    every process stops at the same point; a second signal stops at once. A repeat within SAME_STOP_SECONDS is the
    same request: a scheduler signals every process of a node (Slurm: of the job step) and torchrun forwards its own
    copy to its workers, milliseconds apart. Afterwards the usual handlers are back, so a signal interrupts again;
    a process stopped by the request keeps this handler to its exit."""

    SAME_STOP_SECONDS = 2.0

    def __init__(self, after, interrupt=False):
        self.after, self.signum, self.since = after, 0, 0.0  # after: what finishes first, for the message
        self.interrupt = interrupt  # nothing to finish (the final validation): stop at once, saying so
        self.finite = True  # in the loop: whether every loss since the run began was finite (a tensor, not synced)

    def __enter__(self):  # where signals arrive: the main thread (Ray Train runs main() in another, and stops it)
        sigs = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
        self.previous = {sig: signal.signal(sig, self._handle) for sig in sigs}
        return self

    def __exit__(self, kind, error, traceback):
        if self.signum and isinstance(error, TrainingStopped):  # this process stops: a copy of the signal as it exits
            return  # (torchrun's, once another process ended) is the same request, not a kill before its message
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.interrupt:
            raise TrainingStopped(f"stopped by {signal.Signals(signum).name} during the final validation; the LoRA "
                                  "is saved and the model card written without its images", 128 + signum)
        if self.signum and time.monotonic() - self.since >= self.SAME_STOP_SECONDS:
            raise KeyboardInterrupt(128 + signum)  # not an Exception: no `except Exception` on the way catches it
        if self.signum:
            return  # the same request, delivered twice
        self.signum, self.since = signum, time.monotonic()
        print(f"\n{signal.Signals(signum).name} received: stopping {self.after} (signal again to stop at once)",
              file=sys.stderr, flush=True)

    def join(self, accelerator, signum=0):
        """Wait for every process (a collective) -> the stop signal this one or any other had (`signum`: one this
        process met before the request), or 0. A process stopping so keeps the handler, and a copy of the signal
        within SAME_STOP_SECONDS from here is the same request: torchrun forwards one once another process ends."""
        self.signum = self.signum or signum
        agreed = self.agreed(accelerator)[0]
        if agreed:
            self.signum, self.since = self.signum or agreed, time.monotonic()
        return self.signum

    def agreed(self, accelerator, *counts):
        """(the signal or 0, and each of `counts` summed), agreed by every process: a collective, so all stop at once.
        In the loop, the one host-device sync of an optimizer step."""
        flags = torch.stack([torch.as_tensor(v, device=accelerator.device).long() for v in (self.signum, *counts)])
        if accelerator.num_processes > 1:
            flags = accelerator.gather(flags[None])  # [processes, 1 + len(counts)]
            flags = torch.cat([flags[:, :1].max(0).values, flags[:, 1:].sum(0)])
        return flags.tolist()


# ----------------------------------------------------------------------------------------------------------------
# Several processes: the mode, agreeing on what to encode and when to stop, sharing it, the same images everywhere

def is_fsdp(accelerator):
    from accelerate.utils import DistributedType
    return accelerator.distributed_type == DistributedType.FSDP

def validates_here(accelerator):
    """Validation runs on the main process.
    Under FSDP it runs on all of them (the sharded forward is a collective)."""
    return accelerator.is_main_process or is_fsdp(accelerator)

def fsdp_requested():
    """Whether accelerate was launched with FSDP (its config sets this), known before the Accelerator exists."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"

def check_launch(accelerator, environ):
    """Refuse a launch whose processes accelerate did not join: torchrun on a machine without a GPU starts WORLD_SIZE
    processes, and without ACCELERATE_USE_CPU accelerate makes each a run of its own (they would then fight over
    --output_dir, or each train alone)."""
    world = int(environ.get("WORLD_SIZE", "1") or 1)
    refuse(world > 1 and accelerator.num_processes == 1, f"the launcher started {world} processes (WORLD_SIZE), but "
           "accelerate made this one a run of its own: without a GPU it joins them only when told to run on the CPU; "
           "set ACCELERATE_USE_CPU=true for torchrun, or launch with `accelerate launch --cpu`")

def local_processes(accelerator):
    """Processes on this machine (torchrun and accelerate set LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))

def distributed_mode(accelerator):
    """How the run is spread, in words, for the start-up summary."""
    from accelerate.utils import DistributedType
    n, kind = accelerator.num_processes, accelerator.device.type
    machines = max(1, n // local_processes(accelerator))
    where = f"{n} {'GPUs' if kind == 'cuda' else 'processes'}" + (f" on {machines} machines" if machines > 1 else "")
    if accelerator.distributed_type == DistributedType.NO:
        return f"one process on the {'GPU' if kind == 'cuda' else kind.upper()}"
    if accelerator.distributed_type == DistributedType.FSDP:  # option: fsdp
        return f"FSDP (each process holds a shard of the model) over {where}"
    return f"data parallel (every process a full copy, gradients averaged) over {where}"

def agreed_todo(cache, keys, accelerator):
    """cache.todo(keys), the same on every process (a collective): the entries some process lacks, in the order of
    `keys`. With a cache folder per machine the folders can differ (one machine's entries evicted, or a new machine),
    and the shares, rounds and collectives of precompute must be the same everywhere."""
    todo = cache.todo(keys)
    if accelerator.num_processes == 1:
        return todo
    lacking = {k for keys_of_one in gather_object([todo]) for k in keys_of_one}
    return [k for k in dict.fromkeys(keys) if k in lacking]

def agreed_refusal(accelerator, load):
    """`load()`, whose refusal (UsageError) every process raises: the images a machine finds are its own, and a
    process that stopped alone would leave the others a collective error instead of the reason."""
    error = None
    try:
        value = load()
    except UsageError as e:
        error = str(e)
    errors = gather_object([error]) if accelerator.num_processes > 1 else [error]
    refused = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if refused:  # named by process unless every process found the same
        same = len(refused) == len(errors) and len({e for _, e in refused}) == 1
        raise UsageError(refused[0][1] if same else f"process {refused[0][0]}: {refused[0][1]}")
    return value

def check_same_images(accelerator, instances, classes=()):
    """Every process must train on the same images and captions. Folders of each machine's own can differ (stale
    copies): the processes would build different datasets and fail or hang at their first collective that no longer
    matches, or train different samples silently (a caption is shared by its key). Raises UsageError.
    So must the condition images of edit training.
    Class images, which every process generates into its class folder, each its share, can differ too."""
    if accelerator.num_processes == 1:
        return

    def digest(records):
        rows = [[r.name, list(r.size), r.content_hash(), r.caption] for r in records]
        rows = [row + [[c.content_hash() for c in r.conditions]] for row, r in zip(rows, records)]  # option: edit
        return json_digest(sorted(rows))
    seen = gather_object([(len(instances), digest(instances), len(classes), digest(classes))])
    if len(set(seen)) > 1:
        counts = "; ".join(f"process {r}: {n} images" for r, (n, *_) in enumerate(seen))
        counts = "; ".join(f"process {r}: {n} instance and {c} class images"  # option: class_images
                           for r, (n, _, c, _) in enumerate(seen))
        raise UsageError(" ".join([
            f"the processes see different images or captions ({counts}): every machine must see the "
            "same files at the same path. Share --instance_data_dir between machines or copy it.",
            "Class images are generated by every process into "  # option: class_images
            "its --class_data_dir, each its share: with a folder per machine copy each machine's new class images "
            "into the others' folders.",
        ]))

class Progress:
    """How far precompute got: entries needed, cached when it started, written since by this process."""

    def __init__(self, needed, cached, persistent, stop):
        self.needed, self.cached, self.written, self.persistent, self.stop = needed, cached, 0, persistent, stop

    def check(self, accelerator):
        """Before each batch, on every process (a collective): when any process was signalled, all stop."""
        signum, written = self.stop.agreed(accelerator, self.written)
        if signum:
            message = (f"cached {self.cached + written} of {self.needed} entries; rerun the same command to continue"
                       if self.persistent else f"stopped by {signal.Signals(signum).name} during precompute; the "
                       "in-memory cache keeps nothing")
            logger.warning(message, main_process_only=False)
            raise TrainingStopped(message, 128 + signum)

SHARE_PER_ROUND = 16  # entries per collective, over all processes: each receives all (16 [dev] prompts: 250 MB)

def share_entries(cache, keys, accelerator):
    """Give every process the entries of `keys` that each process computed for its share (keys[rank::world]): on a
    disk every process sees, once everyone has written; otherwise (in memory, a folder per machine, or one that could
    not be written) SHARE_PER_ROUND entries per round, so what each process holds at once does not grow with the
    process count."""
    if accelerator.num_processes == 1:
        return
    accelerator.wait_for_everyone()
    store = cache.store
    unseen = {k for k in keys if not (store.visible(k) if hasattr(store, "visible") else k in store)}
    if not any(gather_object([len(unseen)])):
        return
    shares = [keys[r::accelerator.num_processes] for r in range(accelerator.num_processes)]
    mine, per_process = shares[accelerator.process_index], max(1, SHARE_PER_ROUND // accelerator.num_processes)
    for start in range(0, max(map(len, shares)), per_process):
        for key, value in gather_object([(k, cache[k]) for k in mine[start:start + per_process]]):
            if key in unseen:
                cache.put(key, value)


# ----------------------------------------------------------------------------------------------------------------
# Outputs: the progress sheet, trackers, the model card

def show_validation(accelerator, folder, tag, step, specs, scales, images, made_from=None, conditions=None):
    """After a validation: what the base images were made from (`made_from` when they were made now), the progress
    sheet, the trackers, a log line.
    Edit mode: first the condition images."""
    if conditions:  # option: edit (reference r, the pipeline's image[r], in condition-r.png, the first condition.png)
        for old in folder.glob("condition*.png"):  # an earlier run's (it may have had more)
            old.unlink()
        for r, image in enumerate(conditions):
            image.save(folder / (f"condition-{r}.png" if r else "condition.png"))
    if made_from is not None:
        record_base_images(folder, made_from, conditions)
    count = len(images) // (len(specs) * len(scales))
    labels = [f"prompt {k + 1}, x{scale:g}" for k in range(len(specs)) for scale in scales for _ in range(count)]
    sheet = update_progress_sheet(folder, tag, step, len(images), labels if len(labels) > count else None)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard" and len({im.size for im in images}) == 1:
            tracker.writer.add_images(f"validation/{tag}", np.stack([np.asarray(im) for im in images]), step,
                                      dataformats="NHWC")
        elif tracker.name == "tensorboard":  # several sizes: one image each
            for row, image in enumerate(images):
                tracker.writer.add_image(f"validation/{tag}/{row}", np.asarray(image), step, dataformats="HWC")
        elif tracker.name == "wandb":
            import wandb
            captions = [f"{tag}: {specs[r // (count * len(scales))].prompt}" for r in range(len(images))]
            tracker.log({"validation": [wandb.Image(im, caption=c) for im, c in zip(images, captions)]}, step=step)
    logger.info(f"validation images ({', '.join(repr(s.prompt) for s in specs)}) in {folder}: {tag}-*.png; progress "
                f"sheet {sheet}")

def validation_rows(specs, scales, count):
    """(spec, LoRA strength) of each row of a validation's images, in the order they are made and numbered."""
    return [(spec, scale) for spec in specs for scale in scales for _ in range(count)]

def base_record(args, run, specs, scales, model, steps, conditions=None):
    """What the base model's validation images are made from, as validation/base.json holds it: the rows (prompts
    with their overrides, strengths, images each), the sampling model, the seed, size, steps, guidance, conditions."""
    return json.loads(json.dumps({  # as read back: lists, not tuples
        "specs": [dataclasses.asdict(s) for s in specs], "scales": list(scales), "count": args.num_validation_images,
        "model": [model.config.get("_name_or_path"), args.revision, args.variant, str(run.weight_dtype)],
        "seed": run.data.seed, "noise": "seed_for(seed, k)", "resolution": args.resolution, "steps": steps,
        "guidance": args.validation_guidance_scale,  # (--guidance_scale is training's alone)
        **({"transformer_file": args.transformer_file} if args.transformer_file else {}),  # option: transformer_file
        "condition": [[c.mode, list(c.size), hashlib.sha256(c.tobytes()).hexdigest()] for c in conditions or ()]
        or None}))

def read_base_record(folder):
    """validation/base.json, or None (none yet, or an older version's base images, which recorded nothing)."""
    try:
        return json.loads(Path(folder, "base.json").read_text())
    except (OSError, ValueError):
        return None

def base_images_missing(accelerator, folder, made_from):
    """Whether the base model's validation images are to be made: once per output folder, so a resume with the same
    flags skips them, and again when what makes them changed (`made_from`, a base_record; a new prompt, seed, size,
    model, condition... would be compared with another image). Agreed with the main process under FSDP, where every
    process generates."""
    count = len(made_from["specs"]) * len(made_from["scales"]) * made_from["count"]
    missing = [read_base_record(folder) != made_from or not has_images(folder, "base", count)]
    if is_fsdp(accelerator):
        broadcast_object_list(missing)
    return missing[0]

def record_base_images(folder, made_from, conditions=None):
    """After new base images: write what made them (validation/base.json, last: an interrupted write remakes them).
    Made from something else than before, the progress sheet starts again (its earlier columns hold other rows).
    Text-to-image validation then drops an earlier edit run's condition images."""
    if read_base_record(folder) != made_from:
        Path(folder, "progress-0.json").unlink(missing_ok=True)
        for old in Path(folder).glob("condition*.png") if not conditions else ():  # option: edit
            old.unlink()
    with writing(Path(folder, "base.json")):
        write_json_atomic(Path(folder, "base.json"), made_from)

def validation_folder(folder, tag, step, hooks):
    """Make the validation folder. A finished run continued to more steps validates "final" again: the earlier final
    images become those of a validation at their step, their sheet column and (options) their scores too."""
    folder.mkdir(exist_ok=True)
    record, columns = Path(folder, "progress-0.json"), sheet_columns(folder)
    for column in [c for c in columns if c["tag"] == tag == "final" and c["step"] < step]:
        column["tag"] = f"step-{column['step']:06d}"
        for image in folder.glob("final-*.png"):
            image.rename(folder / image.name.replace("final", column["tag"], 1))
        write_json_atomic(record, {"columns": columns})
        hooks.each("retagged", folder, "final", column["tag"])

def sheet_columns(folder):
    """The progress sheet's columns (validation/progress-0.json): [{"tag", "step"}], oldest first."""
    record = Path(folder, "progress-0.json")
    return json.loads(record.read_text())["columns"] if record.is_file() else []

def has_images(folder, tag, count):
    return all(Path(folder, f"{tag}-{i}.png").is_file() for i in range(count))

def update_progress_sheet(folder, tag, step, count, labels=None):
    """Add the column of validation `tag` (at optimizer `step`) to validation/progress-0.png, after the condition
    images (edit mode), the base model and the validations before it. A column of a later step is dropped first:
    after a resume the run goes on from an earlier step; so is one lacking some of the `count` rows (made with fewer
    prompts, strengths or images). The columns are listed in progress-0.json; their images are the PNGs of the
    folder."""
    columns = [c for c in sheet_columns(folder) if c["step"] < step and c["tag"] != tag] + [{"tag": tag, "step": step}]
    columns = [c for c in columns if has_images(folder, c["tag"], count)]
    write_json_atomic(Path(folder, "progress-0.json"), {"columns": columns})
    references = []
    references = sorted(Path(folder).glob("condition*.png"), key=lambda f: (len(f.name), f.name))  # option: edit
    sheet = progress_sheet(([("", [label_image(text) for text in labels])] if labels else []) +
                           [(f"condition {r + 1}" if len(references) > 1 else "condition", [Image.open(f)])
                            for r, f in enumerate(references)] +
                           ([("base model", [Image.open(Path(folder, f"base-{i}.png")) for i in range(count)])]
                            if has_images(folder, "base", count) else []) +
                           [(f"step {c['step']}", [Image.open(Path(folder, f"{c['tag']}-{i}.png"))
                                                   for i in range(count)]) for c in columns])
    path = Path(folder, "progress-0.png")
    sheet.save(path)
    return path

def label_image(text):
    """A row label of the progress sheet."""
    from PIL import ImageDraw, ImageFont
    font = ImageFont.load_default()
    width = int(font.getlength(text)) + 8
    image = Image.new("RGB", (width, 16), "white")
    ImageDraw.Draw(image).text((4, 2), text, fill="black", font=font)
    return image

def progress_sheet(columns):
    """[(caption, [image per row])] -> one image: a column per entry, its caption on top, rows aligned. Users pick
    the best checkpoint from it."""
    from PIL import ImageDraw, ImageFont
    font, pad, text_h = ImageFont.load_default(), 4, 14
    rows = max((len(images) for _, images in columns), default=0)
    widths = [max([im.width for im in images] + [int(font.getlength(caption))]) for caption, images in columns]
    heights = [max(images[r].height for _, images in columns if r < len(images)) for r in range(rows)]
    size = (sum(widths) + pad * (len(columns) + 1), text_h + sum(heights) + pad * (rows + 2))
    sheet = Image.new("RGB", size, "white")
    draw, x = ImageDraw.Draw(sheet), pad
    for (caption, images), width in zip(columns, widths):
        draw.text((x, pad), caption, fill="black", font=font)
        y = text_h + 2 * pad
        for r, image in enumerate(images):
            sheet.paste(image.convert("RGB"), (x, y))
            y += heights[r] + pad
        x += width + pad
    return sheet

def describe_captions(dataset):
    """One sentence for the log and the model card: captions and their alternatives."""
    counts = [len(caption_lines(r.caption)) for r in dataset.instances]
    captioned = sum(1 for c in counts if c)
    return (f"{captioned} of {len(counts)} images captioned, {sum(counts)} caption alternatives (one drawn per sample "
            f"and epoch)." if captioned else f"{len(counts)} images, all with the instance prompt.")

def available_trackers(report_to):
    """--report_to -> (the trackers to start, those not installed: skipped with a warning)."""
    from accelerate.utils import is_tensorboard_available, is_wandb_available
    wanted = {"all": ["tensorboard", "wandb"], "none": []}.get(report_to, report_to.split(","))
    available = {"tensorboard": is_tensorboard_available(), "wandb": is_wandb_available()}
    return [t for t in wanted if available.get(t, True)], [t for t in wanted if not available.get(t, True)]

def tracker_config(args):
    """Flags for the trackers: scalars only, and never the Hub token."""
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in vars(args).items()
            if k != "hub_token" and v is not None}

def write_model_card(args, image_paths, run, repo_id=None):
    """A local README.md for the LoRA, whose snippet loads it from here.
    Pushed to the Hub, from repo_id (else the Hub repository named).
    An edit dataset makes an image-to-image LoRA, used with a condition image."""
    dataset, family = run.data.dataset, run.data.family
    images = [Path(p).relative_to(args.output_dir).as_posix() for p in image_paths]
    specs = validation_specs(args, run.data)  # the final images' rows, as run_validation made them
    scales = run.hooks.first("validation_scales", default=lambda: [1.0])
    rows = list(zip(images, validation_rows(specs, scales, len(images) // (len(specs) * len(scales) or 1))))
    widget = "".join(f"- text: {json.dumps(s.prompt)}\n  output:\n    url: {p}\n" for p, (s, x) in rows if x == 1)
    gallery = "\n\n".join(f"![{markdown_text(s.prompt)}]({p})\n{markdown_text(s.prompt)} (LoRA strength {x:g})"
                          for p, (s, x) in rows)
    if images and Path(args.output_dir, "validation", "progress-0.png").is_file():
        gallery += ("\n\nProgress (the base model, then each validation; same noise in every column):\n\n"
                    "![progress](validation/progress-0.png)")
    shown = args.validation_prompt or args.final_validation_prompt or args.instance_prompt or (
        specs[0].prompt if specs else "...")
    kind = run.hooks.first("adapter_name", default=lambda: "LoRA")
    notes = "\n".join([describe_captions(dataset), *run.hooks.collect("describe", dataset), *run.hooks.collect("card")])
    guidance = f"guidance_scale={args.validation_guidance_scale:g}"  # as validation sampled
    use = f"image = pipe({shown!r}, {guidance}).images[0]"  # a Python literal: quotes in the prompt stay valid code
    task = "text-to-image"
    if dataset.conditions:  # option: edit (several references: a list, in training's order)
        task = "image-to-image"
        count = max(len(r.conditions) for r in dataset.instances)
        loads = ", ".join(['load_image("photo.png")'] + [f'load_image("ref-{r}.png")' for r in range(2, count + 1)])
        use = (f"condition = {f'[{loads}]' if count > 1 else loads}  # the image to edit (from diffusers.utils import "
               f"load_image)\nimage = pipe(image=condition, prompt={shown!r}, {guidance}).images[0]")
    source = args.output_dir
    source = repo_id or args.hub_model_id or source  # option: hub
    load = run.hooks.first("lora_loading", source, source != args.output_dir, default=lambda: (
        f"pipe.load_lora_weights({source!r}, weight_name={LORA_WEIGHTS_NAME!r})"))
    text = f"""---
base_model: {args.pretrained_model_name_or_path}
library_name: diffusers
license: other
instance_prompt: {json.dumps(args.instance_prompt)}
tags:
- {task}
- diffusers
- lora
- flux2
- {"flux2-klein" if family.pipeline == "Flux2KleinPipeline" else "flux2-dev"}
- dreambooth
widget:
{widget}---

# {family.name} DreamBooth LoRA

{kind} adapters (rank {args.rank}, alpha {args.lora_alpha}) for `{args.pretrained_model_name_or_path}`, trained with
DreamBooth on {f"the prompt `{args.instance_prompt}`" if args.instance_prompt else "its dataset's captions"} for \
{args.max_train_steps} steps at learning rate {args.learning_rate}.
{notes}

{gallery}

## Use

```py
import torch
from diffusers import {family.pipeline}

pipe = {family.pipeline}.from_pretrained({args.pretrained_model_name_or_path!r}, torch_dtype=torch.bfloat16)
pipe.enable_model_cpu_offload()  # moves each model to the GPU only while it runs
{load}
{use}
```

(FLUX.2 [dev]: loading the Hub tokenizer as a PixtralProcessor needs `torchvision`.)

License: the base model's license applies.
"""
    Path(args.output_dir, "README.md").write_text(text, encoding="utf-8")

def markdown_text(text):
    """`text` shown as written in Markdown (alt text, captions): one line, its markup characters escaped."""
    return re.sub(r"([\\`*_\[\]<>|#!])", r"\\\1", " ".join(text.split()))

# ================================================================================================================
# Part 3: options (delete what you do not use)
# Each section is one feature: its flags and an Option class the recipe calls at its seams while the feature is on.
# Deleting a section (and any line elsewhere marked `# option: NAME`) leaves a script that trains.
# ================================================================================================================


# ----------------------------------------------------------------------------------------------------------------
# Option: config (--config: flags from a file; --print_config; switches that take false)

@option
class ConfigFile(Option):
    """Flags from a YAML, TOML or JSON file, the command line's on top (every run writes its resolved flags to
    config.yaml, a file that repeats it); --print_config shows them resolved and stops; a switch takes true or false,
    so the command line can undo the file. Cost: none (parse_args reads the file; Switch is in Part 2)."""

    name, switches = "config", ("config", "print_config")
    flags = [flag("--config", type=readable_file, help="Flags from a YAML, TOML or JSON file; the command line wins."),
             flag("--print_config", action="store_true", help="Print the resolved flags (a --config file) and stop.")]
    prints_only = property(lambda self: self.args.print_config)

    def notes(self):
        path, ignored = vars(self.args).get("config_ignored", (None, []))  # parse_with_config dropped them
        return [f"--config {path}: ignored {', '.join('--' + n for n in ignored)} (settings of an option now off)"
                ] if ignored else []

    def resolved(self, seed, batches, accelerator):
        if self.args.print_config:
            print_config(self.args, seed, batches, accelerator)

def config_tokens(argv):
    """--config FILE (YAML, TOML or JSON: flag names, with or without --, - or _, and their values as on the command
    line; lists for flags of several values, true for switches) -> (FILE, {flag: its tokens}, argv without --config):
    the file's tokens go ahead of argv, so the command line wins and every value meets the parser's own checks. A
    problem names the file; an unknown key, the nearest flag too."""
    import difflib
    argv = list(sys.argv[1:] if argv is None else argv)
    given = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    files = [argv[i][9:] if "=" in argv[i] else " ".join(argv[i + 1:i + 2]) for i in given]
    refuse(len(given) > 1, f"--config given {len(given)} times ({', '.join(files)}): one file a run; merge them, or "
           "give the later one's flags on the command line, which wins over the file")
    i = given[0] if given else None
    if i is None or argv[i:] == ["--config"]:
        return None, {}, argv  # none, or no value: argparse says so
    path, argv = (argv[i][9:], argv[:i] + argv[i + 1:]) if "=" in argv[i] else (argv[i + 1], argv[:i] + argv[i + 2:])
    try:
        text = Path(path).read_text(encoding="utf-8")
        kind = {".json": "json", ".toml": "toml"}.get(Path(path).suffix, "yaml")
        data = read_settings(text, kind, f"--config {path}")
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - unreadable or not the format its name says
        raise UsageError(f"--config {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    refuse(not isinstance(data, dict), f"--config {path}: expected a mapping of flag names to values")
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    tokens = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name in ("version", "run") or name.endswith("_sha256") or value is None:  # besides flags, a config holds
            continue
        if name not in actions:
            hint = "".join(f" (did you mean --{near}?)" for near in difflib.get_close_matches(name, actions, 1))
            raise UsageError(f"--config {path}: {key!r} is not a flag{hint}")
        action, flag_name = actions[name], actions[name].option_strings[0]
        if name == "datasets" and not isinstance(value, str):  # option: folders (its list of mappings, as JSON)
            value = json.dumps(value)
        refuse(isinstance(value, dict) or isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value),
               f"--config {path}: {key}: {value!r} is a mapping or nested list; {flag_name} takes a value as on the "
               "command line")
        if isinstance(value, bool) and action.choices:  # YAML reads no, off and false as false, yes, on, true as true
            words = [w for w in (("yes", "on", "true") if value else ("no", "off", "false")) if w in action.choices]
            refuse(not words, f"--config {path}: {key}: YAML reads {str(value).lower()} (or yes/no, on/off) as a "
                   f"boolean, not one of {', '.join(action.choices)}; quote the word")
            value = words[0]
        if isinstance(action, argparse._StoreTrueAction):
            refuse(not isinstance(value, bool), f"--config {path}: {flag_name} {value!r}: expected true or false")
            tokens[name] = [flag_name] if value else []
        elif action.nargs in ("+", "*"):
            tokens[name] = [flag_name, *map(str, value if isinstance(value, list) else [value])]
        else:
            listed = isinstance(action.type, Accepts) and "comma-separated" in action.type.what
            refuse(isinstance(value, list) and not listed, f"--config {path}: {key}: a list ({value!r}) for "
                   f"{flag_name}, which takes one value")
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value).lower() if isinstance(
                value, bool) else str(value)
            tokens[name] = [f"{flag_name}={text}"]  # with =: a negative number is a value, not a flag
    for action in parser._actions:  # the file alone, checked as the command line is (its required flags may follow)
        action.required = False
    try:
        parser.parse_args([t for flag_tokens in tokens.values() for t in flag_tokens])
    except UsageError as e:
        raise UsageError(f"--config {path}: {e}") from None
    return path, tokens, argv

def read_settings(text, kind, name):
    """YAML, TOML or JSON `text` (kind: yaml, toml or json) -> its data. A key given twice in one mapping, which YAML
    and JSON read as its last value (a datasets: entry's forgotten dash drops a folder) and TOML refuses without
    naming it, is refused naming `name` (the file), the key and its line."""
    import yaml
    twice = lambda key, line: f"{name}: line {line}: {key!r} is given twice in one mapping"  # noqa: E731
    if kind == "toml":
        import tomllib
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:  # "Cannot overwrite a value (at line 3, ...)", "Cannot declare ... twice"
            at = re.search(r"(overwrite a value|twice) \(at line (\d+)", str(e))
            refuse(at, at and twice(re.split(r"[\s=\]]", text.splitlines()[int(at[2]) - 1].strip(" ["))[0], at[2]))
            raise
    if kind == "json":
        data, keys = json.loads(text), []  # valid JSON: a string is matched whole, so a bracket in it is not seen
        for m in re.finditer(r'"(?:[^"\\]|\\.)*"(\s*:)?|[{}\[\]]', text):
            if m[0] in "{}[]":
                keys = keys + [set()] if m[0] in "{[" else keys[:-1]
            elif m[1]:
                key = json.loads(m[0][:-len(m[1])])
                refuse(key in keys[-1], twice(key, text.count("\n", 0, m.start()) + 1))
                keys[-1].add(key)
        return data

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key, _ in node.value:  # (a merge key, <<, may repeat one: what it merges gives way)
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    refuse((key.tag, key.value) in seen, twice(key.value, key.start_mark.line + 1))
                    seen.add((key.tag, key.value))
            return super().construct_mapping(node, deep)
    return yaml.load(text, Loader=Loader)

def parse_with_config(argv):
    """The flags of a --config file, then argv's: argv wins, over the file's settings of an option it turns off too
    (an option's switch set off): those are dropped (its notes say so); its own are kept, refused by validate_args."""
    path, file_tokens, argv = config_tokens(argv)
    parser = build_parser()
    args = parser.parse_args([t for ts in file_tokens.values() for t in ts] + argv)
    ignored = sorted({n for o in OPTIONS for n in o.stray_flags(args)} & set(file_tokens)) if file_tokens else ()
    if ignored:
        args = parser.parse_args([t for n, ts in file_tokens.items() if n not in ignored for t in ts] + argv)
        args.config_ignored = (path, ignored)
    args.config = path  # taken out of argv: the file's tokens stand in for it
    return args

def print_config(args, seed, batches, accelerator):
    """--print_config: the resolved config (the step count as the images found give it), then exit 0."""
    import yaml
    steps = args.max_train_steps or optimizer_steps(args.num_train_epochs, batches, args.gradient_accumulation_steps)
    if accelerator.is_main_process:
        config = resolved_config(args, seed, accelerator, steps)
        print(yaml.safe_dump(config, sort_keys=False, allow_unicode=True), end="")
    raise SystemExit(0)


# ----------------------------------------------------------------------------------------------------------------
# Option: dataset (--dataset_name: the images and captions of a Hugging Face `datasets` dataset)

@option
class HubDataset(Option):
    """The instance images (and captions) are the train split's rows of a `datasets` dataset (a Hub name or a local
    folder) instead of --instance_data_dir's files; edit training names its condition column (read with the rows).
    `datasets` is imported only here. Cost: every row decoded and hashed at start-up."""

    words = ("`datasets`", "dataset row", "Hugging Face dataset")
    name, switches, source, replaces_data = "dataset", ("dataset_name",), "--dataset_name", True
    requires = "--dataset_name (its columns; --instance_data_dir reads same-stem .txt captions)"
    flags = [flag("--dataset_name", help="A Hugging Face `datasets` name or folder, instead of --instance_data_dir."),
             flag("--dataset_config_name", help="Config of --dataset_name; default: its only one."),
             flag("--image_column", default="image", help="Image column of --dataset_name."),
             flag("--caption_column", help="Caption column of --dataset_name; default: --instance_prompt.")]

    def check(self):
        args = self.args
        refuse(args.instance_data_dir is not None, "give exactly one of --instance_data_dir or --dataset_name")
        refuse(not args.instance_prompt and not args.caption_column, "--instance_prompt is required with "
               "--dataset_name and no --caption_column (unless captions cover every image)")

    def load_images(self, cache, accelerator):
        args = self.args
        records = load_hf_dataset(args.dataset_name, args.dataset_config_name, args.image_column, args.caption_column,
                                  args.cache_dir, vars(args).get("cond_image_column"),
                                  progress=accelerator.is_local_main_process)
        check_captioned(records, args.instance_prompt, f"--caption_column {args.caption_column}", "row(s) have no "
                        "caption")
        return records

def load_hf_dataset(name, config, image_column, caption_column, cache_dir, cond_column=None, progress=False):
    """Image records from a `datasets` dataset (Hub name or local folder); `datasets` is imported only here. With
    `cond_column`, each record carries its row's condition image(s) (a list in the cell: several references). Rows are
    decoded one at a time, so a bad one is named: every bad row in one message, as the folder scan lists bad files."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise UsageError("--dataset_name needs the `datasets` package: pip install datasets") from None
    try:
        splits = load_dataset(name, config, cache_dir=cache_dir)
    except (FileNotFoundError, ConnectionError, ValueError) as e:  # a wrong name or config, no data, no network
        raise UsageError(f"--dataset_name {name}{f' (config {config})' if config else ''}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    refuse("train" not in splits, f"--dataset_name {name}: no train split (splits: {', '.join(splits)})")
    split = splits["train"]
    for flag_name, column in (("--image_column", image_column), ("--caption_column", caption_column),
                              ("--cond_image_column", cond_column),  # option: edit
                              ):
        refuse(column is not None and column not in split.column_names,
               f"{flag_name} {column!r} is not a column of {name}; columns: {', '.join(split.column_names)}")
    split = split.select_columns(list(dict.fromkeys(c for c in (image_column, caption_column, cond_column) if c)))
    records, empty, bad = [], [], []
    for i in tqdm(range(len(split)), desc="Reading dataset rows", unit="row", disable=not progress):
        try:
            row = split[i]  # decodes the row's images (a file that cannot be read raises here), not other columns'
        except Exception as e:  # noqa: BLE001 - any decoder failure means the same thing to the user
            bad.append(f"row {i}{''.join(f' ({f})' for f in row_files(split, i))}: {e}")
            continue
        cond = row[cond_column] if cond_column else ()
        cond = [c for c in (cond if isinstance(cond, (list, tuple)) else [cond]) if c is not None]
        if cond_column and not cond:
            empty.append(str(i))
        for flag_name, column, cells in (("--image_column", image_column, [row[image_column]]),
                                         ("--cond_image_column", cond_column, cond),  # option: edit
                                         ):
            wrong = [c for c in cells if not isinstance(c, Image.Image)]
            if wrong:  # a text column, or one `datasets` was not told holds images
                raise UsageError(f"{flag_name} {column!r}: row {i} holds {type(wrong[0]).__name__}, not images "
                                 f"(feature {split.features[column]}); cast the column to datasets.Image() (in a "
                                 "metadata.jsonl, name it <something>_file_name)")
        refs = tuple(row_record(f"{name}[{i}].{cond_column}[{j}]", c) for j, c in enumerate(cond))
        caption = row[caption_column] if caption_column else None
        cells = [c for c in (caption if isinstance(caption, (list, tuple)) else [caption]) if c is not None]
        if any(not isinstance(c, str) for c in cells):  # a label or an image column: no caption to read
            raise UsageError(f"--caption_column {caption_column!r}: row {i} holds {type(caption).__name__}, not text "
                             f"(feature {split.features[caption_column]})")
        # a cell is one caption (a line break in it a space); a list's entries are alternatives, a caption file's lines
        caption = "\n".join(" ".join(line.strip() for line in c.splitlines() if line.strip()) for c in cells)
        records.append(row_record(f"{name}[{i}]", row[image_column], conditions=refs,
                                  caption=caption.strip() or None))
    refuse(bad, f"--dataset_name {name}: cannot use {len(bad)} row(s); fix or remove them:\n  " + "\n  ".join(bad))
    refuse(empty, f"--cond_image_column {cond_column!r}: {len(empty)} row(s) of {name} have no "  # option: edit
                  f"condition image (rows {', '.join(empty[:10])}{', ...' if len(empty) > 10 else ''})")
    return records

def row_record(name, image, **fields):
    """The record of an image a `datasets` row holds, decoded once: its size and content hash are those of
    ImageRecord.load's pixels (a record without a hash would decode and hash them at every cache lookup)."""
    record = ImageRecord(name=name, size=None, image=image, **fields)
    pixels = record.load()
    return dataclasses.replace(record, size=pixels.size, sha256=hashlib.sha256(pixels.tobytes()).hexdigest())

def row_files(split, i):
    """The files row i's images were read from, where `datasets` knows them (its decoders' errors seldom say)."""
    cells = split.with_format("arrow")[i].to_pylist()[0].values()
    return [c["path"] for cell in cells for c in (cell if isinstance(cell, list) else [cell])
            if isinstance(c, dict) and c.get("path")]


# ----------------------------------------------------------------------------------------------------------------
# Option: folders (--datasets: several folders, each with its own prompt, repeats and caption dropout)

# what an entry of --datasets may hold -> the rule of its value (None: any text)
ENTRY_KEYS = {"folder": existing_folder,
              "dataset": None,  # option: dataset (a `datasets` source instead of a folder, with its columns)
              "image_column": None,  # option: dataset
              "caption_column": None,  # option: dataset
              "prompt": None, "repeats": positive_int,
              "trigger_word": Accepts("a word or words on one line, without spaces around",  # option: trigger_words
                                      lambda v: v == v.strip() and "\n" not in v and "\r" not in v),
              "caption_dropout": probability}

def dataset_entries(text):
    """--datasets: a JSON or YAML list of mappings -> the list; an entry that is not one (an unknown key, no folder, a
    folder that is not one, repeats 0, ...) is refused naming it."""
    import yaml
    try:
        entries = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError:
        raise ValueError(text) from None
    if not (isinstance(entries, list) and entries and all(isinstance(e, dict) for e in entries)):
        raise ValueError(text)
    for number, entry in enumerate(entries, 1):
        where = f"--datasets entry {number} ({entry.get('folder') or entry.get('dataset') or 'no folder'})"
        unknown = [str(key) for key in entry if key not in ENTRY_KEYS]
        refuse(unknown, f"{where}: unknown key {unknown[:1]} (an entry holds {', '.join(ENTRY_KEYS)})")
        refuse(("folder" in entry) == ("dataset" in entry), f"{where}: name its folder (or dataset), one of them")
        for key, value in entry.items():  # YAML has read the value: it is checked as its flag's would be
            rule = ENTRY_KEYS[key]
            kind = {str: str, int: int, float: (int, float)}[rule.convert if rule else str]
            good = isinstance(value, kind) and not isinstance(value, bool) and (kind is not str or value.strip())
            refuse(not good or rule is not None and not rule.ok(value),
                   f"{where}: {key} {value!r}: expected {'text' if rule is None else rule.what}")
    return entries

@dataclass(frozen=True)
class Folder:
    """A --datasets entry as the run trains it, carried by each of its images' records (ImageRecord.folder), with
    the one-folder flags' values where it gives none."""

    source: str  # its folder (or its `datasets` name)
    prompt: str | None  # the prompt of its images without a caption
    repeats: int
    caption_dropout: float
    trigger_word: str | None = None  # option: trigger_words

@option
class Folders(Option):
    """Several folders, each with its own prompt for images without a caption, repeats and caption dropout (kohya's
    subsets); --instance_data_dir and its flags are the one-folder case, and give each entry what it leaves out.
    Each record carries its Folder: the dataset repeats an image its folder's times an epoch (sample_images: in
    passes, so alike repeats keep the one-folder order) and shows its prompt, the step drops its caption at its
    folder's rate. Cost: none (each folder is scanned as one would be).
    An entry may name a `datasets` source in place of a folder.
    An entry's trigger word fills its prompt and captions, as --trigger_word does."""

    words = ("several folders", "folder entr")
    name, switches, source, replaces_data = "folders", ("datasets",), "--datasets", True
    flags = [flag("--datasets", type=Accepts(f"a JSON or YAML list of entries, mappings of {', '.join(ENTRY_KEYS)}",
                                             convert=dataset_entries),
                  help="Several folders, each with its own prompt, repeats and caption dropout (a config file's "
                       "datasets: list); the one-folder flags give what an entry leaves out.")]

    def check(self):
        args, folders = self.args, [Path(e["folder"]).resolve() for e in self.args.datasets if "folder" in e]
        refuse(args.instance_data_dir is not None, "give exactly one of --instance_data_dir or --datasets (a folder "
               "of --instance_data_dir is an entry of --datasets)")
        refuse(vars(args).get("dataset_name"),  # option: dataset
               "give exactly one of --dataset_name or --datasets (an entry of --datasets may name a dataset)")
        refuse(vars(args).get("cond_data_dir"),  # option: edit
               "--cond_data_dir pairs with --instance_data_dir: edit training takes one folder, not --datasets")
        refuse(vars(args).get("class_data_dir")  # option: class_images
               and Path(args.class_data_dir).resolve() in folders, "--class_data_dir is a folder of --datasets: its "
               "images would train as the class too; use another")
        refuse(vars(args).get("output_preservation") and any(  # option: trigger_words
            e.get("trigger_word", args.trigger_word) != args.trigger_word for e in args.datasets),
            "--output_preservation replaces --trigger_word in every caption: the entries of --datasets cannot have "
            "trigger words of their own with it")

    def load_images(self, cache, accelerator):
        """Each entry's records, in entry order, carrying its Folder; an image in two entries is refused."""
        args, records, owner = self.args, [], {}
        for number, entry in enumerate(args.datasets, 1):
            folder = Folder(entry.get("folder") or entry.get("dataset"), entry.get("prompt", args.instance_prompt),
                            entry.get("repeats", args.repeats), entry.get("caption_dropout", args.caption_dropout))
            folder = dataclasses.replace(  # option: trigger_words (its own word, else --trigger_word)
                folder, trigger_word=entry.get("trigger_word", args.trigger_word))
            where, found = f"--datasets entry {number} ({folder.source})", entry_records(args, entry, cache,
                                                                                         accelerator)
            refuse(not found, f"{where}: no images found ({', '.join(sorted(IMAGE_EXTENSIONS))})")
            check_captioned(found, folder.prompt, where, "image(s) have no caption, and the entry no prompt")
            for record in found:
                first = owner.setdefault(record.content_hash(), (number, record.name))
                refuse(first[0] != number, f"{where}: {record.name} is entry {first[0]}'s {first[1]} (the same "
                       "image): an image belongs to one entry; remove one of them")
            records += [dataclasses.replace(r, folder=folder) for r in found]
        return records

    def images(self, instances):  # option: trigger_words
        """Each folder's trigger word (its own, else --trigger_word) fills [trigger] in its prompt and captions and
        goes before each caption line lacking it, as --trigger_word does for one folder (fill_trigger)."""
        records, folders = [], dict.fromkeys(r.folder for r in instances)  # entry order: each has an image
        for number, (entry, given) in enumerate(zip(self.args.datasets, folders), 1):
            where, word = f"--datasets entry {number} ({given.source})", given.trigger_word
            named = (f"{where} trigger_word" if "trigger_word" in entry else "--trigger_word",
                     f"{where} prompt" if "prompt" in entry else "--instance_prompt")
            refuse(TRIGGER in (given.prompt or "") and not word, f"{TRIGGER} in {named[1]}: give {named[0]}, the "
                   "word it stands for")
            folder = dataclasses.replace(given, prompt=with_trigger(given.prompt, word))
            mine = [dataclasses.replace(r, folder=folder) for r in instances if r.folder == given]
            records += fill_trigger(mine, word, folder.prompt, *named)
        return records

    def extra_prompts(self, texts):
        """The empty prompt, when an entry drops captions and --caption_dropout (which asks for it) does not."""
        return [""] if any(e.get("caption_dropout", 0) > 0 for e in self.args.datasets) else []

    def describe(self, dataset):
        folders = collections.Counter(r.folder for r in dataset.instances)
        lines = [f"{len(folders)} folders (--datasets):"]
        for f, n in folders.items():
            parts = [f"- `{f.source}`: {n} images, repeats {f.repeats}", f"prompt `{f.prompt}`" * bool(f.prompt)]
            parts.append(f"trigger word `{f.trigger_word}`" * bool(f.trigger_word))  # option: trigger_words
            lines.append(", ".join(filter(None, [*parts, f"caption dropout {f.caption_dropout:g}" * bool(
                f.caption_dropout)])))
        return lines

def entry_records(args, entry, cache, accelerator):
    """An entry's images: its folder's files, each named <folder>/<file>.
    An entry naming a `datasets` source: its rows."""
    if "dataset" in entry:  # option: dataset
        return load_hf_dataset(entry["dataset"], None, entry.get("image_column", "image"), entry.get("caption_column"),
                               args.cache_dir, progress=accelerator.is_local_main_process)
    masks = False
    masks = args.masked_loss  # option: masked_loss
    found = scan_folder(entry["folder"], cache, accelerator, with_masks=masks)
    return [dataclasses.replace(r, name=f"{entry['folder']}/{r.name}") for r in found]


# ----------------------------------------------------------------------------------------------------------------
# Option: masked_loss (--masked_loss: weight the loss by a mask beside each image)

@option
class MaskedLoss(Option):
    """The loss of each instance sample is weighted by its mask (x_mask.png beside x.png, else x's alpha channel):
    pixels outside train nothing. The scan decodes and checks the masks; the dataset carries each item's mask (the
    cache, with cached latents, each crop's at latent resolution) and the step weights its tokens (Part 1's lines
    marked for it). Cost: a mask decoded with each image."""

    words = ("mask",)
    name = "masked_loss"
    flags = [flag("--masked_loss", action="store_true",
                  help="Weight the loss by x_mask.png beside an image, else its alpha channel.")]

def mask_problem(mask, mask_size, image, size):
    """[why] a scanned mask of `mask_size` cannot weight its image's loss, or []: it has another aspect ratio than
    the image `image` of `size` (width, height, as displayed), up to a pixel of rounding on either side (a mask saved
    at another scale is fine; one of another aspect ratio would be stretched)."""
    (mw, mh), (w, h) = mask_size, size
    if abs(mw * h - mh * w) <= max(w, h):  # |mh - h * mw / w| <= 1 or |mw - w * mh / h| <= 1
        return []
    return [f"{mask}: the mask is {mw}x{mh}, its image {image} {w}x{h} (as displayed): training would stretch it; "
            "save it in that shape"]

def load_mask(record):
    """The loss mask as a greyscale image (255 = train here): the mask file, else the alpha channel, else None."""
    if record.mask_path is not None:
        return grey8(ImageOps.exif_transpose(Image.open(record.mask_path))).convert("L")  # a 16-bit mask's 0.25 too
    image = ImageOps.exif_transpose(Image.open(record.path) if record.path is not None else record.image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        return image.convert("RGBA").getchannel("A")
    return None

def key_mask(dataset, key):
    """The loss mask of a latent key, transformed like its pixels -> [1, H, W] in [0, 1] (ones: no mask)."""
    kind, image_id, bucket, (rh, rw), top, left, flip = key
    mask = load_mask(dataset.record(kind, image_id)) if kind == "instance" else None
    if mask is None:
        return torch.ones(1, *bucket)
    mask = mask.resize((rw, rh), Image.Resampling.BILINEAR).crop((left, top, left + bucket[1], top + bucket[0]))
    if flip:
        mask = mask.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)[None]

def reduce_mask(mask, latent_hw):
    """Pixel mask [B, 1, H, W] -> the share of each latent token's pixels inside it, [B, 1, h, w]."""
    return torch.nn.functional.interpolate(mask.float(), size=tuple(latent_hw), mode="area")

def token_mask(inputs, rows, latent_hw):
    """The step's loss mask: each latent token's share of its pixels inside the mask, [B, h*w, 1]."""
    from diffusers import Flux2Pipeline
    mask = inputs.masks[inputs.image_rows[:rows]] if inputs.encoded else reduce_mask(inputs.masks, latent_hw)
    return Flux2Pipeline._pack_latents(mask)  # [B, 1, h, w] -> [B, h*w, 1]

def masked_loss(model_pred, target, weighting, mask):
    """flow_matching_loss with each token weighted by `mask` [B, L, 1] in [0, 1] -> [B]: a sample's loss is its mean
    over the mask, so its scale does not depend on the mask's area."""
    err, mask = weighting.float().view(-1, 1, 1) * (model_pred.float() - target.float()) ** 2, mask.float()
    return (err * mask).flatten(1).sum(1) / (mask.flatten(1).sum(1) * err.shape[-1]).clamp_min(1e-8)

def prepare_masks(dataset, latents):
    """--masked_loss with cached latents: the mask of every cached (image, crop, flip) at latent resolution
    [1, 1, h, w]; small, so kept in memory and computed from the images (no VAE)."""
    cache = SampleCache()
    for key in dict.fromkeys(dataset.cached_latent_keys()):
        cache.put(key, reduce_mask(key_mask(dataset, key)[None], latents[key].shape[-2:]))
    return cache


# ----------------------------------------------------------------------------------------------------------------
# Option: disk_cache (--precompute_cache_dir: a cache on disk that later runs reuse, on by default)

TRAINER_NAME = "train_dreambooth_lora_flux2"  # the per-user cache folder is named after it
# A bound on the disk cache, not a reservation: about 3,000 [dev] prompt embeddings (15.7 MB each), two or three
# captioned datasets of 1,000 images with their latents; the [dev] checkpoint it saves reloading is 100+ GB
DEFAULT_CACHE_MAX_GB = 50.0

@option
class DiskCacheOption(Option):
    """Prompt embeddings and latents in a folder per user that later runs (and other users of a shared folder) reuse:
    content-addressed entries, leases that keep live runs' entries from eviction, a least-recently-used bound, the
    scan index. On by default: every run uses it (--precompute_cache_dir none keeps the entries in memory), so its
    code is Part 2's disk cache, each definition marked for it; a copy without it keeps the entries in memory. Cost:
    none (it saves the encoders' loading and work on every later run)."""

    words = ("disk cache", "cache folder", "lease", "eviction", "scan index", "DiskStore", "DiskCache")
    name = "disk_cache"
    flags = [flag("--precompute_cache_dir", type=cache_folder,
                  help=f"Disk cache that later runs reuse; default: $XDG_CACHE_HOME/{TRAINER_NAME}."),
             flag("--precompute_cache_max_gb", type=non_negative, default=DEFAULT_CACHE_MAX_GB,
                  help="Bound of the disk cache: least-recently-used entries are deleted.")]


# ----------------------------------------------------------------------------------------------------------------
# Option: manifest (--from_manifest: train from the disk cache alone)

@option
class FromManifest(Option):
    """The disk cache and a dataset_manifest.json (every run writes one: the data flags, the seed, the image records)
    replace the images, the text encoder and, unless validation needs it, the VAE. Cost: none."""

    words = ("manifest",)
    name, needs = "manifest", ("disk_cache",)
    flags = [flag("--from_manifest", type=readable_file, help="Train from a dataset_manifest.json and the disk "
                  "cache alone: no images, no text encoder (needs --cache_latents).")]
    replaces_data = no_text_encoder = True

    def check(self):
        args = self.args
        for name in ("instance_data_dir", "dataset_name", "datasets", "class_data_dir", "cond_data_dir"):
            refuse(vars(args).get(name) is not None,
                   f"--from_manifest replaces --{name}: the manifest names the data, the cache holds it")
        refuse(not args.cache_latents, "--from_manifest needs --cache_latents (without the images, latents can only "
               "come from the cache)")
        refuse(resolve_cache_dir(args.precompute_cache_dir, os.environ) is None,
               "--from_manifest needs the disk cache; --precompute_cache_dir none keeps nothing")
        refuse(vars(args).get("masked_loss"),  # option: masked_loss
               "--from_manifest cannot train with --masked_loss: masks are made from the source images")

    def load_images(self, cache, accelerator):
        self.manifest = read_manifest(self.args.from_manifest)
        instances, self.classes = apply_manifest(self.args, self.manifest)
        return instances

    def class_count(self):
        return len(self.classes)

    def extra_prompts(self, texts):  # option: folders (a folder's caption dropout trains on the empty prompt)
        return [""] if any(r.get("folder", {}).get("caption_dropout") for r in self.manifest["instances"]) else []

    def class_images(self, accelerator, seed, family, cache):
        return self.classes

    def resolve(self, family):
        model, args = self.manifest["model"], self.args
        refuse(model["family"] != family.pipeline, f"--from_manifest {args.from_manifest}: its entries were made for a "
               f"{model['family']} checkpoint, --pretrained_model_name_or_path is a {family.pipeline}")
        if model["pretrained_model_name_or_path"] != args.pretrained_model_name_or_path:
            logger.warning(f"--from_manifest: its embeddings and latents were made with "
                           f"{model['pretrained_model_name_or_path']}, training {args.pretrained_model_name_or_path}")

    def cache_identity(self, weight_dtype, family):
        """The manifest's identity: no model is fingerprinted, so the text encoder need not even be downloaded."""
        return CacheIdentity(self.manifest["model"]["prompt_identity"], self.manifest["model"]["latent_identity"])

    def cache_held(self, cache, dataset, todo, needed):
        """A missing entry is an error: nothing could compute it."""
        if todo.get("prompts") or todo.get("latents"):
            raise UsageError(missing_entries_message(cache.root, self.manifest["cache"], dataset,
                                                     todo.get("prompts", []), todo.get("latents", []), needed))

def read_manifest(path):
    """A dataset manifest (JSON) -> dict; UsageError naming the file when it is not one (or holds no latents)."""
    try:
        manifest = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"--from_manifest {path}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != 1:
        raise UsageError(f"--from_manifest {path}: not a {MANIFEST_NAME} of this trainer (format version 1)")
    expected = {"data": (*MANIFEST_DATA_FLAGS, "buckets", "seed"), "model": ("family", "prompt_identity",
                "latent_identity"), "instances": (), "classes": (), "entries": (), "cache": ()}
    missing = [f"{part}.{key}" if key else part for part, keys in expected.items() for key in (keys or [None])
               if part not in manifest or (key and key not in manifest[part])]
    refuse(missing, f"--from_manifest {path}: incomplete, {', '.join(missing)} missing")
    refuse(manifest["model"]["latent_identity"] is None, f"--from_manifest {path} was written by a run without "
           "--cache_latents: the cache holds no latents of its images")
    return manifest

def missing_entries_message(root, written_with, dataset, prompts, latents, needed):
    """How many entries are missing and which images (or prompts) they came from."""
    images = [dataset.record(k[0], k[1]).name for k in latents]
    texts = {r.name: caption_lines(r.caption) or [dataset.instance_prompt] for r in dataset.instances}
    for text in prompts:  # a prompt's images: those it is a caption alternative of (or the instance prompt)
        images += [name for name, alternatives in texts.items() if text in alternatives]
    others = [repr(t) for t in prompts if not any(t in alternatives for alternatives in texts.values())]
    sources = list(dict.fromkeys(images)) + [f"prompt {t}" for t in others]
    return (f"--from_manifest: {len(prompts) + len(latents)} of {needed} cache entries are missing from {root} (from "
            f"{', '.join(sources[:10])}{', ...' if len(sources) > 10 else ''}); the manifest was written with "
            f"--precompute_cache_dir {written_with}. Train once with the images to fill the cache")

def apply_manifest(args, manifest):
    """The data flags (one given differently is overridden, with a warning) and, unless --seed is given, the seed
    become the manifest's -> (instance records, class records): without files, enough for keys and sizes."""
    data, parser = manifest["data"], build_parser()
    for name in MANIFEST_DATA_FLAGS:
        if vars(args).get(name) not in (parser.get_default(name), data[name]):
            logger.warning(f"--{name} {vars(args).get(name)} ignored: the cached data were made with {data[name]!r} "
                           "(from the manifest)")
        setattr(args, name, data[name])
    args.resolutions = tuple(data.get("resolutions", [data["resolution"]]))
    args.aspect_ratio_buckets = "|".join(";".join(f"{h},{w}" for h, w in ladder)
                                         for ladder in data.get("ladders", [data["buckets"]]))
    args.use_aspect_ratio_buckets = False
    args.seed = data["seed"] if args.seed is None else args.seed

    def records(rows, caption=None):
        return [ImageRecord(name=r["name"], size=tuple(r["size"]), caption=r["caption"] or caption, sha256=r["sha256"],
                            conditions=tuple(records(r.get("conditions", [])))) for r in rows]

    instances, classes = records(manifest["instances"]), records(manifest["classes"], data["class_prompt"])
    instances = [dataclasses.replace(r, folder=Folder(**row["folder"])) if "folder" in row else r  # option: folders
                 for r, row in zip(instances, manifest["instances"])]
    logger.info(f"--from_manifest {args.from_manifest}: {len(instances)} instance images and {len(classes)} more, "
                f"their data settings and seed {data['seed']}")
    return instances, classes


# ----------------------------------------------------------------------------------------------------------------
# Option: class_images (--with_prior_preservation)

@option
class ClassImages(Option):
    """DreamBooth's prior preservation: class images (missing ones generated by the base model) train beside the
    instance images under the class prompt, so the class keeps its look. Cost: a class row per instance row."""

    words = ("class image", "class prompt", "class row", "class slot", "class part", "prior preservation")
    name = "class_images"
    flags = [
        flag("--with_prior_preservation", action="store_true", help="Also train on class images of the class."),
        flag("--class_data_dir", type=folder_to_write, help="Class images; missing ones are generated into it."),
        flag("--class_prompt", help="Prompt of the class images, e.g. 'a photo of a dog'."),
        flag("--num_class_images", type=positive_int, default=100, help="Class images wanted; all found are used."),
        flag("--prior_loss_weight", type=non_negative, default=1.0, help="Weight of the class images' loss."),
        flag("--sample_batch_size", type=positive_int, default=4, help="Batch size of class-image generation."),
        flag("--prior_generation_precision", choices=["no", "fp32", "fp16", "bf16"],  # no: the diffusers example's
             help="dtype of class-image generation; default (and no): bf16 on a GPU, fp32 on the CPU.")]

    def check(self):
        args = self.args
        if args.with_prior_preservation and not vars(args).get("from_manifest"):  # a manifest brings its own
            refuse(not args.class_prompt, "--with_prior_preservation needs --class_prompt")
            refuse(not args.class_data_dir, "--with_prior_preservation needs --class_data_dir (missing class images "
                   "are generated there)")
            refuse(args.instance_data_dir and Path(args.class_data_dir).resolve() == Path(
                args.instance_data_dir).resolve(), "--class_data_dir is --instance_data_dir: the subject's images "
                   "would train as the class, and generated class images would join the subject's; use another folder")

    def notes(self):
        args = self.args
        if args.with_prior_preservation:
            return ["--prior_loss_weight 0: the class images are encoded and trained on, but their loss counts for "
                    "nothing"] if args.prior_loss_weight == 0 else []
        return ["--class_data_dir/--class_prompt without --with_prior_preservation: no class images are used"] if (
            args.class_data_dir or args.class_prompt) is not None else []

    def class_count(self):
        return self.args.num_class_images if self.args.with_prior_preservation else None

    def class_images(self, accelerator, seed, family, cache):
        args = self.args
        return load_class_images(args, accelerator, seed, family, cache) if args.with_prior_preservation else None

def load_class_images(args, accelerator, seed, family, cache):
    Path(args.class_data_dir).mkdir(parents=True, exist_ok=True)
    records = scan_folder(args.class_data_dir, cache, accelerator, read_captions=False)
    if len(records) < args.num_class_images:
        generate_class_images(args, accelerator, seed, len(records), family)
        records = scan_folder(args.class_data_dir, cache, accelerator, read_captions=False)
    return [dataclasses.replace(r, caption=args.class_prompt) for r in records]

def generate_class_images(args, accelerator, seed, existing, family):
    """Fill --class_data_dir up to --num_class_images with images of the base model (each process a share)."""
    import diffusers
    taken = {p.name for p in Path(args.class_data_dir).iterdir()}
    missing = args.num_class_images - existing
    names = [n for n in (f"class-{i:05d}.png" for i in range(len(taken) + missing)) if n not in taken][:missing]
    dtype = DTYPES.get(args.prior_generation_precision, torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    # tokenizer=None: the Hub folder names a PixtralProcessor, which needs torchvision; set the plain tokenizer after
    pipeline = getattr(diffusers, family.pipeline).from_pretrained(
        args.pretrained_model_name_or_path, tokenizer=None, revision=args.revision, variant=args.variant,
        **file_transformer(args, dtype),  # option: transformer_file (class images of the file's transformer)
        torch_dtype=dtype, cache_dir=args.cache_dir)
    pipeline.tokenizer = load_pipeline_tokenizer(args)
    sizes = {name: sum(t.numel() * t.element_size() for t in (*c.parameters(), *c.buffers()))
             for name, c in pipeline.components.items() if isinstance(c, torch.nn.Module)}
    free = free_gpu_bytes(accelerator.device)
    if free is not None and vars(args).get("gpu_memory"):  # --memory_plan auto planned for a card of this size
        free = min(free, args.gpu_memory)
    placement = pipeline_placement(list(sizes.values()), free, args.offload)
    if placement == "device":
        pipeline.to(accelerator.device)
    else:
        getattr(pipeline, f"enable_{placement}_cpu_offload")(device=accelerator.device)
        why = "--offload" if args.offload else f"does not fit {human_bytes(free)} free on the GPU"
        logger.info(f"class images: the pipeline ({human_bytes(sum(sizes.values()))}, the largest model "
                    f"{human_bytes(max(sizes.values()))}) {why}: {placement} CPU offload ("
                    f"{'one model' if placement == 'model' else 'one layer'} on the GPU at a time)")
    pipeline.set_progress_bar_config(disable=True)
    mine = list(enumerate(names))[accelerator.process_index::accelerator.num_processes]
    batches = chunks(mine, args.sample_batch_size)
    logger.info(f"generating {missing} class images into {args.class_data_dir}")
    for batch in tqdm(batches, desc="Generating class images", disable=not accelerator.is_local_main_process):
        generators = [torch.Generator(accelerator.device).manual_seed(seed_for("class-image", seed, i))
                      for i, _ in batch]
        steps = {"num_inference_steps": args.validation_inference_steps} if family.distilled else {}
        images = pipeline(prompt=[args.class_prompt] * len(batch), height=args.resolution, width=args.resolution,
                          **steps, generator=generators, guidance_scale=args.validation_guidance_scale,
                          max_sequence_length=args.max_sequence_length,
                          text_encoder_out_layers=tuple(args.text_encoder_out_layers)).images
        for (_, name), image in zip(batch, images):
            image.save(Path(args.class_data_dir, name))  # names not yet taken: existing images are never replaced
    del pipeline
    accelerator.wait_for_everyone()

def free_gpu_bytes(device):
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None

def pipeline_placement(component_bytes, free_bytes, offload):
    """Where class-image generation puts the pipeline: "device" (all of it on the GPU), "model" (one model on the GPU
    at a time) or "sequential" (one layer at a time: slow, but fits anything); without a GPU (free_bytes None) it
    stays. A fifth more plus 2 GiB is left for activations: [dev]'s 112 GB pipeline on an 80 GB card gets model
    offload (its largest model, the 64 GB transformer, fits); on 24 GB, sequential."""
    if free_bytes is None:
        return "device"
    whole, largest = (n * 1.2 + 2 * 2**30 <= free_bytes
                      for n in (sum(component_bytes), max(component_bytes, default=0)))
    return "device" if whole and not offload else "model" if largest else "sequential"


# ----------------------------------------------------------------------------------------------------------------
# Option: edit (--cond_data_dir, --cond_image_column: image-to-image LoRAs)

def image_file(value):
    """An image Pillow recognises, from its header (the pixels are decoded once, when the run uses them)."""
    with Image.open(value) as image:
        return image.size is not None

@option
class EditTraining(Option):
    """Edit (image-to-image) training: each target image has condition images, whose clean latents' tokens follow
    the noisy target's in the sequence, as Flux2Pipeline appends a reference image's (the dataset, collate and the
    step carry them in Part 1); validation edits --validation_image. Cost: the references' tokens in every step.
    Several references: several --cond_data_dir folders (in order; docs/edit.md says why), or a list in a cell."""

    words = ("edit training", "edit LoRA", "edit mode", "image-to-image", "condition image", "reference")
    name = "edit"
    flags = [
        flag("--cond_data_dir", type=existing_folder, nargs="+", help="Condition images: x.* pairs with the target "
             "x.*; a folder a reference, in this order."),
        flag("--cond_image_column",  # option: dataset
             help="Condition image column of --dataset_name (a list: several references)."),
        flag("--validation_image", type=Accepts("a readable image file", image_file), nargs="+",
             help="The condition image validation edits, fitted into its bucket (several: the references, in order).")]

    def check(self):
        args, column = self.args, vars(self.args).get("cond_image_column")
        refuse(args.cond_data_dir and vars(args).get("dataset_name"), "--cond_data_dir pairs with "  # option: dataset
               "--instance_data_dir; with --dataset_name use --cond_image_column")
        refuse(column and not args.dataset_name,  # option: dataset
               "--cond_image_column is a column of --dataset_name; with --instance_data_dir use --cond_data_dir")
        targets, folders = args.instance_data_dir and Path(args.instance_data_dir).resolve(), [
            Path(c).resolve() for c in args.cond_data_dir or ()]
        refuse(targets in folders, "the condition images are the targets (--cond_data_dir is --instance_data_dir): the "
               "LoRA would learn to copy its input")
        refuse(len(set(folders)) < len(folders), "--cond_data_dir names a folder twice: each folder is a reference")
        given = len(args.validation_image or ())
        refuse(given and folders and given != len(folders), f"--validation_image: {given} image(s) for {len(folders)} "
               "--cond_data_dir folder(s): validation edits with as many references as training, in the same order")
        refuse(column and column == args.image_column, "the condition images are the targets "  # option: dataset
               "(--cond_image_column is --image_column): the LoRA would learn to copy its input")
        refuse((args.cond_data_dir or column) and vars(args).get("with_prior_preservation"),  # option: class_images
               "--with_prior_preservation does not combine with edit training: its class images are text-to-image "
               "samples without a condition image, and a batch cannot mix rows with and without reference tokens "
               "(every row of a batch has the same token count). Regularise an edit LoRA with edit pairs of the "
               "class instead")

    def notes(self):
        args = self.args
        prompts = args.validation_prompt or args.final_validation_prompt
        prompts = prompts or args.validation_prompts_file  # option: validation_extras
        return [] if args.validation_image is None or prompts else [
            "--validation_image without a validation prompt: nothing is validated"]

    def load_images(self, cache, accelerator):
        """The targets with their conditions: a row's condition column, or x.* of each --cond_data_dir for target x.*
        (one folder a reference, in order)."""
        args = self.args
        if args.cond_data_dir:  # a dataset's condition column: the dataset option reads it with the rows
            folders = [(f, scan_folder(f, cache, accelerator, read_captions=False)) for f in args.cond_data_dir]
            return pair_conditions(load_instance_images(args, cache, accelerator), args.instance_data_dir, folders)

    def condition(self, dataset, validates):
        """--validation_image, decoded once -> (the images fitted into the first's bucket as training fits a target's
        references, that bucket), or None; refused when the pipelines would refuse them. An edit run validating
        without one is told what it gets."""
        args = self.args
        if not args.validation_image:
            if dataset.conditions and validates:
                logger.warning("edit training validates without a condition image: give --validation_image to see "
                               "the LoRA edit it (the validation images are generated from the prompt alone)")
            return None
        images = []
        for path in args.validation_image:
            try:
                images.append(ImageRecord("", (0, 0), path=path).load())
            except Exception as e:  # noqa: BLE001 - truncated, corrupt, a decompression bomb: not an image to use
                raise UsageError(f"--validation_image {path}: cannot be decoded ({e})") from None
        first, bucket = fit_to_bucket(images[0], dataset.ladders[args.resolutions.index(args.resolution)])
        h, w = first.height, first.width  # the pipelines take conditions of 64 px a side or more, up to 8:1
        refuse(min(h, w) < 64 or max(h, w) > 8 * min(h, w), f"--validation_image {args.validation_image[0]}: it is "
               f"fitted into the bucket {h}x{w} (h x w) as training conditions are, and the FLUX.2 pipelines take "
               "condition images of at least 64 px a side and at most 8:1; raise --resolution or change the buckets")
        return [first] + [fit_to_bucket(image, [bucket])[0] for image in images[1:]], bucket

    def describe(self, dataset):
        counts = sorted({len(ids) for ids in dataset.cond_ids})
        return [f"edit training: {len(dataset.conditions)} condition images for {len(dataset.instances)} targets, "
                f"{' or '.join(map(str, counts))} per target, their tokens after the target's (the loss covers the "
                "target's)"] if dataset.conditions else []

def with_references(model_kwargs, references, dtype):
    """The step's transformer inputs with clean references (R latents [B, 4C, h, w]) after the noisy target's tokens,
    packed and numbered as Flux2Pipeline.prepare_image_latents does: reference r at time coordinate 10 + 10 r, each
    one's rows and columns from 0, concatenated in reference order (tokens [B, R*h*w, 4C], ids [B, R*h*w, 4])."""
    from diffusers import Flux2Pipeline
    tokens = torch.cat([Flux2Pipeline._pack_latents(c) for c in references], dim=1).to(dtype)
    ids = Flux2Pipeline._prepare_image_ids([c[:1] for c in references]).to(references[0].device)
    ids = ids.repeat(len(references[0]), 1, 1)
    return {**model_kwargs, "hidden_states": torch.cat([model_kwargs["hidden_states"], tokens], dim=1),
            "img_ids": torch.cat([model_kwargs["img_ids"], ids], dim=1)}

def fit_to_bucket(image, buckets):
    """A condition image as training fits conditions -> (RGB image, its nearest bucket: the edited image's size)."""
    bucket = buckets[nearest_bucket(image.height, image.width, buckets)]
    size = reference_size(bucket)
    return transform_image(image, (*draw_crop(image.size, size, True, None), False), size), bucket

def pair_conditions(targets, target_folder, folders):
    """Attach to each target x.* the image of the same stem in each condition folder ([(folder, its records)]), in
    the folders' order: its references. A target missing one, a condition without a target, or a stem with two files
    in one folder is refused, all of them listed."""
    stems, found, problems = {Path(r.name).stem for r in targets}, [], []
    for folder, conditions in folders:
        found.append({})
        for record in conditions:
            found[-1].setdefault(Path(record.name).stem, []).append(record)
        problems += [f"{target_folder}/{r.name}: no condition image {Path(r.name).stem}.* in {folder}"
                     for r in targets if Path(r.name).stem not in found[-1]]
        problems += [f"{folder}/{r.name}: no target image {Path(r.name).stem}.* in {target_folder}"
                     for r in conditions if Path(r.name).stem not in stems]
        problems += [f"{folder}: {', '.join(r.name for r in same)} are the same stem's condition; keep one"
                     for same in found[-1].values() if len(same) > 1]
    refuse(problems, f"--cond_data_dir: {len(problems)} image(s) without a partner (edit training pairs x.* of "
           f"--instance_data_dir with x.* of each --cond_data_dir folder):\n  " + "\n  ".join(problems))
    return [dataclasses.replace(r, conditions=tuple(by[Path(r.name).stem][0] for by in found)) for r in targets]


# ----------------------------------------------------------------------------------------------------------------
# Option: ema (--use_ema: an exponential moving average of the LoRA)

RAW_LORA_WEIGHTS_NAME = "pytorch_lora_weights_raw.safetensors"  # with --use_ema: the last weights before averaging

def ema_device(value):
    device = torch.device(value)
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise UsageError(f"--ema_device {value}: no such CUDA device here; use cpu")
    return device.type in ("cpu", "cuda")

@option
class EMA(Option):
    """An exponential moving average of the LoRA, validated and saved as the LoRA (the last raw weights beside it),
    checkpointed with the run. Cost: a float32 copy of the LoRA (on the CPU by default) and its update per step."""

    words = ("EMA", "moving average")
    name = "ema"
    switches = ("use_ema",)
    flags = [
        flag("--use_ema", action="store_true", help="Keep an EMA of the LoRA; it is validated and saved as the LoRA."),
        flag("--ema_decay", type=below_one, default=0.999, help="EMA decay, warmed up as min(decay, (1+t)/(10+t))."),
        flag("--ema_device", type=Accepts("cpu, or a CUDA device of this machine (cuda, cuda:N)", ema_device),
             default="cpu", help="Where the EMA lives (cpu: no GPU memory).")]

    def check(self):  # option: fsdp
        refuse(fsdp_requested(), "--use_ema is not supported under FSDP yet (the EMA would need the sharded "
               "parameters)")

    def setup(self, run):
        self.run, self.ema = run, LoraEMA(run.named_params, self.args.ema_decay, self.args.ema_device)

    def after_optimizer_step(self, run):
        self.ema.update(run.named_params)

    def training_state(self):
        return {"ema": self.ema.state_dict()}

    def training_state_problem(self, training):
        if training.get("ema") is not None:
            problem = state_fit_problem(training["ema"]["shadow"], {n: v.shape for n, v in self.ema.shadow.items()})
            return problem and f"its EMA: {problem}"
        return None

    def load_training_state(self, training):
        if training.get("ema") is not None:
            self.ema.load_state_dict(training["ema"])

    def validation_weights(self):
        return self.ema.applied(self.run.named_params)

    def checkpoint_lora(self, accelerator, run, folder):
        """A checkpoint's portable LoRA is the average too: the weights its column of the progress sheet shows (the
        raw ones, for resuming, are in its training state)."""
        with self.ema.applied(run.named_params):
            save_lora(accelerator, run.transformer, lora_state_dict(accelerator, run.transformer, run.hooks), folder,
                      run_id=run.data.run_id)
        return True

    def save_final(self, accelerator, run, raw, folder, dtype):
        save_lora(accelerator, run.transformer, raw, folder, dtype, weight_name=RAW_LORA_WEIGHTS_NAME)
        with self.ema.applied(run.named_params):
            state = lora_state_dict(accelerator, run.transformer, run.hooks)
            write_lora_files(accelerator, run.transformer, state, folder, dtype, run.hooks)
        logger.info(f"LoRA weights are the EMA; the last raw weights: {Path(folder, RAW_LORA_WEIGHTS_NAME)}")
        return True

class LoraEMA:
    """EMA of the LoRA parameters, in float32 on `device`, from the weights of the first optimizer step (not the
    random init), warmed up so early steps are not swamped: decay_t = min(decay, (1 + t) / (10 + t))."""

    def __init__(self, named_params, decay, device="cpu"):
        self.decay, self.device, self.step = decay, torch.device(device), 0
        self.shadow = {n: p.detach().to(self.device, torch.float32, copy=True) for n, p in named_params.items()}

    @torch.no_grad()
    def update(self, named_params):
        self.step += 1
        decay = 0.0 if self.step == 1 else min(self.decay, (1 + self.step) / (10 + self.step))
        for name, param in named_params.items():
            self.shadow[name].mul_(decay).add_(param.detach().to(self.device, torch.float32), alpha=1 - decay)

    def state_dict(self):
        return {"step": self.step, "shadow": self.shadow}

    def load_state_dict(self, state):
        self.step = state["step"]
        self.shadow = {n: v.to(self.device, torch.float32) for n, v in state["shadow"].items()}

    @contextlib.contextmanager
    def applied(self, named_params):
        """Temporarily put the averaged weights into the model (validation, saving); the raw ones come back."""
        raw = {n: p.detach().clone() for n, p in named_params.items()}
        for name, param in named_params.items():
            param.detach().copy_(self.shadow[name])
        try:
            yield
        finally:
            for name, param in named_params.items():
                param.detach().copy_(raw[name])


# ----------------------------------------------------------------------------------------------------------------
# Option: adapters (--init_lora, DoRA, LoKr, LoHa, --lora_format)

COMFYUI_WEIGHTS_NAME = "pytorch_lora_weights_comfyui.safetensors"  # --lora_format both: beside the diffusers file
# FLUX.2's linear layers: diffusers names (inside transformer_blocks.N / single_transformer_blocks.N, or global) ->
# the BFL names of the original checkpoint, which ComfyUI's model and ai-toolkit files use; q, k and v are row blocks
# of one fused qkv there. Read backwards from diffusers' own reader, _convert_non_diffusers_flux2_lora_to_diffusers.
BFL_DOUBLE = {"attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
              "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
              "attn.add_v_proj": ("txt_attn.qkv", 2), "attn.to_out.0": ("img_attn.proj", None),
              "attn.to_add_out": ("txt_attn.proj", None), "ff.linear_in": ("img_mlp.0", None),
              "ff.linear_out": ("img_mlp.2", None), "ff_context.linear_in": ("txt_mlp.0", None),
              "ff_context.linear_out": ("txt_mlp.2", None)}
BFL_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
BFL_GLOBAL = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
              "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
              "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
              "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
              "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
              "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
              "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
              "single_stream_modulation.linear": "single_stream_modulation.lin"}

@option
class Adapters(Option):
    """--init_lora (continue a LoRA of any layout diffusers reads), DoRA, LyCORIS' LoKr and LoHa (PEFT), and a final
    file in the BFL layout (--lora_format comfyui; ComfyUI reads the diffusers file too). Cost: DoRA, LoKr and LoHa
    compute their weight update every forward."""

    words = ("DoRA", "LoKr", "LoHa", "LyCORIS")
    name = "adapters"
    switches = ("adapter", "use_dora", "init_lora", "lora_format")
    resume_flags = ("adapter", "use_dora", "lokr_factor", "lokr_decompose_both")
    requires = "--adapter lokr"  # of its flags, only LoKr's are not switches
    flags = [
        flag("--adapter", choices=["lora", "lokr", "loha"], default="lora",
             help="LoRA, or LyCORIS' LoKr (Kronecker factors) or LoHa (Hadamard product)."),
        flag("--use_dora", action="store_true", help="DoRA: a LoRA keeping a learned magnitude per output row."),
        flag("--lokr_factor", type=Accepts("-1 or an integer >= 1", lambda v: v == -1 or v >= 1, int), default=-1,
             help="LoKr: the factor its Kronecker split aims for (-1: the most balanced one)."),
        flag("--lokr_decompose_both", action="store_true", help="LoKr: decompose the first factor into rank --rank."),
        flag("--init_lora", help="Start from this LoRA (file, folder or Hub id: ours, ai-toolkit/BFL, kohya); its "
             "rank and layers become the run's."),
        flag("--lora_format", choices=["diffusers", "comfyui", "both"], default="diffusers",
             help="Final file layout: diffusers' (ComfyUI reads it too), BFL names (comfyui: for tools that read "
                  "only those), or both.")]

    def __init__(self, args):
        super().__init__(args)
        self.kind = "DoRA" if args.use_dora else {"lokr": "LoKr", "loha": "LoHa"}.get(args.adapter)

    def check(self):
        args = self.args
        unverified = []
        unverified = ["FSDP"] if fsdp_requested() else []  # option: fsdp
        unverified += [f"--{f}" for f in ("bnb_quantization_config_path", "do_fp8_training", "blocks_to_swap")
                       if vars(args).get(f)]
        refuse(self.kind and unverified, f"{self.kind} (--use_dora, --adapter) is not verified with "
               f"{', '.join(unverified)} here; train a plain LoRA with those, or this adapter without them")
        refuse(args.adapter != "lora" and (args.use_dora or args.lora_dropout or args.init_lora),
               f"--adapter {args.adapter} takes no --use_dora, --lora_dropout or --init_lora (a LoRA file)")
        lokr = [f for f in ("lokr_factor", "lokr_decompose_both") if f in self._set(args)]
        if lokr and args.adapter != "lokr":
            raise UsageError(f"--{lokr[0]} has no effect without --adapter lokr")
        init = args.init_lora
        not_hub_id = init and (init.endswith(".safetensors") or not re.fullmatch(r"[\w.-]+/[\w.-]+", init))
        refuse(not_hub_id and not Path(init).exists(), f"--init_lora {init}: no such file or folder (expected a "
               f".safetensors file, a folder holding {LORA_WEIGHTS_NAME}, or a Hub id owner/name)")
        refuse(args.use_dora and args.lora_format != "diffusers", "DoRA (--use_dora, or a DoRA --init_lora) with "
               "--lora_format comfyui/both: ComfyUI scales DoRA against the base weights' norms, PEFT against the "
               "adapted weights' (and ComfyUI's convention is changing), so no ComfyUI file is exact; keep "
               "--lora_format diffusers (ComfyUI skips its lora_magnitude_vector: DoRA is for diffusers and PEFT)")

    def resolve(self, family):
        """--init_lora: its rank, targets and DoRA become the run's; a conflicting --rank, --lora_layers or
        --use_dora, or a module this model lacks, is refused naming both."""
        args = self.args
        if not args.init_lora:
            return
        init, parser, model = read_init_lora(args.init_lora), build_parser(), empty_transformer(args)
        linear = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear)}
        lacking = sorted(set(init.ranks) - set(linear))
        refuse(lacking, f"--init_lora {args.init_lora}: this transformer has no linear layer "
               f"{', '.join(lacking[:5])}{' ...' if len(lacking) > 5 else ''} (a LoRA of another model?)")
        sizes = {m: (init.state[f"{m}.lora_A.weight"].shape[1], init.state[f"{m}.lora_B.weight"].shape[0])
                 for m in init.ranks}
        resized = [m for m in sorted(sizes) if sizes[m] != linear[m]]
        if resized:
            (i, o), (mi, mo) = sizes[resized[0]], linear[resized[0]]
            raise UsageError(f"--init_lora {args.init_lora}: {len(resized)} layers are of another size (e.g. "
                             f"{resized[0]}: {i} -> {o} features there, {mi} -> {mo} here): a LoRA of another model?")
        refuse(args.rank != parser.get_default("rank") and args.rank != init.rank,
               f"--rank {args.rank} conflicts with --init_lora {args.init_lora}, which has rank {init.rank}")
        if args.lora_layers != parser.get_default("lora_layers"):
            targets = lora_target_modules(args.lora_layers, model.config.num_single_layers, block_linear_names(model))
            named = {n for n in linear if peft_matches(n, targets)}
            refuse(named != set(init.ranks), f"--lora_layers {args.lora_layers} names other layers than --init_lora "
                   f"{args.init_lora} adapts ({len(named)} against {len(init.ranks)} layers)")
        refuse(args.use_dora and not init.use_dora,
               f"--use_dora conflicts with --init_lora {args.init_lora}, a plain LoRA")
        args.rank, args.use_dora = init.rank, init.use_dora
        self.kind = "DoRA" if init.use_dora else self.kind
        self.check()  # again, now that the file decided DoRA: its refusals (ComfyUI's file, unverified paths) apply

    def check_model(self, model):
        """--lora_format comfyui/both: every adapted layer needs a ComfyUI (BFL) name."""
        args = self.args
        if args.lora_format == "diffusers":
            return
        targets = sorted(read_init_lora(args.init_lora).ranks) if args.init_lora else lora_target_modules(
            args.lora_layers, model.config.num_single_layers, block_linear_names(model))
        problems = []
        for name in (n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)):
            if peft_matches(name, targets):
                try:
                    bfl_name(name)
                except ValueError as e:
                    problems.append(str(e))
        refuse(problems, f"--lora_format {args.lora_format}: {'; '.join(problems[:3])}; leave those layers out of "
               "--lora_layers, or keep --lora_format diffusers (ComfyUI applies that file's norm_out.linear exactly)")

    def adapter_config(self, config, transformer):
        from peft import LoHaConfig, LoKrConfig
        args, targets, pattern = self.args, sorted(config.target_modules), {}
        if args.init_lora:
            init = read_init_lora(args.init_lora)
            targets, pattern = sorted(init.ranks), {f"^{m}$": r for m, r in init.ranks.items() if r != init.rank}
        if args.adapter == "lokr":
            return LoKrConfig(r=args.rank, alpha=args.lora_alpha, target_modules=targets,
                              decompose_both=args.lokr_decompose_both, decompose_factor=args.lokr_factor)
        if args.adapter == "loha":
            return LoHaConfig(r=args.rank, alpha=args.lora_alpha, target_modules=targets)
        return dataclasses.replace(config, target_modules=targets, rank_pattern=pattern, use_dora=args.use_dora)

    def after_lora(self, transformer, accelerator):
        """--init_lora's weights into the fresh adapter, lora_B rescaled from the file's scale to this run's
        (--lora_alpha / the module's rank): the adapted model starts as the base model with that LoRA applied."""
        from peft import set_peft_model_state_dict
        args = self.args
        if args.init_lora:
            init = read_init_lora(args.init_lora)
            rescale = {m: init.scales[m] / (args.lora_alpha / r) for m, r in init.ranks.items()}
            state = {k: v * rescale[k.rsplit(".lora_", 1)[0]] if ".lora_B." in k else v for k, v in init.state.items()}
            result = set_peft_model_state_dict(transformer, state, adapter_name="default")
            if result.unexpected_keys:
                raise UsageError(f"--init_lora {args.init_lora}: {len(result.unexpected_keys)} tensors found no layer "
                                 f"(e.g. {result.unexpected_keys[0]})")
            logger.info(f"--init_lora {args.init_lora}: {len(init.ranks)} layers start from its weights")
        return transformer

    def load_training_state(self, training):
        if self.args.init_lora:  # a resume: the checkpoint's weights continue the run, the file's are replaced
            logger.warning(f"--init_lora {self.args.init_lora}: its weights are replaced by the checkpoint's (its rank "
                           "and layers still shape the adapter)")

    def adapter_name(self):
        return self.kind

    def write_lora(self, accelerator, transformer, state, folder, dtype):
        """--lora_format comfyui: only ComfyUI's layout, under the usual name; both: it beside diffusers' file. A LoRA
        in the BFL layout (its scale folded in), a LoKr or LoHa in the LyCORIS layout."""
        from safetensors.torch import save_file
        layout = self.args.lora_format
        if layout == "diffusers":
            return None
        if layout == "both":
            save_lora(accelerator, transformer, state, folder, dtype)
        name = LORA_WEIGHTS_NAME if layout == "comfyui" else COMFYUI_WEIGHTS_NAME
        config = adapter_settings(accelerator, transformer)
        state = (to_comfyui(portable_lora(state, config.to_dict())[0]) if config.peft_type.value == "LORA"
                 else to_lycoris(state, config))
        save_file({k: v.to(dtype or v.dtype).contiguous() for k, v in state.items()}, str(Path(folder, name)),
                  metadata={"format": "pt"})
        follow_umask(Path(folder, name))
        return True

    def lora_loading(self, source, on_hub):
        """The model card's lines loading a LoHa, which diffusers cannot read (README: adapters and files): PEFT with
        the settings in the file's metadata (None: the usual load_lora_weights)."""
        if self.kind != "LoHa":
            return None
        if self.args.lora_format == "comfyui":
            return (f"# {LORA_WEIGHTS_NAME} is a LoHa in ComfyUI's (LyCORIS) layout: ComfyUI's LoRA loader reads it; "
                    "diffusers cannot")
        path, hub = (f"hf_hub_download({source!r}, {LORA_WEIGHTS_NAME!r})", "from huggingface_hub import "
                     "hf_hub_download\n") if on_hub else (repr(str(Path(source, LORA_WEIGHTS_NAME))), "")
        return ("# a LoHa: diffusers' load_lora_weights cannot read it; PEFT can, with the settings in the file's "
                f"""metadata
import json
{hub}from peft import LoHaConfig, set_peft_model_state_dict
from safetensors import safe_open

with safe_open({path}, "pt") as f:
    state = {{k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}}
    config = {{k.removeprefix("transformer."): v for k, v in json.loads(f.metadata()["lora_adapter_metadata"]).items()}}
fields = ("r", "alpha", "target_modules", "rank_pattern", "alpha_pattern")
pipe.transformer.add_adapter(LoHaConfig(**{{k: config[k] for k in fields}}))
set_peft_model_state_dict(pipe.transformer, state)""")

    def describe(self, dataset):
        return {"comfyui": [f"`{LORA_WEIGHTS_NAME}` is in ComfyUI's layout (ComfyUI's LoRA loader reads it)."],
                "both": [f"ComfyUI: `{COMFYUI_WEIGHTS_NAME}` (its LoRA loader reads it); diffusers: "
                         f"`{LORA_WEIGHTS_NAME}`."]}.get(self.args.lora_format, [])

def portable_lycoris(state, config):
    """A LoKr's or LoHa's portable_lora: each module's scale (alpha / rank) folded into one factor of its update (a
    LoKr's w1, or w1_a when decomposed; a LoHa's w1_a), the config's alphas made its ranks -> (state, config)."""
    ranks, out = {m.strip("^$"): r for m, r in config["rank_pattern"].items()}, dict(state)
    for key, value in state.items():
        module, part = key.rsplit(".", 1)
        lokr = "lokr_w1" if f"{module}.lokr_w1" in state else "lokr_w1_a"
        if part == ("hada_w1_a" if config["peft_type"] == "LOHA" else lokr):
            out[key] = value.float() * config["alpha_pattern"].get(module, config["alpha"]) / ranks.get(module,
                                                                                                      config["r"])
    return out, {**config, "alpha": config["r"], "alpha_pattern": dict(config["rank_pattern"])}  # scales 1

def bfl_name(module):
    """diffusers module name -> (BFL module name, row block of the fused qkv or None); ValueError saying why not.
    norm_out.linear has no exact BFL form: BFL holds (shift, scale) where diffusers holds (scale, shift), and
    diffusers' LoRA reader renames it without swapping the halves."""
    m = re.fullmatch(r"(single_)?transformer_blocks\.(\d+)\.(.+)", module)
    if m and m.group(1) and m.group(3) in BFL_SINGLE:
        return f"single_blocks.{m.group(2)}.{BFL_SINGLE[m.group(3)]}", None
    if m and not m.group(1) and m.group(3) in BFL_DOUBLE:
        bfl, block = BFL_DOUBLE[m.group(3)]
        return f"double_blocks.{m.group(2)}.{bfl}", block
    if module in BFL_GLOBAL:
        return BFL_GLOBAL[module], None
    raise ValueError(f"{module}: no exact ComfyUI (BFL) name" + (" (its shift and scale halves are in the other "
                     "order there)" if module == "norm_out.linear" else ""))

def to_comfyui(state):
    """A LoRA (PEFT names, scale folded into lora_B) -> ComfyUI's FLUX.2 layout, ai-toolkit's (diffusers reads it):
    diffusion_model.<BFL name>.lora_A / lora_B.weight. The fused qkv is exact: A = the three A stacked [R, in], B
    block-diagonal [3h, R] (R = r_q + r_k + r_v; a projection not adapted is a zero row block). No .alpha tensors:
    ComfyUI then applies scale 1, the folded scale (and diffusers' reader of this layout refuses .alpha keys)."""
    out, fused = {}, collections.defaultdict(dict)
    for key, value in state.items():
        module, _, part = key.rpartition(".lora_")
        bfl, block = bfl_name(module)
        if block is None:
            out[f"diffusion_model.{bfl}.lora_{part}"] = value
        else:
            fused[bfl].setdefault(block, {})[part] = value
    for bfl, blocks in fused.items():
        a = torch.cat([blocks[b]["A.weight"] for b in sorted(blocks)])  # [R, in]
        h = next(iter(blocks.values()))["B.weight"].shape[0]
        b = torch.block_diag(*(blocks[i]["B.weight"] if i in blocks else a.new_zeros(h, 0) for i in range(3)))
        out[f"diffusion_model.{bfl}.lora_A.weight"], out[f"diffusion_model.{bfl}.lora_B.weight"] = a, b  # [3h, R]
    return out

def to_lycoris(state, config):
    """A LoKr or LoHa (PEFT names) -> the LyCORIS layout ComfyUI reads for FLUX.2: lycoris_<name with _> for the
    separate q, k and v (ComfyUI applies them to row slices of the fused qkv: a Kronecker or Hadamard product has no
    block-diagonal form to fuse), diffusion_model.<BFL name> for the rest, and .alpha. ComfyUI scales a LoKr whose
    two factors are full matrices by 1, where PEFT scales it by alpha / r: then alpha / r goes into lokr_w1 instead."""
    groups = collections.defaultdict(dict)
    for key, value in state.items():
        module, _, part = key.rpartition(".")
        groups[module][part] = value
    out = {}
    for module, parts in groups.items():
        bfl, block = bfl_name(module)
        name = f"lycoris_{module.replace('.', '_')}" if block is not None else f"diffusion_model.{bfl}"
        r = config.rank_pattern.get(module, config.r)
        alpha = float(config.alpha_pattern.get(module, config.alpha))
        if "lokr_w1" in parts and "lokr_w2" in parts:  # no factor decomposed
            out.update({f"{name}.lokr_w1": parts["lokr_w1"] * (alpha / r), f"{name}.lokr_w2": parts["lokr_w2"]})
        else:
            out.update({f"{name}.{p}": v for p, v in parts.items()})
            out[f"{name}.alpha"] = torch.tensor(alpha)
    return out

@dataclass(frozen=True)
class InitLora:
    state: dict  # PEFT names, no prefix: lora_A / lora_B [/ lora_magnitude_vector]
    ranks: dict  # module -> rank
    scales: dict  # module -> the file's alpha / rank (what its loaders apply)
    use_dora: bool

    @property
    def rank(self):  # the most common one; the others go into rank_pattern
        return collections.Counter(self.ranks.values()).most_common(1)[0][0]

@functools.cache
def read_init_lora(path):
    """--init_lora (a file, a folder holding pytorch_lora_weights.safetensors, or a Hub id) -> InitLora, read by
    diffusers' Flux2Pipeline.lora_state_dict, so every layout it reads works: ours, ai-toolkit/BFL (fused qkv: A
    duplicated, B split per projection), kohya. Columns of lora_B all zero (the other projections' blocks of a fused
    qkv) go with their rows of lora_A, so a fused file gives back its per-projection ranks and targets."""
    from diffusers import Flux2Pipeline
    from safetensors.torch import load_file
    file = Path(path) / LORA_WEIGHTS_NAME if Path(path).is_dir() else Path(path)
    try:
        source = load_file(str(file)) if file.is_file() else path  # else a Hub repo id, downloaded by diffusers
        if isinstance(source, dict):
            for key in [k for k in source if k.startswith("diffusion_model.") and k.endswith(".alpha")]:
                module = key.removesuffix(".alpha")  # BFL alphas, which diffusers' reader refuses: folded into B
                down = next(k for k in (f"{module}.lora_A.weight", f"{module}.lora_down.weight") if k in source)
                up = down.replace("lora_A", "lora_B").replace("lora_down", "lora_up")
                source[up] = source[up] * (source.pop(key).item() / source[down].shape[0])
        state, meta = Flux2Pipeline.lora_state_dict(source, return_lora_metadata=True)
    except Exception as e:  # noqa: BLE001 - missing, unreadable, not a LoRA diffusers reads: the same advice
        raise UsageError(f"--init_lora {path}: cannot read a FLUX.2 LoRA from it ({type(e).__name__}: {e})") from None
    if not state:  # diffusers' reader keeps no key it does not know for FLUX.2
        example = f" (e.g. {next(iter(source))})" if isinstance(source, dict) and source else ""
        raise UsageError(f"--init_lora {path}: no layer of a FLUX.2 transformer in it{example}: a LoRA of another "
                         "model (SDXL, FLUX.1)?")
    parts = collections.defaultdict(dict)
    for key, value in state.items():
        m = re.fullmatch(r"transformer\.(.+)\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector)", key)
        refuse(m is None, f"--init_lora {path}: {key} is not a LoRA tensor of the transformer (LoKr, LoHa, text "
               "encoder and bias adapters cannot be continued)")
        parts[m.group(1)][m.group(2)] = value
    meta = {k.removeprefix("transformer."): v for k, v in (meta or {}).items()}
    out, ranks, scales = {}, {}, {}
    for module, t in parts.items():
        a, b = t["lora_A.weight"], t["lora_B.weight"]
        keep = b.ne(0).any(dim=0)
        if not keep.any() and "lora_magnitude_vector" not in t:
            continue  # a projection's zero block of a fused qkv: no update
        a, b = a[keep].contiguous(), b[:, keep].contiguous()
        out.update({f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": b})
        if "lora_magnitude_vector" in t:
            out[f"{module}.lora_magnitude_vector"] = t["lora_magnitude_vector"]
        ranks[module] = a.shape[0]
        rank = t["lora_A.weight"].shape[0]  # the file's (without metadata: alpha = rank, scale 1)
        alpha = pattern_value(meta.get("alpha_pattern"), module, meta.get("lora_alpha", rank))
        scales[module] = alpha / pattern_value(meta.get("rank_pattern"), module, meta.get("r", rank))
    refuse(not ranks, f"--init_lora {path}: it holds no update (every lora_B is zero)")
    broken = [k for k, v in out.items() if not torch.isfinite(v).all()]
    if broken:
        raise UsageError(f"--init_lora {path}: {len(broken)} tensors hold NaN or infinite values (e.g. {broken[0]})")
    return InitLora(out, ranks, scales, any("lora_magnitude_vector" in t for t in parts.values()))

def pattern_value(pattern, module, default):
    """A PEFT rank_pattern / alpha_pattern entry for `module` (its keys match as PEFT matches them), else default."""
    return next((value for key, value in (pattern or {}).items() if re.match(rf"(.*\.)?({key})$", module)), default)


# ----------------------------------------------------------------------------------------------------------------
# Option: trigger_words (--trigger_word, --output_preservation)

TRIGGER = "[trigger]"  # the placeholder ai-toolkit's captions use

def with_trigger(text, word):
    return text.replace(TRIGGER, word) if word and text else text

def mentions(text, word):
    """Whether `word` stands in `text` as a word of its own (not inside another)."""
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text or "") is not None

@option
class TriggerWords(Option):
    """--trigger_word fills [trigger] and goes before each caption line lacking it; --output_preservation trains the
    prediction for the caption with the word replaced by --class_word toward the base model's (same noisy latents).
    Cost: output preservation adds a forward without gradients and P more rows to the trained forward and backward."""

    words = ("trigger", "output preservation", "class word")
    name = "trigger_words"
    placeholder = TRIGGER  # a [trigger] without --trigger_word turns this on, to refuse it
    switches, requires = ("trigger_word", "output_preservation", "class_word"), "--output_preservation"
    prompt_flags = ("instance_prompt", "class_prompt", "validation_prompt", "final_validation_prompt")
    flags = [
        flag("--trigger_word", type=Accepts("a word or words on one line, without spaces around", lambda v: bool(
            v.strip()) and v == v.strip() and "\n" not in v and "\r" not in v),
             help="The subject's word: fills [trigger], and goes before caption lines lacking it."),
        flag("--output_preservation", action="store_true", help="Keep the class's look: the prediction for the "
             "caption with --trigger_word replaced by --class_word trains toward the base model's."),
        flag("--class_word", help="What --output_preservation puts in place of --trigger_word, e.g. 'dog'."),
        flag("--output_preservation_weight", type=non_negative, default=1.0, help="Weight of that loss.")]

    def check(self):
        args = self.args
        placed = [f for f in self.prompt_flags if TRIGGER in (vars(args).get(f) or "")]
        if placed and not args.trigger_word:
            raise UsageError(f"{TRIGGER} in --{placed[0]}: give --trigger_word, the word it stands for")
        refuse(args.class_word and not args.output_preservation, "--class_word is the word --output_preservation "
               "puts in place of --trigger_word; add --output_preservation, or leave --class_word out")
        if not args.output_preservation:  # --trigger_word switches the option on, so the generic stray check is quiet
            for name in [n for n in self._set(args) if n not in ("trigger_word", "class_word")][:1]:
                raise UsageError(f"--{name} has no effect without --output_preservation")
            return
        refuse(not (args.trigger_word and args.class_word), "--output_preservation needs --trigger_word and "
               "--class_word (the preservation prompt is the caption with the one replaced by the other)")
        refuse(vars(args).get("with_prior_preservation"),  # option: class_images
               "--output_preservation and --with_prior_preservation are two ways to the same end: choose one")
        refuse(vars(args).get("cond_data_dir") or vars(args).get("cond_image_column"),  # option: edit
               "--output_preservation is not supported for edit training")
        refuse(vars(args).get("compile"), "--output_preservation is not supported with --compile "  # option: compile
               "(switching the adapters off for the base prediction would compile the blocks twice)")
        if mentions(args.class_word, args.trigger_word):
            raise UsageError(f"--class_word {args.class_word!r} contains --trigger_word {args.trigger_word!r}")

    def notes(self):
        return ["--output_preservation_weight 0: every step pays for the base model's prediction, which counts for "
                "nothing"] if self.args.output_preservation and self.args.output_preservation_weight == 0 else []

    def resolve(self, family):
        for name in [n for n in self.prompt_flags if TRIGGER in (vars(self.args).get(n) or "")]:
            setattr(self.args, name, with_trigger(getattr(self.args, name), self.args.trigger_word))

    def images(self, instances):
        """--trigger_word in the captions (fill_trigger)."""
        if vars(self.args).get("datasets"):  # option: folders (each folder's word: that option fills them)
            return instances
        return fill_trigger(instances, self.args.trigger_word, self.args.instance_prompt, "--trigger_word",
                            "--instance_prompt")

    def prompt(self, text):
        refuse(TRIGGER in text and not self.args.trigger_word,
               f"{TRIGGER} in the validation prompt {text!r}: give --trigger_word, the word it stands for")
        return with_trigger(text, self.args.trigger_word)

    def describe(self, dataset):
        args = self.args
        text = f"trigger word `{args.trigger_word}`" if args.trigger_word else ""
        if args.output_preservation:
            text += (f"; output preservation: `{args.trigger_word}` -> `{args.class_word}`, weight "
                     f"{args.output_preservation_weight}")
        return [text] if text else []

    def extra_prompts(self, texts):
        args = self.args
        return [preservation_text(t, args.trigger_word, args.class_word) for t in texts if args.output_preservation]

    def extra_texts(self):
        return self.extra_prompts if self.args.output_preservation else None

def with_preservation(transformer, model_kwargs, embeds, weight):
    """The step's transformer inputs with its first P rows again under their preservation prompts `embeds` [P, L, D],
    after its B rows; the base model (adapters off, no gradients) predicts them -> (those inputs, the P rows' prediction
    -> weight x MSE to the base's)."""
    from accelerate.utils import extract_model_from_parallel
    rows = {k: None if v is None else v[:len(embeds)] for k, v in model_kwargs.items()}
    rows["encoder_hidden_states"] = embeds
    with torch.no_grad(), adapters_off(extract_model_from_parallel(transformer)):
        base = transformer(**rows, return_dict=False)[0]
    joined = {k: None if v is None else torch.cat([v, rows[k]]) for k, v in model_kwargs.items()}
    return joined, lambda pred: weight * (pred.float() - base.float()).pow(2).mean()

def fill_trigger(records, word, prompt, word_flag, prompt_flag):
    """`records` with [trigger] filled in every caption, and 'WORD, ' put before each caption line lacking the word;
    refused by name: a [trigger] without the word, images whose only prompt (`prompt`) lacks it (the run could not
    name its subject). word_flag, prompt_flag: where the word and the prompt were given."""
    bare = [r.name for r in records if not r.caption]
    if not word:
        placed = [r.name for r in records if TRIGGER in (r.caption or "")]
        refuse(placed, f"{TRIGGER} in the captions of {', '.join(placed[:5])}{', ...' * (len(placed) > 5)}: give "
               f"{word_flag}, the word it stands for")
        return records
    refuse(bare and not mentions(prompt, word), f"{word_flag} {word}: {prompt_flag} {prompt!r}, the prompt of "
           f"{len(bare)} image(s) without a caption ({', '.join(bare[:3])}), does not contain it; write it in (or "
           f"{TRIGGER} where it goes)")

    def fill(line):
        line = with_trigger(line, word)
        return line if mentions(line, word) else f"{word}, {line}"

    return [dataclasses.replace(r, caption="\n".join(map(fill, caption_lines(r.caption)))) if r.caption else r
            for r in records]

def preservation_text(text, word, class_word):
    """An instance text with the trigger word replaced by the class word: what output preservation keeps unchanged."""
    return re.sub(rf"(?<!\w){re.escape(word)}(?!\w)", class_word.replace("\\", r"\\"), text)


# ----------------------------------------------------------------------------------------------------------------
# Option: text_encoders (remote, quantised, sharded over the processes), for precompute

def http_url(value):
    return re.fullmatch(r"https?://[^/\s]+(/\S*)?", value) is not None

@option
class TextEncoders(Option):
    """Prompts encoded without a whole text encoder on each GPU: [dev]'s remote encoder (a Hugging Face endpoint),
    int8 (torchao) or NF4 (bitsandbytes) weights, or sharded with FSDP2. Precompute only: no cost per step."""

    words = ("remote text encoder", "remote encoder", "sharded text encoder", "quantised text encoder")
    name = "text_encoders"
    switches = ("remote_text_encoder", "text_encoder_quantization", "fsdp_text_encoder")
    requires = "--remote_text_encoder"
    no_text_encoder = sharded_text_encoder = False  # per run: set from its flags
    flags = [
        flag("--remote_text_encoder", action="store_true",
             help="[dev]: embeddings from Hugging Face's remote text encoder (uses your Hub login)."),
        flag("--remote_text_encoder_url", type=Accepts("an http(s) URL", http_url),
             default="https://remote-text-encoder-flux-2.huggingface.co/predict", help="Its endpoint."),
        flag("--text_encoder_quantization", choices=["none", "int8", "nf4"], default="none",
             help="int8 (any device) or NF4 (CUDA) weights: [dev]'s encoder in about 25 or 15 GB, not 48."),
        flag("--fsdp_text_encoder", action="store_true", help="Shard the text encoder over the processes.")]

    def __init__(self, args):
        super().__init__(args)
        self.no_text_encoder, self.sharded_text_encoder = args.remote_text_encoder, args.fsdp_text_encoder

    def check(self):
        args, processes = self.args, int(os.environ.get("WORLD_SIZE", 1))
        refuse(args.remote_text_encoder and not hub_token(args), "".join([
            "--remote_text_encoder needs a Hugging Face token: run `hf auth login`",
            " (or pass --hub_token)",  # option: hub
        ]))
        refuse(args.text_encoder_quantization == "nf4" and not (torch.cuda.is_available() or vars(args).get(
            "plan_only")), "--text_encoder_quantization nf4 needs a CUDA GPU (bitsandbytes); int8 works on any device")
        refuse(args.text_encoder_quantization != "none" and (args.remote_text_encoder or args.fsdp_text_encoder),
               "--text_encoder_quantization quantises the text encoder this process loads: leave out "
               "--remote_text_encoder and --fsdp_text_encoder")
        refuse(args.fsdp_text_encoder and (processes < 2 or args.remote_text_encoder), "--fsdp_text_encoder shards "
               "the text encoder over several processes: launch 2 or more, without --remote_text_encoder")

    def resolve(self, family):
        if self.args.remote_text_encoder and family.pipeline != "Flux2Pipeline":
            raise UsageError(f"--remote_text_encoder serves FLUX.2 [dev] embeddings only, not {family.name}")

    def cache_identity(self, weight_dtype, family):  # option: disk_cache
        args = self.args
        identity = cache_identity(args, weight_dtype, family, ["remote", args.remote_text_encoder_url]
                                  if args.remote_text_encoder else None)
        if args.text_encoder_quantization != "none":  # other embeddings: cached apart
            identity.prompts.append(args.text_encoder_quantization)
        return identity

    def prompt_encoder(self):
        """--remote_text_encoder: texts -> [dev] embeddings [B, L, D], one prompt a request."""
        if not self.args.remote_text_encoder:
            return None
        url, token = self.args.remote_text_encoder_url, hub_token(self.args)
        return lambda texts: torch.cat([remote_prompt_embeds(url, text, token) for text in texts])

    def prompt_batch_size(self):
        return 1 if self.args.remote_text_encoder else None

    def text_encoder(self, load, accelerator, dtype):
        """int8: torchao, each linear layer quantised on the device, so the bf16 model is never whole on it; NF4:
        bitsandbytes (embeddings and the output layer stay bf16); sharded: FSDP2, a decoder layer gathered only while
        it runs (precompute_prompts gives every process as many passes). Embeddings change a little: docs/memory.md."""
        mode = self.args.text_encoder_quantization
        if mode == "nf4":
            import transformers
            config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                     bnb_4bit_compute_dtype=dtype)
            return load(quantization_config=config, device_map={"": accelerator.device}).eval()
        if mode == "int8":
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
            text_encoder = load().eval()
            quantize_(text_encoder, Int8WeightOnlyConfig(), device=accelerator.device)
            return text_encoder.to(accelerator.device)
        if self.args.fsdp_text_encoder:
            from torch.distributed.fsdp import fully_shard
            text_encoder = load().eval()
            layers = [m for m in text_encoder.modules() if type(m).__name__.endswith("DecoderLayer")]
            for layer in layers:
                fully_shard(layer)
            fully_shard(text_encoder)
            logger.info(f"text encoder sharded over {accelerator.num_processes} processes ({len(layers)} layers)")
            return text_encoder
        return None

def hub_token(args):
    from huggingface_hub import get_token
    return vars(args).get("hub_token") or get_token()

def remote_prompt_embeds(url, prompt, token):
    """[dev] embedding [1, L, D] of one prompt from the remote text encoder. The reply is decoded with
    torch.load(weights_only=True): tensors only, so a hostile or broken server cannot run code here."""
    import urllib.error
    import urllib.request
    request = urllib.request.Request(url, data=json.dumps({"prompt": prompt}).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            content = response.read()
    except urllib.error.HTTPError as e:
        raise TrainingStopped(f"--remote_text_encoder: {url} answered HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise TrainingStopped(f"--remote_text_encoder: cannot reach {url} ({e.reason})") from None
    try:
        embeds = torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - not a tensor-only payload: refuse whatever it is
        raise TrainingStopped(f"--remote_text_encoder: {url} did not send a tensor ({type(e).__name__}: {e})") from None
    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 3 or embeds.shape[0] != 1:
        raise TrainingStopped(f"--remote_text_encoder: {url} sent {type(embeds).__name__} "
                              f"{getattr(embeds, 'shape', '')}, expected a [1, L, D] tensor")
    return embeds


# ----------------------------------------------------------------------------------------------------------------
# Option: prodigy (--optimizer prodigy)

true_or_false = Accepts("true or false", convert=boolean)

@option
class Prodigy(Option):
    """Prodigy (the prodigyopt package) finds its own step size; its learning rate multiplies it (usually 1.0).
    Cost: about twice AdamW's optimizer state."""

    words = ("Prodigy",)
    name = "prodigy"
    switches, requires = ("optimizer",), "--optimizer prodigy"
    replaces_optimizer = True
    flags = [
        flag("--optimizer", type=str.lower, default="adamw", choices=["adamw", "prodigy"],
             help="AdamW, or Prodigy (needs prodigyopt; its learning rate is a multiplier, usually 1.0)."),
        flag("--prodigy_beta3", type=below_one, help="Prodigy's step-size decay; default: sqrt(--adam_beta2)."),
        flag("--prodigy_decouple", type=true_or_false, default=True, help="Decoupled weight decay."),
        flag("--prodigy_use_bias_correction", type=true_or_false, default=True, help="Adam's bias correction."),
        flag("--prodigy_safeguard_warmup", type=true_or_false, default=True,
             help="Keep the step size from growing during warm-up.")]

    def check(self):
        if importlib.util.find_spec("prodigyopt") is None:
            raise UsageError("--optimizer prodigy needs the prodigyopt package: pip install prodigyopt")

    def notes(self):
        return [f"--learning_rate {self.args.learning_rate} with Prodigy: its learning rate is a multiplier of the "
                "step it finds, usually 1.0"] if self.args.learning_rate < 0.1 else []

    def optimizer(self, params, hyper):
        import prodigyopt
        args = self.args
        if vars(args).get("use_8bit_adam"):  # option: compile
            logger.warning("--use_8bit_adam applies to --optimizer adamw only; ignored with prodigy")
        return prodigyopt.Prodigy(params, **hyper, beta3=args.prodigy_beta3, decouple=args.prodigy_decouple,
                                  use_bias_correction=args.prodigy_use_bias_correction,
                                  safeguard_warmup=args.prodigy_safeguard_warmup)


# ----------------------------------------------------------------------------------------------------------------
# Option: fsdp (accelerate's FSDP: each process holds a shard of the model)

@option
class FSDP(Option):
    """Training under accelerate's FSDP (its config turns it on): the LoRA and the optimizer state are gathered from
    the shards to save them and scattered to resume. Cost: those collectives at each checkpoint."""

    words = ("FSDP",)
    name = "fsdp"
    env = "ACCELERATE_USE_FSDP"
    places_transformer = True  # accelerate moves and shards one wrapped block at a time

    def load_transformer(self, accelerator, weight_dtype):
        """Under cpu_ram_efficient_loading, only process 0 reads the weights (accelerate broadcasts them while it
        shards): a node holds one copy of [dev]'s 64 GB, not one a process. Quantised weights load everywhere."""
        plugin = accelerator.state.fsdp_plugin if is_fsdp(accelerator) else None
        if not (plugin and plugin.cpu_ram_efficient_loading and not accelerator.is_main_process
                and not vars(self.args).get("bnb_quantization_config_path")):
            return None
        logger.info(f"process {accelerator.process_index}: an empty transformer; its weights come from process 0 "
                    "as FSDP shards (cpu_ram_efficient_loading)", main_process_only=False)
        return empty_transformer(self.args).to(weight_dtype)

    def before_lora(self, transformer, accelerator):
        return transformer if is_fsdp(accelerator) else transformer.to(accelerator.device)  # FSDP asked, not granted

    def after_lora(self, transformer, accelerator):
        if is_fsdp(accelerator) and transformer.device.type == "meta":  # lean loading: accelerate hands the optimizer
            transformer.to_empty(device="cpu")  # the sharded parameters by data pointer, 0 for all meta tensors
        return transformer

    def lora_state(self, accelerator, transformer):
        """The full LoRA gathered from the shards (a collective every process must join), in peft's naming."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        if not is_fsdp(accelerator):
            return None
        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
        return {k.replace(".default.", "."): v for k, v in get_model_state_dict(transformer, options=options).items()}

    def optimizer_state(self, accelerator, run):
        """The optimizer's full state (safetensors cannot hold DTensors; LoRA states are small). A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        if not is_fsdp(accelerator):
            return None
        return get_optimizer_state_dict(run.transformer, run.optimizer, options=StateDictOptions(full_state_dict=True))

    def load_state(self, accelerator, run, training):
        """Every process passes the full tensors; torch keeps each process's shard."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        if not is_fsdp(accelerator):
            return None
        options, names = StateDictOptions(full_state_dict=True, strict=False), fsdp_lora_params(run.transformer)
        set_model_state_dict(run.transformer, {names[k][0]: v for k, v in training["lora"].items()}, options=options)
        set_optimizer_state_dict(run.transformer, run.optimizer, training["optimizer"], options=options)
        return True

    def expected_lora(self, accelerator, run):
        """FSDP2's DTensor.shape is the full shape; FSDP1's flat shards have none, so only their names compare."""
        from torch.distributed.tensor import DTensor
        if not is_fsdp(accelerator):
            return None
        return {k: p.shape if isinstance(p, DTensor) else None
                for k, (_, p) in fsdp_lora_params(run.transformer).items()}

def fsdp_lora_params(transformer):
    """Under FSDP: the LoRA parameters, {name as saved (peft's, without the adapter name): (name here, parameter)}."""
    params = {re.sub(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.", "", n): p
              for n, p in transformer.named_parameters() if p.requires_grad}
    return {n.replace(".default.", "."): (n, p) for n, p in params.items()}


# ----------------------------------------------------------------------------------------------------------------
# Option: transformer_file (--transformer_file: the transformer from one .safetensors file, BFL's or ComfyUI's)

HUB_FILE = r"https://huggingface\.co/([\w.-]+/[\w.-]+)/(?:blob|resolve)/([^/]+)/(.+\.safetensors)"  # repo, rev, file
single_file = Accepts("a .safetensors file, or a Hub URL to one (https://huggingface.co/OWNER/NAME/blob/main/FILE)",
                      lambda v: re.fullmatch(HUB_FILE, v) or v.endswith(".safetensors") and readable_file.ok(v))
FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}  # safetensors' floating dtypes
SCALES, EXTRAS = (".weight_scale", ".scale_weight"), (".comfy_quant", ".input_scale", "scaled_fp8")  # ComfyUI's fp8

@functools.lru_cache(maxsize=None)
def local_file(source, cache_dir):
    """The file itself, or a Hub URL's file downloaded (once) into the Hub cache -> its path."""
    if not (m := re.fullmatch(HUB_FILE, source)):
        return source
    from huggingface_hub import hf_hub_download
    return hf_hub_download(m[1], m[3], revision=m[2], cache_dir=cache_dir)

def file_tensors(names, get, dtype):
    """A single file's tensors (the set of their `names`; get(name) -> one as stored) -> {BFL name: tensor in
    `dtype`}, read one at a time: ComfyUI's 'model.diffusion_model.' prefix dropped, its scaled fp8 weights times
    their scales (which go), its quantisation records gone."""
    state = {}
    for name in names:
        if name.endswith(SCALES + EXTRAS):
            continue
        tensor = get(name)
        for scale in [name.removesuffix("weight") + s[1:] for s in SCALES if name.endswith(".weight")]:
            tensor = tensor.float() * get(scale).float() if scale in names else tensor
        # a copy: safetensors maps the file, 8 bytes off the alignment from_pretrained's copies have (matmuls round
        # otherwise in their last bits)
        state[name.removeprefix("model.diffusion_model.")] = tensor.to(dtype, copy=True)
    return state

def outline(shapes):
    """{diffusers name: shape} of a FLUX.2 transformer -> its blocks, width and guidance embedding, in words."""
    double, single = (len({n.split(".")[1] for n in shapes if n.startswith(prefix)})
                      for prefix in ("transformer_blocks.", "single_transformer_blocks."))
    guided = "time_guidance_embed.guidance_embedder.linear_1.weight" in shapes
    return (f"{double} double- and {single} single-stream blocks of width {shapes.get('x_embedder.weight', '?')[0]}, "
            f"{'a' if guided else 'no'} guidance embedding")

def file_problem(header, model):
    """What keeps a single file (its safetensors header) from holding `model`'s transformer (on the meta device) ->
    words, or None: its tensors through diffusers' own converter, compared by name and shape."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers as convert
    names = {n for n in header if n != "__metadata__"}
    kinds = {header[n]["dtype"] for n in names if not n.endswith(EXTRAS)} - FLOATS
    if kinds:
        return (f"it stores tensors as {', '.join(sorted(kinds))}, a quantised format not read here (bf16, fp16, fp32 "
                "and fp8 files are)")
    state = file_tensors(names, lambda n: torch.empty(header[n]["shape"], device="meta"), torch.float32)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    try:  # a file in diffusers' layout loads as it is
        found = {n: tuple(t.shape) for n, t in (state if state.keys() == expected.keys() else convert(state)).items()}
    except Exception as e:  # noqa: BLE001 - names diffusers' FLUX.2 converter does not know
        found = {f"{type(e).__name__}: {e}": None}
    if not found.keys() & expected.keys():
        return f"not a FLUX.2 transformer in BFL, ComfyUI or diffusers layout ({next(iter(found), 'no tensors')})"
    if outline(found) != outline(expected):
        return f"its transformer has {outline(found)}, where the checkpoint's has {outline(expected)}"
    differ = [(n, found.get(n), expected.get(n)) for n in sorted(found.keys() | expected.keys())
              if found.get(n) != expected.get(n)]
    if not differ:
        return None
    return (f"tensors that differ from the checkpoint's transformer's: {len(differ)}, e.g. {differ[0][0]}: "
            f"{differ[0][1]} in the file, {differ[0][2]} expected (None: absent)")

def load_transformer_file(args, dtype, quantization=None, device=None):
    """--transformer_file's transformer in `dtype` through diffusers' single-file loader (its converter, configured
    by the checkpoint's transformer/config.json), its tensors read one at a time (fp8 ones dequantised): host memory
    holds the transformer in `dtype` and one tensor as stored. device: where quantised weights go."""
    from diffusers import Flux2Transformer2DModel
    from huggingface_hub import hf_hub_download
    from safetensors import safe_open
    source, path = args.pretrained_model_name_or_path, local_file(args.transformer_file, args.cache_dir)
    config = source if Path(source).is_dir() else Path(hf_hub_download(
        source, "transformer/config.json", revision=args.revision, cache_dir=args.cache_dir)).parents[1]
    logger.info(f"loading the transformer from {args.transformer_file}", main_process_only=False)
    with safe_open(path, "pt") as f:
        state = file_tensors(set(f.keys()), f.get_tensor, dtype)
    return Flux2Transformer2DModel.from_single_file(state, config=str(config), subfolder="transformer",
                                                    torch_dtype=dtype, quantization_config=quantization, device=device)

def file_transformer(args, dtype):
    """A pipeline's from_pretrained keywords for --transformer_file's transformer (class images)."""
    return {"transformer": load_transformer_file(args, dtype)} if args.transformer_file else {}

def hashed(path, desc):
    """A file's SHA-256, with a progress bar (64 GB take about a minute)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=Path(path).stat().st_size, desc=desc, unit="B", unit_scale=True) as bar:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()

@option
class TransformerFile(Option):
    """The transformer from one .safetensors file in BFL's or ComfyUI's layout (BFL's flux2-dev.safetensors, ComfyUI's
    diffusion_models/ files, fine-tunes), or a Hub URL to one, through diffusers' single-file loader; everything else
    (VAE, text encoder, tokenizer, scheduler, family, the transformer's config) from --pretrained_model_name_or_path.
    Its tensors are checked against that config before anything loads; fp8 ones (ComfyUI's scaled too) load in the
    run's precision. Cost: a Hub file downloads before the checks; the file is read once more for its SHA-256, which
    config.yaml and the model card record."""

    name = "transformer_file"
    flags = [flag("--transformer_file", type=single_file, metavar="FILE", help="The transformer from this file (BFL "
                  "or ComfyUI layout, fp8 too); the rest from --pretrained_model_name_or_path.")]

    def check_model(self, model):
        """Its tensors, by the header alone, are those of `model` (the checkpoint's transformer, on the meta device)."""
        args = self.args
        name = f"--transformer_file {args.transformer_file}"
        try:
            header = safetensors_header(local_file(args.transformer_file, args.cache_dir))
        except Exception as e:  # noqa: BLE001 - unreadable, not safetensors, not on the Hub: the same advice
            raise UsageError(f"{name}: cannot read it ({type(e).__name__}: {e})") from None
        problem = file_problem(header, model)
        refuse(problem, f"{name}: {problem} (its config: --pretrained_model_name_or_path "
               f"{args.pretrained_model_name_or_path})")

    def resolved(self, seed, batches, accelerator):
        """Its SHA-256, for config.yaml and the model card (a Hub download's: its blob's name in the Hub cache)."""
        source = self.args.transformer_file
        path = Path(local_file(source, self.args.cache_dir)).resolve()
        if accelerator.is_main_process:
            hub = re.fullmatch(HUB_FILE, source) and re.fullmatch(r"[0-9a-f]{64}", path.name)
            vars(self.args)["transformer_sha256"] = path.name if hub else hashed(path, "Hashing the transformer file")

    def load_transformer(self, accelerator, weight_dtype):
        quantization = Hooks(self.args).first("quantization_config", weight_dtype)  # 4-bit weights go to the GPU
        return load_transformer_file(self.args, weight_dtype, quantization, quantization and accelerator.device)

    def card(self):
        args = self.args
        return ["", f"Trained on the transformer of `{args.transformer_file}` (SHA-256 `{args.transformer_sha256}`), "
                "a single file: give it to the pipeline as `transformer=Flux2Transformer2DModel.from_single_file("
                f"{args.transformer_file!r}, config={args.pretrained_model_name_or_path!r}, subfolder='transformer', "
                "torch_dtype=torch.bfloat16)`."]


# ----------------------------------------------------------------------------------------------------------------
# Option: block_swap (--blocks_to_swap)

@option
class BlockSwapping(Option):
    """The frozen weights of the last N blocks live in pinned host memory, each copied in just before it runs: a peak
    N - 2 blocks lower. Cost: their weights cross the bus once a forward and a backward (mostly hidden by compute)."""

    name = "block_swap"
    places_transformer = True  # the swapped blocks are placed once their LoRA exists
    flags = [flag("--blocks_to_swap", type=non_negative_int, default=0, help="Keep the frozen weights of the last "
                  "N blocks in host memory (CUDA, with --gradient_checkpointing).")]

    def check(self):
        refuse(not (torch.cuda.is_available() or vars(self.args).get("plan_only")), "--blocks_to_swap needs a CUDA "
               "GPU: it moves blocks between pinned host memory and the GPU")  # --plan_only: nothing moves here
        refuse(fsdp_requested(),  # option: fsdp
               "--blocks_to_swap does not work under FSDP, which already splits every block over "
               "the GPUs; use one or the other")
        refuse(not self.args.gradient_checkpointing, "--blocks_to_swap needs --gradient_checkpointing: without it "
               "autograd keeps every block's weights for the backward pass, so swapped blocks could not leave the GPU")

    def check_model(self, model):
        count, blocks = self.args.blocks_to_swap, len(transformer_blocks(model))
        refuse(count > blocks, f"--blocks_to_swap {count}: this transformer has {blocks} blocks "
               f"({model.config.num_layers} double-stream, {model.config.num_single_layers} single-stream)")

    def after_lora(self, transformer, accelerator):
        count = self.args.blocks_to_swap
        transformer.block_swapper = BlockSwapper(transformer, count, accelerator.device)
        logger.info(f"block swapping: the frozen weights of the last {count} of {len(transformer_blocks(transformer))} "
                    "blocks stay in pinned host memory; at most 2 of them are on the GPU at once")
        if not vars(self.args).get("bnb_quantization_config_path"):  # quantised weights are on the GPU already
            transformer.to(accelerator.device)  # the rest: embedders, the kept blocks, LoRA
        return transformer

class SwapSchedule:
    """Which swapped blocks have their frozen weights on the device, driven by the events of a pass. Blocks are
    numbered in execution order (double-stream, then single-stream); the last N swap. Each event returns actions:
    ("load", i) starts copying block i in (on a side stream), ("wait", i) holds compute until block i is in,
    ("evict", i) drops block i's device copy (the frozen weights never change, so nothing is copied back).

    Forward: block i+1 is copied while block i computes. Backward runs the blocks in reverse: the block the forward
    ended with stays for it, and block i-1 is copied while block i's backward (with gradient checkpointing, its
    recomputation included) runs. The first swapped block stays between passes, the next forward starts with it.
    So at most two swapped blocks are on the device at once."""

    def __init__(self, num_blocks, blocks_to_swap):
        self.swapped = range(num_blocks - blocks_to_swap, num_blocks)
        self.resident = set()  # swapped blocks on the device or on their way there
        self.backward_block = None  # whose backward runs now: a forward of this block is its recomputation

    def _bring(self, i, wait):
        if i not in self.swapped:
            return []
        actions = [] if i in self.resident else [("load", i)]
        self.resident.add(i)
        return actions + ([("wait", i)] if wait else [])

    def _drop(self, blocks):
        gone = sorted(blocks & self.resident)
        self.resident -= set(gone)
        return [("evict", i) for i in gone]

    def begin_pass(self):
        """The transformer's forward starts (a training step or a sampling step)."""
        self.backward_block = None
        first = self.swapped.start
        return self._drop(self.resident - {first}) + self._bring(first, wait=False)

    def before_block(self, i):
        if i == self.backward_block:  # gradient checkpointing recomputes block i inside its backward
            return self._bring(i, wait=True)
        return self._bring(i, wait=True) + self._bring(i + 1, wait=False)

    def after_block(self, i, training):
        if i == self.backward_block or i not in self.swapped or training and i == self.swapped[-1]:
            return []  # (the last swapped block: the backward pass starts with it)
        return self._drop({i})

    def before_backward(self, i):
        """Block i's backward is about to run, so every later block's backward has finished."""
        self.backward_block = i
        done = {j for j in self.resident if j > i and j != self.swapped.start}
        return self._drop(done) + self._bring(i, wait=True) + self._bring(i - 1, wait=False)

class BlockSwapper:
    """Carries out a SwapSchedule with module hooks, so the loop and the validation pipeline run unchanged. A swapped
    block's frozen parameters hold an empty tensor except while the schedule has them on the device; LoRA parameters
    stay put, so the optimizer never sees a swap. On a CPU (the tests) all but the side stream runs as on a GPU."""

    def __init__(self, transformer, blocks_to_swap, device):
        blocks = transformer_blocks(transformer)
        self.schedule = SwapSchedule(len(blocks), blocks_to_swap)
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.ready = {}  # block -> CUDA event recorded after its copy
        self.weights = {i: self.host_copies(blocks[i]) for i in self.schedule.swapped}
        transformer.register_forward_pre_hook(lambda module, args: self.carry_out(self.schedule.begin_pass()))
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, args, i=i: self.carry_out(self.schedule.before_block(i)))
            block.register_forward_hook(lambda module, args, output, i=i: self.after_block(i, output))

    def host_copies(self, block):
        """A block's frozen weights -> [(parameter, attribute, host copy, device slot)]. The host copies are views of
        one host buffer (pinned on CUDA): the pinned allocator rounds every allocation up to a power of two, +58% for
        [dev]'s 679 MB fused projection alone, under +10% for a whole block. The slot is the weight's device tensor,
        whose storage is emptied on eviction and refilled on loading: a view of it that a layer keeps for backward (a
        bitsandbytes matmul keeps its weight) then holds no memory and sees the weight again when it is back."""
        params = [(p, "data") for p in block.parameters() if not p.requires_grad]
        # torchao's int8 weights are a wrapper: their int8 data and scales move  # option: int8_weights
        params = [(p, n) for p, _ in params for n in getattr(p, "tensor_data_names", ["data"])]  # option: int8_weights
        tensors = [getattr(p, name) for p, name in params]
        sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]  # 64-byte aligned views
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=self.stream is not None)
        weights, offset = [], 0
        for (param, name), tensor, size in zip(params, tensors, sizes):
            host = buffer[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
            host.copy_(tensor)
            slot = torch.empty_like(host, device=self.device)
            slot.untyped_storage().resize_(0)
            weights.append((param, name, host, slot))
            setattr(param, name, torch.empty(0, dtype=tensor.dtype, device=self.device))
            offset += size
        return weights

    def after_block(self, i, output):
        tensors = output if isinstance(output, tuple) else (output,)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        self.carry_out(self.schedule.after_block(i, training))
        if not training:
            return None
        marked = _BeforeBackward.apply(self, i, *tensors)  # its backward runs just before block i's
        return marked if isinstance(output, tuple) else marked[0]

    def carry_out(self, actions):
        for action, i in actions:
            if action == "load":
                # The slots are refilled in the compute stream's order, so a load reuses the memory of the block
                # evicted last and at most two swapped blocks hold memory however far the host runs ahead; the copy
                # waits for the compute that last used that memory (queued up to the block before the one running).
                for *_, host, slot in self.weights[i]:
                    slot.untyped_storage().resize_(host.numel() * host.element_size())
                if self.stream is not None:
                    self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                    for param, name, host, slot in self.weights[i]:
                        setattr(param, name, slot.copy_(host, non_blocking=True))
                    if self.stream is not None:
                        self.ready[i] = self.stream.record_event()
            elif action == "wait" and i in self.ready:
                torch.cuda.current_stream(self.device).wait_event(self.ready.pop(i))
            elif action == "evict":
                self.ready.pop(i, None)
                for param, name, host, slot in self.weights[i]:
                    setattr(param, name, torch.empty(0, dtype=host.dtype, device=self.device))
                    slot.untyped_storage().resize_(0)

class _BeforeBackward(torch.autograd.Function):
    """Identity on a block's outputs whose backward tells the swapper that block's backward comes next."""

    @staticmethod
    def forward(ctx, swapper, i, *tensors):
        ctx.swapper, ctx.block = swapper, i
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.swapper.carry_out(ctx.swapper.schedule.before_backward(ctx.block))
        return (None, None, *grads)


# ----------------------------------------------------------------------------------------------------------------
# Option: attention (--attention_backend)

# diffusers attention backends with a backward pass (sage and the NPU/XLA/AMD kernels are inference or other hardware)
TRAINING_ATTENTION_BACKENDS = ("native", "_native_cudnn", "_native_flash", "_native_efficient", "_native_math", "flex",
                               "flash", "flash_hub", "_flash_3", "_flash_3_hub", "xformers")
# Backends seen to break a FLUX.2 training step; refused with the evidence, so no run dies mid-way.
BROKEN_ATTENTION_BACKENDS = {"_native_cudnn": "crashed FLUX.2 [klein] 4B training steps with 'CUDA error: an illegal "
                             "memory access' at 512 and 1024 px, eager and compiled (H100, torch 2.11 + CUDA 13.0, "
                             "2026-11-22); use native, which picks a working SDPA kernel itself"}

def attention_backend_problem(name):
    """Why --attention_backend `name` cannot train here (None: it can)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements
    if name not in TRAINING_ATTENTION_BACKENDS:
        known = {b.value for b in AttentionBackendName}
        return "no backward pass (inference only)" if name in known else "not a diffusers attention backend"
    if name in BROKEN_ATTENTION_BACKENDS:
        return BROKEN_ATTENTION_BACKENDS[name]
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except (RuntimeError, ValueError, ImportError) as e:
        return str(e)
    if name not in ("native", "_native_math") and not torch.cuda.is_available():
        return "needs a CUDA GPU" + (" (FlexAttention has no backward pass on the CPU)" if name == "flex" else "")
    return None

def check_attention_backend(name):
    problem = attention_backend_problem(name)
    if problem:
        usable = [b for b in TRAINING_ATTENTION_BACKENDS if attention_backend_problem(b) is None]
        raise UsageError(f"--attention_backend {name}: {problem}; usable here: {', '.join(usable)}")

@option
class AttentionBackends(Option):
    """Another attention kernel for training and validation than native SDPA (diffusers' attention dispatch). Cost:
    none of its own; docs/speed.md measures what each kernel gains."""

    words = ("attention backend",)
    name = "attention"
    usable = ", ".join(b for b in TRAINING_ATTENTION_BACKENDS if b not in BROKEN_ATTENTION_BACKENDS)
    flags = [flag("--attention_backend", default="native", help="Attention kernel (one whose package or GPU is "
                  "missing is refused).", type=Accepts(f"a diffusers attention backend with a backward pass that "
                  f"works here: {usable}", lambda v: v == "native" or check_attention_backend(v) is None))]

    def after_lora(self, transformer, accelerator):
        transformer.set_attention_backend(self.args.attention_backend)
        return transformer


# ----------------------------------------------------------------------------------------------------------------
# Option: compile (--compile, --do_fp8_training, --bnb_quantization_config_path, --use_8bit_adam)

def read_bnb_config(path):
    if path == "nf4":  # what --memory_plan auto chooses: 4-bit NormalFloat, as QLoRA
        return {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--bnb_quantization_config_path {path}: {e}") from None
    refuse(not isinstance(config, dict) or not (config.get("load_in_4bit") or config.get("load_in_8bit")),
           f"--bnb_quantization_config_path {path}: expected a JSON object with load_in_4bit or load_in_8bit")
    refuse(config.get("load_in_4bit") and config.get("load_in_8bit"), f"--bnb_quantization_config_path {path}: "
           "load_in_4bit and load_in_8bit are both true; diffusers' BitsAndBytesConfig takes one of them")
    return config

@option
class SpeedAndMemory(Option):
    """Levers of speed and memory: regional torch.compile, torchao float8 matmuls, a 4- or 8-bit frozen transformer
    (QLoRA, bitsandbytes) and bitsandbytes' 8-bit AdamW. Costs: a one-off compile; fp8 and NF4 change the
    numbers a little (NF4 costs dequantisation in every matmul); docs/speed.md and docs/memory.md measure them."""

    words = ("torch.compile", "8-bit Adam")
    name = "compile"
    flags = [
        flag("--compile", action="store_true", help="torch.compile the blocks: a one-off compile, then faster steps."),
        flag("--do_fp8_training", action="store_true", help="torchao float8 matmuls (CUDA, compute capability 8.9+)."),
        flag("--bnb_quantization_config_path", type=Accepts("nf4 or a readable JSON file", lambda v: v == "nf4"
                                                             or readable_file.ok(v)), help="A quantised frozen "
             "transformer (CUDA): nf4 (4-bit NormalFloat) or a bitsandbytes config's JSON, e.g. {\"load_in_8bit\": "
             "true}."),
        flag("--use_8bit_adam", action="store_true", help="bitsandbytes' 8-bit AdamW.")]

    @property  # read when placing: the memory plan may choose NF4 after --compile turned this option on
    def places_transformer(self):
        return bool(self.args.bnb_quantization_config_path)  # quantised weights load onto the GPU

    def check(self):
        args, cuda = self.args, torch.cuda.is_available()
        absent = not (cuda or vars(args).get("plan_only"))  # a GPU needed and none here (--plan_only trains nothing)
        if args.do_fp8_training and args.bnb_quantization_config_path:
            raise UsageError("--do_fp8_training and --bnb_quantization_config_path exclude each other")
        if args.do_fp8_training and (absent or cuda and torch.cuda.get_device_capability() < (8, 9)):
            raise UsageError("--do_fp8_training needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper)")
        if args.bnb_quantization_config_path:
            read_bnb_config(args.bnb_quantization_config_path)
            refuse(absent, "--bnb_quantization_config_path needs a CUDA GPU (bitsandbytes quantises on the GPU)")

    def notes(self):  # measured: docs/speed.md
        return ["--do_fp8_training without --compile: at [klein] 4B, batch 1, it made a step 2.1 to 2.3 times slower "
                "than bf16 on an H200; time a few steps of both before a long run"] if (
            self.args.do_fp8_training and not self.args.compile) else []

    def quantization_config(self, weight_dtype):
        """QLoRA: the frozen transformer in 4 or 8 bits (diffusers' BitsAndBytesConfig), the LoRA on top in float32."""
        if not self.args.bnb_quantization_config_path:
            return None
        from diffusers import BitsAndBytesConfig
        config = read_bnb_config(self.args.bnb_quantization_config_path)
        if config.get("load_in_4bit"):
            config.setdefault("bnb_4bit_compute_dtype", weight_dtype)
        return BitsAndBytesConfig(**config)

    def before_lora(self, transformer, accelerator):
        if self.args.bnb_quantization_config_path:
            from peft import prepare_model_for_kbit_training
            transformer = prepare_model_for_kbit_training(transformer, use_gradient_checkpointing=False)
        if self.args.do_fp8_training:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            # float8 matmuls need sides divisible by 16 (only linear layers reach the filter); proj_out keeps its dtype
            convert_to_float8_training(transformer, config=Float8LinearConfig(pad_inner_dim=True), module_filter_fn=(
                lambda m, name: name != "proj_out" and m.in_features % 16 == 0 and m.out_features % 16 == 0))
        return transformer

    def after_lora(self, transformer, accelerator):
        """--compile, regionally: the copies of a block class share one compiled graph (their weights are its inputs),
        so compiling costs seconds, not minutes; checkpointing and hooks wrap each block from outside. A second bucket
        shape recompiles once with dynamic shapes, which then serve every bucket."""
        if self.args.compile:
            blocks = transformer_blocks(transformer)
            for block in blocks:
                block.forward = torch.compile(block.forward, fullgraph=True)
            logger.info(f"--compile: {len(blocks)} blocks compile at their first use (the first step and the first "
                        "validation are slower; a second bucket shape compiles once more)")
        return transformer

    def optimizer(self, params, hyper):
        if not self.args.use_8bit_adam:
            return None
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, **hyper)


# ----------------------------------------------------------------------------------------------------------------
# Option: int8_weights (--transformer_quantization int8: the frozen transformer in 8 bits, torchao)

@option
class Int8Weights(Option):
    """The transformer's frozen linear weights in int8, a float32 scale a row (torchao's int8 weight-only through
    diffusers' TorchAoConfig, quantised on the CPU as they load), computing in the training dtype, under PEFT's torchao
    LoRA layers (float32). Cost: each layer converts its weight at every use, and autograd keeps that copy for the
    backward pass; a step ~10% slower than bf16 (estimated, not measured on a GPU); results change a little."""

    name = "int8_weights"
    flags = [flag("--transformer_quantization", choices=["none", "int8"], default="none", help="int8: the "
                  "transformer's frozen linear weights in 8 bits (torchao; any device), about half of bf16's.")]

    def check(self):
        args, this = self.args, "--transformer_quantization int8"
        for other in ("bnb_quantization_config_path", "do_fp8_training"):  # other weights or other matmuls
            refuse(vars(args).get(other), f"{this} and --{other} exclude each other")
        refuse(fsdp_requested(),  # option: fsdp
               f"{this} does not work under FSDP (its shards are not torchao tensors)")
        refuse(args.use_dora or args.adapter != "lora",  # option: adapters
               f"{this} trains a plain LoRA (DoRA, LoKr and LoHa on 8-bit weights are not verified here)")

    def quantization_config(self, weight_dtype):
        from diffusers import TorchAoConfig
        from torchao.quantization import Int8WeightOnlyConfig
        return TorchAoConfig(Int8WeightOnlyConfig())

    def after_lora(self, transformer, accelerator):  # DDP cannot broadcast torchao tensors; every process has them
        transformer._ddp_params_and_buffers_to_ignore = [n for n, p in transformer.named_parameters()
                                                         if not p.requires_grad]
        return transformer

    def card(self):
        return ["", "Trained on the transformer's linear weights in int8 (`--transformer_quantization int8`, torchao "
                "weight-only); the LoRA loads on the unquantised model as any other."]


# ----------------------------------------------------------------------------------------------------------------
# Option: hub (--push_to_hub: the LoRA, its images and card uploaded to a Hugging Face repository)

def hub_repo_id(value):
    from huggingface_hub.utils import validate_repo_id
    return validate_repo_id(value) is None  # the Hub's rules, checked here: raises ValueError on a name it refuses

@option
class Hub(Option):
    """At the end, the output folder (not its checkpoints, logs or what names this machine) goes to a Hub repository,
    made if missing; the model card's snippet then loads the LoRA from it. Cost: the upload, the only network use."""

    words = ("Hub repository", "upload")
    name = "hub"  # --hub_token also serves the remote text encoder, --hub_model_id alone names the card's repository
    flags = [flag("--push_to_hub", action="store_true", help="Upload the LoRA; the only flag using the network."),
             flag("--hub_model_id", type=Accepts("a Hub repository id (name or owner/name: letters, digits, -, _ "
                                                 "and ., no -- or ..)", hub_repo_id),
                  help="Hub repository; default: the name of --output_dir."),
             flag("--hub_token", help="Hub token (never logged or saved); prefer `hf auth login`.")]

    def check(self):
        args = self.args
        refuse(args.push_to_hub and args.hub_token and {"wandb", "all"} & set(args.report_to.split(",")),
               "--hub_token with --report_to wandb could leak the token; use `hf auth login` instead")

    def repository(self, finished):
        """The repository, made if missing (default: the output folder's name in the token's account); none when
        the run stopped early."""
        from huggingface_hub import create_repo
        args = self.args
        return create_repo(args.hub_model_id or Path(args.output_dir).name, exist_ok=True,
                           token=args.hub_token).repo_id if finished and args.push_to_hub else None

    def publish(self, repo_id):
        from huggingface_hub import upload_folder
        args = self.args
        if repo_id is None:
            return
        upload_folder(repo_id=repo_id, folder_path=args.output_dir, token=args.hub_token,
                      commit_message="DreamBooth LoRA",  # what names local paths or this machine stays
                      ignore_patterns=["checkpoint-*", "checkpoint-*/**", f"{args.logging_dir}/**", "config.yaml",
                                       RUN_LOCK, "validation/scored/**",
                                       MANIFEST_NAME,  # option: manifest
                                       ])
        logger.info(f"pushed to https://huggingface.co/{repo_id}")


# ----------------------------------------------------------------------------------------------------------------
# Option: validation_extras (--validation_prompts_file, --validation_lora_scales, --intermediate_inference_steps)

@functools.cache
def read_validation_prompts(path):
    """--validation_prompts_file -> [ValidationSpec]: a prompt a line (blank lines and lines starting with # are
    skipped), optionally ending in --size WxH (sides multiples of 16), --seed N, --steps N and --guidance X, in any
    order. UsageError naming the file and the line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--validation_prompts_file {path}: {e}") from None
    specs = []
    for number_, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        prompt, *options = re.split(r"\s+--", line.strip())
        found = {}
        for setting in options:
            m = re.fullmatch(r"size (?P<width>\d+)x(?P<height>\d+)|seed (?P<seed>\d+)|steps (?P<steps>[1-9]\d*)|"
                             r"guidance (?P<guidance>\d+(?:\.\d+)?)", setting.strip())
            refuse(m is None or any(not sides_ok(int(m[k])) for k in ("width", "height") if m[k])  # as --resolution
                   or (m["seed"] and int(m["seed"]) > 2**32 - 1),  # --seed's range
                   f"--validation_prompts_file {path}, line {number_}: --{setting.strip()}: expected --size WxH (sides "
                   "from 16 to 4096, multiples of 16), --seed N (0 to 4294967295), --steps N (N >= 1) or --guidance X")
            found.update({k: float(v) if k == "guidance" else int(v) for k, v in m.groupdict().items() if v})
        refuse(not prompt.strip() or prompt.startswith("--"),
               f"--validation_prompts_file {path}, line {number_}: no prompt before the options")
        specs.append(ValidationSpec(prompt.strip(), **found))
    refuse(not specs, f"--validation_prompts_file {path}: no prompt in it")
    return specs

@option
class ValidationExtras(Option):
    """More validation prompts (each with its own size, seed, steps, guidance) and the LoRA at several strengths:
    a row of the progress sheet per prompt and strength. Cost: their images at every validation. Or fewer: the
    LoRA's images before the final validation in fewer steps (the base model's and the final ones keep theirs)."""

    words = ("prompts file", "intermediate")
    name = "validation_extras"
    flags = [
        flag("--validation_prompts_file", type=Accepts("a readable text file of prompts (checked line by line)",
             lambda v: read_validation_prompts(v) is not None), help="More validation prompts, one a line, each "
             "optionally ending in --size WxH --seed N --steps N --guidance X."),
        flag("--validation_lora_scales", type=Accepts("comma-separated numbers >= 0", lambda v: all(
            math.isfinite(x) and x >= 0 for x in v), numbers), default="1",
             help="The LoRA's strengths each validation shows, e.g. 0.5,1,1.5."),
        flag("--intermediate_inference_steps", type=positive_int, help="At most N denoising steps for the LoRA's "
             "images before the final validation (cheaper previews); default: as the final's.")]

    def check(self):  # option: metrics
        scored = vars(self.args).get("validation_metrics", "none") != "none"
        refuse(self.args.intermediate_inference_steps and scored,
               "--intermediate_inference_steps with --validation_metrics: the scores would compare images sampled in "
               "different numbers of steps (the base model's and the final ones keep theirs)")

    def validation_steps(self, steps, tag):
        return min(steps, self.args.intermediate_inference_steps or steps) if tag != "final" else steps

    def validation_specs(self):
        return read_validation_prompts(self.args.validation_prompts_file) if self.args.validation_prompts_file else []

    def validation_scales(self):
        return self.args.validation_lora_scales

    @contextlib.contextmanager
    def lora_strength(self, model, scale):
        """Every adapter layer's scaling times `scale` inside the block, then restored exactly (dividing back could
        leave a rounding error in the scale training goes on with); 0 switches the adapters off."""
        from peft.tuners.tuners_utils import BaseTunerLayer
        if scale == 0:
            with adapters_off(model):
                yield
            return
        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and hasattr(m, "scaling")]
        saved = [dict(m.scaling) for m in layers]
        for layer in layers:
            layer.scaling.update({k: v * scale for k, v in layer.scaling.items()})
        try:
            yield
        finally:
            for layer, scaling in zip(layers, saved):
                layer.scaling.update(scaling)


# ----------------------------------------------------------------------------------------------------------------
# Option: validation_transformer (--validation_transformer: validation on another transformer, e.g. distilled [klein])

def model_json(source, name, cache_dir):
    """A small JSON file of a folder or a Hub model -> dict, or None where it has no such file (other failures,
    such as an unreachable Hub or an offline one without it: raised)."""
    if Path(source).is_dir():
        return json.loads(Path(source, name).read_text()) if Path(source, name).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError
    try:
        return json.loads(Path(hf_hub_download(source, name, cache_dir=cache_dir)).read_text())
    except RemoteEntryNotFoundError:
        return None

@option
class ValidationTransformer(Option):
    """Validation (the base model's images too) on another transformer of the same shape holding the LoRA being
    trained: for a [klein] base run, the distilled [klein] most users deploy a base-trained LoRA on, at its 4 steps
    without guidance (about 25 times less sampling than the base pipeline's 50 steps with CFG). Loaded once, with the
    same adapter; the weights validation shows (an EMA's average where one is kept) are copied in at each validation.
    Cost: its weights in host memory for the whole run (8 GB for [klein] 4B in bf16: loading them again at each
    validation would take longer than the copy), on the GPU beside the trained transformer only while it validates."""

    words = ("validation transformer",)
    name = "validation_transformer"
    flags = [flag("--validation_transformer", type=model_source, metavar="MODEL", help="Validate on this "
                  "transformer with the LoRA: a FLUX.2 checkpoint, sampled as its pipeline does (distilled [klein]: 4 "
                  "steps, no guidance) or in --validation_inference_steps, or a folder of a distilled [klein] "
                  "transformer alone.")]

    def check(self):
        refuse(fsdp_requested(),  # option: fsdp
               "--validation_transformer is not supported under FSDP (every process validates, "
               "so each would hold all of it)")
        self.steps = self.args.validation_inference_steps  # the user's, if given (the family's default comes later)

    def resolve(self, family):
        self.family = family  # the run's

    def check_model(self, model):
        """It is a FLUX.2 checkpoint or transformer whose layers are those of the one trained (`model`, on the meta
        device), so the LoRA fits; read from its config files, no weights."""
        from accelerate import init_empty_weights
        from diffusers import Flux2Transformer2DModel
        source, cache_dir = self.args.validation_transformer, self.args.cache_dir
        name = f"--validation_transformer {source}"
        try:
            index = model_json(source, "model_index.json", cache_dir)
            config = model_json(source, "transformer/config.json" if index else "config.json", cache_dir)
        except Exception as e:  # noqa: BLE001 - unreachable, not JSON: the same advice
            raise UsageError(f"{name}: cannot read it ({e})") from None
        refuse(index is not None and index.get("_class_name") not in FAMILIES, f"{name} is a "
               f"{(index or {}).get('_class_name')}; expected a FLUX.2 checkpoint ({', '.join(FAMILIES)})")
        refuse((config or {}).get("_class_name") != "Flux2Transformer2DModel", f"{name}: expected a FLUX.2 checkpoint "
               "(model_index.json, transformer/) or a Flux2Transformer2DModel folder (config.json)")
        refuse(index is None and self.family.pipeline != "Flux2KleinPipeline", f"{name}: a transformer folder alone "
               f"is taken as a distilled [klein]; this run trains {self.family.name} (name its checkpoint instead)")
        with init_empty_weights():
            other = Flux2Transformer2DModel.from_config(config)
        shapes = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()}  # noqa: E731
        refuse(shapes(other) != shapes(model), f"{name}: its layers differ from those of "
               f"{self.args.pretrained_model_name_or_path}'s transformer, so the LoRA trained on it does not fit")
        self.subfolder = "transformer" if index else None
        self.family = (dataclasses.replace(FAMILIES[index["_class_name"]], distilled=bool(index.get("is_distilled")))
                       if index else dataclasses.replace(self.family, distilled=True))

    def setup(self, run):
        """Load it on the CPU, where it waits between validations, with the trained transformer's adapter (main
        process only: the others never validate)."""
        from accelerate import PartialState
        from accelerate.utils import extract_model_from_parallel
        from diffusers import Flux2Transformer2DModel
        args, self.run, self.sampler, self.params = self.args, run, None, {}
        if not PartialState().is_main_process:
            return
        model = Flux2Transformer2DModel.from_pretrained(args.validation_transformer, subfolder=self.subfolder,
                                                        torch_dtype=run.weight_dtype, cache_dir=args.cache_dir)
        add_lora(model, dataclasses.replace(extract_model_from_parallel(run.transformer).peft_config["default"]))
        self.params = {n: p for n, p in model.named_parameters() if n in run.named_params}
        if self.params.keys() != run.named_params.keys():
            raise TrainingStopped(f"--validation_transformer {args.validation_transformer}: the LoRA's layers do not "
                                  "all match its own")
        self.sampler = (model.requires_grad_(False).eval(), self.family, self._sampling_steps())
        logger.info(f"validation on {args.validation_transformer} ({self.family.name}"
                    f"{', distilled' if self.family.distilled else ''}: {self.sampler[2]} steps)")

    def validation_model(self, sampler):
        return self.sampler or sampler

    @contextlib.contextmanager
    def validation_weights(self):
        """The weights being trained copied in (inside an earlier option's context: its weights)."""
        for name, param in self.params.items():
            param.detach().copy_(self.run.named_params[name].detach())
        yield

    def card(self):
        family = self.family
        return ["", f"The validation images were made on {self.args.validation_transformer} ({family.name}"
                f"{', distilled' if family.distilled else ''}, {self._sampling_steps()} steps) with this LoRA."]

    def _sampling_steps(self):
        """--validation_inference_steps if given, else as the transformer's pipeline samples (distilled: 4)."""
        return getattr(self, "steps", None) or default_sampling_steps(self.family)

# ----------------------------------------------------------------------------------------------------------------
# Option: memory_plan (--memory_plan auto: the fastest settings that fit this GPU; --plan_only, --gpu_memory)

GIB = 2**30
PLAN_MARGIN = (1.1, 1.5 * GIB)  # a peak fits a card when peak x 1.1 + 1.5 GiB (fragmentation, CUDA context) fits
FITS = f"a peak fits when peak x {PLAN_MARGIN[0]} + {PLAN_MARGIN[1] / GIB:.1f} GiB does"
QUANT_BYTES = {"nf4": 0.5 + 4 / 64, "int8": 1.0 + 2 / 1024}  # a weight: 4 bits + a float32 scale per 64; a byte
QUANT_BYTES["llm.int8"] = QUANT_BYTES["int8"]  # bitsandbytes' 8-bit (a file given)  # option: compile
# NF4 [klein] 4B peaked 0.8 GiB above what its weights, LoRA and activations explain (H200, 2026-11-26, with and
# without swapping); until a GPU explains it (bitsandbytes does not quantise on a CPU), NF4 activations count 1.4x
NF4_ACTIVATIONS = 1.4
# Step time against bf16 with checkpointing ([klein] 4B, 1024 px, batch 1, H200, docs/speed.md): no checkpointing
# 0.243 / 0.342 s; 24 of 25 blocks swapped 0.368 (the cost grows with the share swapped); NF4 0.422
STEP_COST = {"no_checkpointing": 0.71, "all_swapped": 0.08, "nf4": 1.23}
# torchao's int8 converts each weight at each use: 3 bytes a weight to ~8,000 flops at 1024 px  # option: int8_weights
STEP_COST["int8"] = 1.10  # estimated, not measured on a GPU yet  # option: int8_weights
# Compiled, the same run: 4 images a step 0.93 s, 1.41 eager, the same memory  # option: compile
# (after a 28.6 s first step, a first validation 7 s longer: from ~70 steps)  # option: compile
COMPILE = {"FLUX.2 [klein]": dict(image_s=1.41 / 4, step=0.93 / 1.41,  # not [dev]  # option: compile
                                  once=28.6 - 1.41, validation=7.0)}  # option: compile
CARD_SIZES = (16, 24, 32, 48, 80, 96, 141, 192)  # GB: the cards a refusal may name
TEXT_ACTIVATIONS = GIB  # while prompts are encoded: every layer's hidden states ([dev]: 41 x 512 x 5,120, 0.2 GB each)

def memory_size(text):
    """'24GB', '24GiB', '24' (GiB) or '24564MiB' (as nvidia-smi prints an RTX 4090's 24 GB) -> bytes: a card sold as
    N GB holds about N GiB. Not a size: a TypeError, which argparse reports as one."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?) ?(GB|GiB|G|MiB)?", text.strip(), re.IGNORECASE)
    return int(float(m[1]) * (2**20 if (m[2] or "").lower() == "mib" else GIB))

def size_text(size):
    """memory_size's inverse (config.yaml): bytes / 2^30 in decimal has at most 30 places, so this one is exact."""
    return f"{size / GIB:.30f}".rstrip("0").rstrip(".") + "GiB"

def fits_card(peak, card):
    return peak * PLAN_MARGIN[0] + PLAN_MARGIN[1] <= card

def gib(n):
    return f"{n / GIB:.1f}"

def peak_bytes(run):
    """The most bytes of tensors run() makes alive at once (views and in-place results add nothing): a dispatch mode
    sees every operator, those inside composite ones too (torch documents such modes with this import)."""
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    live = [0, 0]  # bytes alive now, the most at once

    class Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            fresh = all(r.alias_info is None for r in func._schema.returns)  # not a view nor an in-place result
            for t in [t for t in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(t) and fresh]:
                live[0] += (size := t.numel() * t.element_size())
                live[1] = max(live)
                weakref.finalize(t, lambda n=size: live.__setitem__(0, live[0] - n))  # not over t: it would stay
            return out

    with Live():
        run()
    return live[1]

class FusedAttention(torch.autograd.Function):
    """Shapes only: what a fused attention kernel saves for backward (q, k, v, output, a float32 log-sum-exp a query),
    not the [B, heads, N, N] matrix of the math path the meta device would take (4 GB a block at 1024 px)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out  # no backward: nothing runs one

@contextlib.contextmanager
def shapes_only():
    """Tensors on the meta device, attention as a fused kernel."""
    import unittest.mock
    fused = lambda query, key, value, **_: FusedAttention.apply(query, key, value)  # noqa: E731
    with torch.device("meta"), unittest.mock.patch("torch.nn.functional.scaled_dot_product_attention", fused):
        yield

def forward_inputs(transformer, batch, image_tokens, text_tokens):
    """Empty transformer inputs of these shapes, in its frozen weights' dtype (on the meta device: shapes_only)."""
    config, dtype = transformer.config, next(p.dtype for p in transformer.parameters() if not p.requires_grad)
    return dict(hidden_states=torch.empty(batch, image_tokens, config["in_channels"], dtype=dtype),
                encoder_hidden_states=torch.empty(batch, text_tokens, config["joint_attention_dim"], dtype=dtype),
                timestep=torch.empty(batch), img_ids=torch.empty(batch, image_tokens, 4, dtype=torch.long),
                txt_ids=torch.empty(batch, text_tokens, 4, dtype=torch.long),
                guidance=torch.empty(batch) if config["guidance_embeds"] else None, return_dict=False)

def saved_bytes(transformer, batch, image_tokens, text_tokens):
    """One training forward on the meta device (LoRA in the frozen dtype, as autocast runs it), recording what autograd
    saves -> (bytes saved outside the blocks, each block's input, each block's saved): views in their base's."""
    blocks = transformer_blocks(transformer)
    dtype = next(p.dtype for p in transformer.parameters() if not p.requires_grad)
    for p in transformer.parameters():
        p.data = p.data.to(dtype) if p.requires_grad else p.data
    saved, inputs, outside, current, seen = [0] * len(blocks), [0] * len(blocks), [0], [None], set()

    def pack(t):
        base = t if t._base is None else t._base
        if not isinstance(base, torch.nn.Parameter) and id(base) not in seen:
            seen.add(id(base))
            (outside if current[0] is None else saved)[current[0] or 0] += base.numel() * base.element_size()
        return t

    def enter(block, args, kwargs):  # the hidden states; rotary tables and temb are shared, counted outside
        current[0] = blocks.index(block)
        inputs[current[0]] = sum(t.numel() * t.element_size() for t in (*args, *kwargs.values())
                                 if isinstance(t, torch.Tensor) and t.dim() == 3)

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter, with_kwargs=True),
                                         b.register_forward_hook(lambda *_: current.__setitem__(0, None)))]
    with shapes_only(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        transformer(**forward_inputs(transformer, batch, image_tokens, text_tokens))
    for h in hooks:
        h.remove()
    return outside[0], inputs, saved

def weight_bytes(transformer, swap=0, quant=None):
    """-> (frozen weights on the GPU, pinned host bytes, LoRA: weight, gradient, two AdamW moments in float32).
    Quantised: the 2-D weights (NF4's scales stay on the GPU when a block swaps), the rest float32 (PEFT's k-bit).
    At the backward's start two swapped blocks are resident (H200: within 4%, 12 and 24 of [klein] 4B's 25 swapped)."""
    rest = 4 if quant else None
    rest = None if quant == "int8" else rest  # torchao's int8 leaves the rest in its dtype  # option: int8_weights

    def frozen(module):
        return sum(p.numel() * (QUANT_BYTES[quant] if quant and p.dim() == 2 else rest or p.element_size())
                   for p in module.parameters() if not p.requires_grad)

    def scales(block):  # NF4's: a float32 a 64 weights
        return sum(p.numel() / 16 for p in block.parameters() if not p.requires_grad and p.ndim == 2) * (quant == "nf4")

    blocks = transformer_blocks(transformer)
    swapped = [frozen(b) - scales(b) for b in blocks[len(blocks) - swap:]]  # what leaves the GPU
    lora = 16 * sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    return frozen(transformer) - sum(swapped) + sum(swapped[-2:]), sum(swapped), lora

class MemoryEstimate:
    """A run's peak GPU memory at any setting the plan chooses, from shapes on the meta device: weights (swapped and
    quantised counted exactly), LoRA, one forward's activations, validation's (one image sampled, then decoded in
    float32, as measured; and `images` in one pipeline call, --validation_batch's). Checked on H100 and H200 runs:
    docs/memory.md. side: latents' (height, width), or one."""

    def __init__(self, transformer, vae, batch, image_tokens, text_tokens, side, validates=True, cached=True,
                 images=1):
        height, width = side if isinstance(side, tuple) else (side, side)
        self.transformer, self.blocks, self.validates, self.cached = (transformer, transformer_blocks(transformer),
                                                                      validates, cached)
        self.images = batch * image_tokens / 4096  # a micro-step's work: 1024 px images' tokens, 4,096 each
        self.outside, self.inputs, self.saved = saved_bytes(transformer, batch, image_tokens, text_tokens)
        self.vae = 0 if vae is None else sum(p.numel() for p in vae.parameters()) * 2
        self.unquantised = sum(p.numel() * p.element_size() for p in transformer.parameters())
        linears = [[p.nbytes for p in b.parameters() if p.ndim == 2 and not p.requires_grad]  # option: int8_weights
                   for b in self.blocks]  # each block's linear weights
        self.copies, self.largest = list(map(sum, linears)), max(map(max, linears)) * validates  # option: int8_weights
        self.weights = {}  # (swap, quant) -> weight_bytes: 50 ms each on [dev]'s shapes, and a plan asks hundreds
        self.decode = self.encode = 0
        self.file = 0  # option: transformer_file (its largest tensor's bytes: a file loads whole, then one such)
        self.per_call, self.calls = images, dict.fromkeys((1, images), 0)  # images in one call -> the call's peak
        with shapes_only(), torch.no_grad():
            for n in self.calls if validates else ():  # [klein]'s CFG is a second forward, not a batch of 2n
                sampling = peak_bytes(lambda n=n: transformer(**forward_inputs(transformer, n, image_tokens,
                                                                                text_tokens)))
                decode = 0 if vae is None else peak_bytes(  # the pipeline decodes the call's images at once
                    lambda n=n: vae.decode(torch.empty(n, vae.config.latent_channels, height, width)))
                self.calls[n] = max(sampling, decode)
                self.decode = decode if n == 1 else self.decode  # one image's (the tests size it by bucket)
            if vae is not None and not cached:  # latents encoded at every step: the VAE stays on the GPU
                self.encode = peak_bytes(lambda: vae.encode(torch.empty(batch, 3, height * 8, width * 8)))

    def peak(self, checkpointing, swap=0, quant=None):
        """-> {weights, host (pinned), load (host RAM to load unquantised weights), lora, activations, training,
        validation, peak, peak_one (validation's images one at a time)} in bytes. Checkpointing keeps what is saved
        outside the blocks, each block's input and twice the largest block's saved (one recomputed, its gradients);
        without, all saved and one block's in flight."""
        if (swap, quant) not in self.weights:
            self.weights[swap, quant] = weight_bytes(self.transformer, swap, quant)
        weights, host, lora = self.weights[swap, quant]
        kept = sum(self.inputs) + 2 * max(self.saved) if checkpointing else sum(self.saved) + max(self.saved)
        activations = (self.outside + kept) * (NF4_ACTIVATIONS if quant == "nf4" else 1)
        # torchao's int8: autograd keeps each layer's weight converted to the compute dtype for the backward pass
        if quant == "int8":  # (with checkpointing: the recomputed block's)  # option: int8_weights
            activations += max(self.copies) if checkpointing else sum(self.copies)
        training = weights + lora + (0 if self.cached else self.vae) + max(activations, self.encode)
        validation = (weights + lora + self.vae) * self.validates + self.calls[self.per_call]
        one = (weights + lora + self.vae) * self.validates + self.calls[1]  # validation's images one at a time
        load = 0 if quant else self.unquantised
        # sampling converts one layer's weight at a time ([dev]'s largest: 0.7 GB); loading quantises on the CPU
        if quant == "int8":  # option: int8_weights
            validation, one, load = validation + self.largest, one + self.largest, weights + host
        load = self.unquantised + self.file if self.file else load  # option: transformer_file (quantised too)
        return dict(weights=weights, host=host, load=load, lora=lora, activations=activations, training=training,
                    validation=validation, peak=max(training, validation), peak_one=max(training, one))

def text_encoder_peak(params, kept, quant, element_size=2):
    """quant (None or 'none', 'int8', 'nf4') -> (GPU peak while prompts are encoded: the weights, embeddings and output
    layer unquantised as bitsandbytes keeps them, and the hidden states; host RAM: bf16 and int8 load whole first)."""
    gpu = kept * element_size + (params - kept) * QUANT_BYTES.get(quant, element_size) + TEXT_ACTIVATIONS
    return gpu, 0 if quant == "nf4" else params * element_size

# A candidate: frozen weights (quant: None, 'nf4', 'int8'; weights: the flag's value, a file given kept), checkpointing,
# the fewest swapped blocks that fit (None: none does), GPU peak, host RAM (pinned blocks, or loading), step cost
PlanRow = collections.namedtuple("PlanRow", "quant checkpointing swap peak host cost weights compiled one_at_a_time",
                                 defaults=[None, False, False])

def plan_choices(args, cuda, blocks):
    """What the plan may try, one line an option, a flag given keeping its value: checkpointing, swapped blocks (fewest
    first), weights ({what loads: the flag's value}, a 4-bit file as NF4), the text encoder's precisions (none without
    one). Swapping and NF4 need CUDA (or --plan_only's GPU elsewhere) and a plain LoRA (other adapters: unverified)."""
    free, lora, texts = vars(args).keys() - args.given_flags, True, ["none"]
    lora = args.adapter == "lora" and not args.use_dora  # option: adapters
    plain = cuda and lora
    gc = (False, True) if "gradient_checkpointing" in free else (args.gradient_checkpointing,)
    choices = dict(checkpointing=gc, swap=(0,), weights={None: None}, compile=(vars(args).get("compile", False),))
    choices["one_at_a_time"] = (False, True) if "validation_batch" in free else (False,)  # validation's images
    choices["swap"] = range(blocks + 1) if "blocks_to_swap" in free and plain else (  # option: block_swap
        args.blocks_to_swap,)  # option: block_swap
    bnb = args.bnb_quantization_config_path  # option: compile
    four = bnb and read_bnb_config(bnb).get("load_in_4bit")  # option: compile
    choices["weights"] = {bnb and ("nf4" if four else "llm.int8"): bnb}  # option: compile
    if "bnb_quantization_config_path" in free and plain and not args.do_fp8_training:  # option: compile
        choices["weights"] = {None: None, "nf4": "nf4"}  # option: compile
    if args.transformer_quantization == "int8":  # torchao's 8-bit weights: on any device  # option: int8_weights
        choices["weights"] = {"int8": None}
    elif "transformer_quantization" in free and None in choices["weights"] and lora and not vars(args).get(
            "do_fp8_training"):  # option: int8_weights
        choices["weights"] = {None: None, "int8": None, **choices["weights"]}
    if "compile" in free and cuda:  # option: compile
        choices["compile"] = (False, True)  # option: compile
    if args.output_preservation:  # option: trigger_words
        choices["compile"] = (False,)  # it refuses compiling  # option: trigger_words
    texts = [args.text_encoder_quantization] if "text_encoder_quantization" not in free else [  # option: text_encoders
        "none", "int8", "nf4"][:2 + cuda]  # option: text_encoders
    texts = [] if args.remote_text_encoder or args.fsdp_text_encoder else texts  # option: text_encoders
    texts = [] if args.from_manifest else texts  # option: manifest
    return dict(choices, texts=texts)

def plan_settings(row, text):
    """The flags a plan sets, {flag: value}: its row's and the text encoder's precision."""
    settings = dict(gradient_checkpointing=row.checkpointing)
    settings["blocks_to_swap"] = row.swap  # option: block_swap
    settings["bnb_quantization_config_path"] = row.weights  # option: compile
    settings["transformer_quantization"] = "int8" if row.quant == "int8" else "none"  # option: int8_weights
    settings["compile"] = row.compiled  # option: compile
    settings["text_encoder_quantization"] = text or "none"  # option: text_encoders
    if row.one_at_a_time:  # a prompt's validation images in one call would not fit
        settings["validation_batch"] = 1
    return settings

def plan_flags(row, text=None):
    """A plan's flags as the command line takes them (a switch off, 0, None and 'none' are defaults: left out)."""
    return " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in plan_settings(row, text).items()
                    if v not in (False, None, 0, "none"))

def plan_rows(estimate, card, host_free, choices, compiled=None):
    """Each setting of `choices` with the fewest swapped blocks (with checkpointing: autograd keeps weights) that
    fit `card` and host_free (bytes) -> [PlanRow]; the plan takes unquantised first (quantising changes results).
    compiled(eager cost) -> the cost compiled, its first compile spread over the run (None: not measured); the plan
    tries compiling where it was measured (unquantised, no block swapped: the same memory as eager)."""
    rows, blocks, trying = [], len(estimate.blocks), len(choices["compile"]) > 1
    for c, (quant, weights), gc in [(c, w, gc) for c in choices["compile"] for w in choices["weights"].items()
                                    for gc in choices["checkpointing"]]:
        if c and trying and (quant or not compiled):  # measured unquantised only
            continue
        for n in choices["swap"] if gc and not (c and trying) else [0]:
            found = estimate.peak(gc, n, quant)
            host = max(found["host"], found["load"])  # a validation batch that does not fit: one image a call
            one = True in choices["one_at_a_time"] and not fits_card(found["peak"], card)
            peak = found["peak_one" if one else "peak"]
            if fits_card(peak, card) and host <= host_free:
                cost = ((1.0 if gc else STEP_COST["no_checkpointing"]) * (1 + STEP_COST["all_swapped"] * n / blocks)
                        * (STEP_COST.get(quant, STEP_COST["nf4"]) if quant else 1.0))
                rows.append(PlanRow(quant, gc, n, peak, host, compiled(cost) if c and compiled else cost, weights, c,
                                    one))
                break
        else:
            rows.append(PlanRow(quant, gc, None, peak, host, math.inf, weights, c, one))
    return rows

@option
class MemoryPlan(Option):
    """--memory_plan auto: before any weights load, the run's peak GPU memory is estimated from the checkpoint's
    configs (MemoryEstimate) for each setting left at its default (checkpointing, swapped blocks, NF4, the text
    encoder's precision); the fastest that fits the card (the least free over the processes; --gpu_memory) and host
    RAM is taken. Cost: a few seconds at start-up, none per step; --plan_only shows every candidate and stops."""

    words = ("memory plan",)
    name, switches, requires = "memory_plan", ("memory_plan",), "--memory_plan auto"
    prints_only = property(lambda self: self.args.plan_only)
    flags = [
        flag("--memory_plan", choices=["off", "auto"], default="off", help="auto: checkpointing, block swapping, NF4 "
             "weights and the text encoder's precision chosen to fit this GPU, fastest first; your flags stay."),
        flag("--gpu_memory", type=Accepts("a size up to 1024 GiB, e.g. 24GB or 24564MiB (a bare number is read in "
                                          "GiB)", lambda v: 0 < v <= 1024 * GIB, memory_size, size_text),
             help="Plan for a card of this size instead of this machine's free GPU memory."),
        flag("--host_memory", type=Accepts("a size in GB or GiB, e.g. 64GB", lambda v: v > 0, memory_size, size_text),
             help="Plan for this much free host RAM (swapped blocks' pinned memory); default: what is free here."),
        flag("--plan_only", action="store_true", help="Print the plan (every candidate, its estimated peak) and stop.")]

    def check(self):
        refuse(fsdp_requested(),  # option: fsdp
               "--memory_plan auto plans one GPU's memory; under FSDP each process holds a shard: "
               "set the memory flags yourself")
        refuse(self.args.plan_only and self.args.gpu_memory is None and not torch.cuda.is_available(),
               "--plan_only: no GPU here; give --gpu_memory, the size of the card to plan for")

    def plan_memory(self, family, instances):
        """Sets the plan's flags -> whether it planned (not without a GPU or --gpu_memory)."""
        from accelerate import PartialState
        args, cuda = self.args, torch.cuda.is_available()
        card = args.gpu_memory or (agreed_minimum(torch.cuda.mem_get_info()[0]) if cuda else None)
        if card is None:
            logger.info("--memory_plan auto: no GPU here and no --gpu_memory: the flags stay as given")
            return False
        dtype = DTYPES.get(args.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION"), torch.float32)
        text_size = text_encoder_size(args, family) if plan_choices(args, True, 0)["texts"] else (0, 0)
        host = args.host_memory or agreed_minimum(available_host_memory())  # each machine's free RAM: one plan
        steps = args.max_train_steps or optimizer_steps(args.num_train_epochs, check_batches_early(  # an epoch's
            args, instances, 0, PartialState().num_processes, 0), args.gradient_accumulation_steps)  # (+ class images)
        report, chosen, text = make_plan(args, family.name, card, host, run_estimate(args, dtype, instances),
                                         text_size, dtype, steps)
        if (args.plan_only or chosen is None) and PartialState().is_main_process:  # a refusal's candidates show why
            print("\n".join(report if chosen else report[:-1]))
        refuse(chosen is None, f"--memory_plan auto: {report[-1]}")
        if args.plan_only:  # what the plan is, for a card of --gpu_memory, and nothing else
            raise SystemExit(0)
        logger.info("\n".join([report[0], *report[-2:]]))
        vars(args).update(plan_settings(chosen, text))
        return True

def make_plan(args, model, card, host, estimate, text_size, dtype, steps=None):
    """The plan for `card` bytes of GPU memory and `host` of free host RAM from the run's MemoryEstimate, its text
    encoder's (parameters, unquantised ones), weights in `dtype`, its optimizer steps (default --max_train_steps) ->
    (report lines, the PlanRow, the text encoder's precision or None without one); nothing fits: (lines ending in
    the refusal, None, None). Makes README's table."""
    from accelerate import PartialState
    precision, processes = {v: k for k, v in DTYPES.items()}[dtype], local_processes(PartialState())
    host_free = 0.8 * host / processes  # each process here pins its swapped blocks; the rest of it needs some too
    steps, compiled, note = steps or args.max_train_steps or 0, None, []
    if (m := COMPILE.get(model)) and steps:  # compiling: once, then a shorter step  # option: compile
        eager = m["image_s"] * estimate.images * args.gradient_accumulation_steps  # option: compile
        once = m["once"] + m["validation"] * estimate.validates  # option: compile
        gain = eager * (1 - m["step"])  # seconds a step, with checkpointing  # option: compile
        compiled = lambda cost: cost * m["step"] + once / steps / eager  # option: compile
        note = [f"  compiled: {once:.0f} s once, {gain:.2f} s less a step: it pays "  # option: compile
                f"from {math.ceil(once / gain)} steps; this run trains {steps}"]  # option: compile

    def plan(card, cuda, texts=None):  # -> (rows, the row taken or None, text rows, the precision taken or None)
        choices = plan_choices(args, cuda, len(estimate.blocks))
        rows = plan_rows(estimate, card, host_free, choices, compiled)
        texts = [(q, *text_encoder_peak(*text_size, q, dtype.itemsize)) for q in texts or choices["texts"]]
        best = min((r for r in rows if r.swap is not None), key=lambda r: (r.quant is not None, r.cost), default=None)
        return rows, best, texts, next((q for q, gpu, ram in texts if fits_card(gpu, card) and ram <= host_free), None)

    rows, chosen, texts, text = plan(card, torch.cuda.is_available() or args.plan_only)
    report = plan_report(args, model, card, host, rows, chosen, texts, text, precision, note)
    if chosen is not None and (text or not texts):
        return report, chosen, text
    ram = f"{gib(host_free)} GiB of host RAM (80% of the free{f', shared by {processes} processes' * (processes > 1)})"
    return report + [refusal(plan, card, precision, ram, model == FAMILIES["Flux2Pipeline"].name)], None, None

def refusal(plan, card, precision, ram, dev):
    """Nothing fits `card` -> why, as on a machine with CUDA (make_plan's `plan`): the margin, what does not fit and
    what avoids it, the smallest card of CARD_SIZES a plan fits. dev: [dev], whose prompts may be encoded remotely."""
    (rows, row, texts, text), why = plan(card, True), []
    if row is None:  # its least GPU peak fits: host RAM is what is short
        frugal = min(r.peak for r in rows)
        why.append(f"training needs more than the plan's {ram} where it fits the GPU" if fits_card(frugal, card)
                   else f"training peaks at {gib(frugal)} GiB at the least")
    if texts and text is None:
        q, peak, need = min(texts, key=lambda r: r[1])
        q = precision if q == "none" else q
        why.append(f"the text encoder ({q}) needs {gib(need)} GiB of host RAM to load, more than the plan's {ram}"
                   if fits_card(peak, card) else f"the text encoder peaks at {gib(peak)} GiB ({q}) while prompts are "
                   "encoded")
        if smaller := plan(card, True, ["none", "int8", "nf4"])[3]:  # option: text_encoders
            why.append(f"--text_encoder_quantization {smaller} fits")  # option: text_encoders
        fits = f", and training fits with {plan_flags(row) or 'no flag added'}" if row else ""  # option: text_encoders
        if dev:  # option: text_encoders
            why.append("--remote_text_encoder (Hugging Face's endpoint encodes the prompts) "  # option: text_encoders
                       f"needs none here{fits}")  # option: text_encoders
    for size in CARD_SIZES:
        _, fit, texts, text = plan(size * GIB, True)
        if fit is not None and (text or not texts):
            why.append(f"the smallest card that fits is {size} GB, with {plan_flags(fit, text) or 'these flags'}")
            break
    else:
        why.append(f"nor does any card up to {CARD_SIZES[-1]} GB with the plan's {ram}")
    limit = gib((card - PLAN_MARGIN[1]) / PLAN_MARGIN[0])
    return f"nothing fits {gib(card)} GiB of GPU memory ({FITS}: up to {limit} GiB): " + "; ".join(why)

def plan_report(args, model, card, host, rows, chosen, text_rows, text, precision, note=()):
    """The plan's lines: each candidate (unquantised weights labelled `precision`), `note` with compiled ones, the
    choice and its flags."""
    h, w = largest_bucket(args)
    size = f"{h} px" if h == w == args.resolution else f"{h}x{w} px (the largest bucket)"
    lines = [f"memory plan: {model}, {size}, batch {args.train_batch_size}, rank {args.rank}, on {gib(card)} GiB of "
             f"GPU memory and {gib(host)} GiB of host RAM ({FITS})",
             "  weights  checkpointing  compiled  swapped blocks  peak GiB  host RAM GiB  step time"]
    for r in rows:
        cost = "-" if r.swap is None else f"{r.cost:.2f}x"
        cost += " (estimated)" * (r.quant == "int8" and r.swap is not None)  # not measured yet  # option: int8_weights
        lines.append(f"  {r.quant or precision:7}  {'on' if r.checkpointing else 'off':13}  "
                     f"{'on' if r.compiled else 'off':8}  "
                     f"{'none fits' if r.swap is None else r.swap:>14}  {gib(r.peak):>8}  {gib(r.host):>12}  "
                     + cost + ("  <- chosen" if r == chosen else ""))
    lines += [f"  text encoder ({precision if q == 'none' else q}): {gib(peak)} GiB while prompts are encoded, "
              f"{gib(need)} GiB of host RAM" + ("  <- chosen" if q == text else "") for q, peak, need in text_rows]
    lines += note if any(r.compiled for r in rows) else []
    if chosen is None or (text_rows and text is None):
        return lines
    note = " (quantised weights change results a little: docs/memory.md)" * bool(chosen.quant or text in QUANT_BYTES)
    note += f"; validation one image a call ({args.num_validation_images} in one would not fit)" * chosen.one_at_a_time
    note += "; int8's step time is estimated, not measured" * (chosen.quant == "int8")  # option: int8_weights
    return lines + [f"chosen: estimated peak {gib(chosen.peak)} GiB, step time {chosen.cost:.2f}x of {precision} "
                    f"with checkpointing{note}", f"flags: {plan_flags(chosen, text) or '(none added)'}"]

def given_flags(argv):
    """The flags given in a config file (a switch set false too) or on the command line, which is parsed again with
    no defaults: one given at its default value (to keep a plan's choice on resume, say) is given all the same."""
    parser, file_tokens = build_parser(), {}
    _, file_tokens, argv = config_tokens(argv)  # option: config
    for action in parser._actions:
        action.default, action.required = argparse.SUPPRESS, False
    return frozenset(file_tokens).union(vars(parser.parse_args(argv)))

def largest_bucket(args):
    """(height, width) of the bucket of most pixels (the first of equals), where activations peak: not always the
    --resolution square (--aspect_ratio_buckets may give any, a ladder's may exceed it a little)."""
    ladders = resolve_buckets(args)
    return max(sum(ladders, []) if isinstance(ladders[0], list) else ladders, key=lambda b: b[0] * b[1])

def run_estimate(args, dtype, instances=()):
    """This run's MemoryEstimate from the checkpoint's configs: the transformer with its adapter at the largest
    bucket's tokens and the most condition images a record or validation has (edit training's), the rows of a step."""
    from diffusers import AutoencoderKLFlux2
    with torch.device("meta"):
        transformer = empty_transformer(args).to(dtype).requires_grad_(False)
        add_lora(transformer, Hooks(args).chain("adapter_config", lora_config(args, transformer), transformer))
        vae = AutoencoderKLFlux2.from_config(read_model_json(args, "vae/config.json", "vae config"))
    height, width = largest_bucket(args)  # [B, 3, H, W] pixels -> [B, C, H/8, W/8] latents -> H/16 x W/16 tokens
    tokens = (height // 16) * (width // 16)  # and each condition image at reference_size: 16 px a token
    references = max([len(r.conditions) for r in instances] + [len(args.validation_image or ())])  # option: edit
    tokens += references * math.prod(reference_size((height, width))) // 256  # option: edit
    rows, validates = args.train_batch_size, bool(args.validation_prompt or args.final_validation_prompt)
    rows *= 2 if args.with_prior_preservation else 1  # option: class_images
    rows *= 2 if args.output_preservation else 1  # option: trigger_words
    validates = validates or bool(args.validation_prompts_file)  # option: validation_extras
    images = max(1, min(args.validation_batch or args.num_validation_images, args.num_validation_images))
    estimate = MemoryEstimate(transformer, vae, rows, tokens, args.max_sequence_length, (height // 8, width // 8),
                              validates, args.cache_latents, images)
    if args.transformer_file:  # option: transformer_file
        estimate.file = max(t["data_offsets"][1] - t["data_offsets"][0] for n, t in safetensors_header(
            local_file(args.transformer_file, args.cache_dir)).items() if n != "__metadata__")
    return estimate

def text_encoder_size(args, family):
    """-> (parameters, those quantisation leaves alone: input embeddings, output layer), from its config on meta."""
    import transformers
    cls = getattr(transformers, family.text_encoder)
    config = cls.config_class.from_dict(read_model_json(args, "text_encoder/config.json", "text_encoder config"))
    with torch.device("meta"):
        model = cls(config)
    kept = {id(p): p.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
            for p in m.parameters()}
    return sum(p.numel() for p in model.parameters()), sum(kept.values())

def agreed_minimum(value):
    """The least `value` over the processes (each plans its own GPU; all must take the same plan)."""
    from accelerate import PartialState
    from accelerate.utils import gather
    state = PartialState()
    return int(gather(torch.tensor([value], device=state.device)).min()) if state.num_processes > 1 else value

def available_host_memory():
    try:
        return int(re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1)) * 1024
    except (OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ----------------------------------------------------------------------------------------------------------------
# Option: metrics (--validation_metrics: subject, prompt and drift scores at each validation; --keep_best)

METRICS = {"dino": "subject", "clip": "prompt", "drift": "drift"}  # a flag's word -> the score it adds
SCORER = {"subject": "dino", "prompt": "clip", "drift": "dino"}  # a score -> the model (--metrics_X_model) it needs
SCORERS = {"dino": ({"dinov2", "dinov2_with_registers", "vit"}, "a DINOv2 or DINO ViT model (facebook/dinov2-base, "
                    "facebook/dino-vits16)"), "clip": ({"clip"}, "a CLIP model (openai/clip-vit-base-patch32)")}

def metric_names(text):
    """--validation_metrics -> the scores' names: none, all or some of dino, clip, drift (else ValueError)."""
    words = [] if text == "none" else list(METRICS) if text == "all" else [w.strip() for w in text.split(",")]
    if any(w not in METRICS for w in words):
        raise ValueError(text)
    return tuple(name for word, name in METRICS.items() if word in words)

def subject_score(generated, references):
    """DreamBooth's DINO score: the mean cosine of every generated image's feature [N, D] with every photo's [M, D]."""
    return paired_score(generated[:, None], references[None])  # [N, 1, D] with [1, M, D]: every pair

def paired_score(a, b):
    """The mean cosine of row i of `a` with row i of `b` ([N, D] each)."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()

KEEP_BEST_SCORES = {"subject": ("subject",), "prompt": ("prompt",), "balanced": ("subject", "drift")}

def best_entry(history, criterion, max_drift=None):
    """The validation --keep_best keeps (None: none does) of those holding the scores it reads, not the base model's:
    the highest (balanced: subject among drifts <= `max_drift`, default the latest one's), the earliest of equals."""
    history = [e for e in history if e["tag"] != "base" and all(k in e for k in KEEP_BEST_SCORES[criterion])]
    if criterion == "balanced" and history:  # the limit: max_drift, else the latest drift (0 is a limit)
        history = [e for e in history if e["drift"] <= (history[-1]["drift"] if max_drift is None else max_drift)]
    return max(history, key=lambda e: e["subject" if criterion == "balanced" else criterion], default=None)

def may_be_kept(history, criterion, max_drift=None):
    """Steps --keep_best may still choose: the best; balanced without --max_drift: the best under each drift limit."""
    limits = [e.get("drift") for e in history] if criterion == "balanced" and max_drift is None else [max_drift]
    return {best["step"] for limit in limits if (best := best_entry(history, criterion, limit))}

def read_history(folder):
    """validation/metrics.jsonl: an entry per scored validation, oldest first ([] before the first)."""
    path = Path(folder, "metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

def metrics_plot(history, size=(480, 240)):
    """The scores over the steps as a line chart (Pillow): one colour a score, a dot per validation."""
    from PIL import ImageDraw, ImageFont
    colours = {"subject": (31, 119, 180), "prompt": (44, 160, 44), "drift": (214, 39, 40)}
    series = {k: [(e["step"], e[k]) for e in history if e.get(k) is not None] for k in colours}
    values, steps = [v for points in series.values() for _, v in points] or [0.0], [e["step"] for e in history] or [0]
    pad = max(0.05 * (max(values) - min(values)), 0.01)  # the axis spans the values: small changes show
    low, high = min(values) - pad, max(values) + pad
    (left, top, right, bottom), font = (40, 20, size[0] - 10, size[1] - 24), ImageFont.load_default()
    x = lambda s: left + (right - left) * (s - min(steps)) / max(1, max(steps) - min(steps))  # noqa: E731
    y = lambda v: bottom - (bottom - top) * (v - low) / (high - low)  # noqa: E731
    draw = ImageDraw.Draw(image := Image.new("RGB", size, "white"))
    draw.rectangle((left, top, right, bottom), outline=(160, 160, 160))
    for v in (low, (low + high) / 2, high):
        draw.text((2, y(v) - 6), f"{v:.2f}", fill="black", font=font)
    draw.text((left, bottom + 6), f"step {min(steps)} to {max(steps)}", fill="black", font=font)
    for k, name in enumerate(name for name in colours if series[name]):
        draw.text((left + 8 + 80 * k, 4), name, fill=colours[name], font=font)
        draw.line([(x(s), y(v)) for s, v in series[name]], fill=colours[name], width=2)  # one point: no line
        for s, v in series[name]:
            draw.ellipse((x(s) - 3, y(v) - 3, x(s) + 3, y(v) + 3), fill=colours[name])
    return image

class MetricModels:
    """DINO (subject, drift: DINOv2, or v1's ViT) and CLIP (prompt) with their processors, loaded once on the CPU and
    on the GPU only while they score (DINOv2-base 86 M parameters, CLIP ViT-B/32 151 M: about 1 GB in float32)."""

    def __init__(self, dino=None, clip=None):
        from transformers import AutoImageProcessor, AutoModel, AutoProcessor, CLIPModel
        with torch.random.fork_rng(devices=[]):  # weights a checkpoint lacks (v1's pooler) draw no training noise
            self.dino = (AutoImageProcessor.from_pretrained(dino, backend="pil"),
                         AutoModel.from_pretrained(dino).eval()) if dino else None
            self.clip = (AutoProcessor.from_pretrained(clip, backend="pil"),
                         CLIPModel.from_pretrained(clip).eval()) if clip else None

    def dino_features(self, images, device):
        """[N, D]: the CLS token of the last hidden state (after the last layer norm: DINOv2's pooler output; v1's ViT
        pooler is a further layer DINO did not train), on the crops of the model's own processor."""
        processor, model = self.dino
        with on_device(model, device, True), torch.no_grad():
            return model(**processor(images=images, return_tensors="pt").to(device)).last_hidden_state[:, 0].cpu()

    def clip_embeddings(self, images, texts, device):
        """([N, P] image, [N, P] text) projected embeddings; prompts beyond CLIP's 77 tokens are cut."""
        processor, model = self.clip
        inputs = processor(text=texts, images=images, return_tensors="pt", padding=True, truncation=True)
        with on_device(model, device, True), torch.no_grad():
            out = model(**inputs.to(device))
            return out.image_embeds.cpu(), out.text_embeds.cpu()

@functools.cache  # read once, when the flag is parsed: the rows of every validation stay the same
def read_drift_prompts(path):
    try:
        prompts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--metrics_drift_prompts {path}: {e}") from None
    refuse(not prompts, f"--metrics_drift_prompts {path}: no prompt in it")
    return prompts

@functools.cache  # read when the flag is parsed, before anything is written
def reference_photos(folder):
    try:  # as training reads a folder: hidden files skipped, EXIF orientation applied, unreadable files named
        return scan_image_folder(folder, read_captions=False)
    except UsageError as e:
        raise UsageError(f"--metrics_reference_dir {folder}: {e}") from None

def copy_folder(source, target):
    """Copy folder `source` over `target` without a moment where `target` is missing or half copied."""
    new = target.with_name(f"{target.name}.partial")
    shutil.rmtree(new, ignore_errors=True)
    try:
        shutil.copytree(source, new)
        replace_folder(new, target)
    finally:
        shutil.rmtree(new, ignore_errors=True)

@option
class ValidationMetrics(Option):
    """Numbers to pick a checkpoint by: subject (DINO likeness to the photos), prompt (CLIP image-prompt agreement),
    drift (the drift prompts' images against the base model's) at each validation, in metrics.jsonl and .png, the
    trackers, the card; --keep_best keeps the best LoRA in best/. Cost: about 1 GB of models, on the GPU only while
    they score, and a forward pass of each a validation."""

    words = ("metric", "scores", "DINO", "CLIP")
    name, switches, run, models, references = "metrics", ("validation_metrics",), None, None, None
    names = property(lambda self: metric_names(self.args.validation_metrics))  # the flag keeps the words as typed
    sources = property(lambda self: {SCORER[s]: vars(self.args)[f"metrics_{SCORER[s]}_model"] for s in self.names})
    flags = [
        flag("--validation_metrics", type=Accepts("none, all, or some of dino, clip, drift (comma-separated)", lambda v:
             metric_names(v) is not None), default="none", help="Scores at each validation: dino (the subject's "
             "likeness), clip (prompt agreement), drift (the drift prompts' images against the base model's)."),
        flag("--metrics_reference_dir", type=Accepts("a readable folder of images", lambda v: existing_folder.ok(v)
             and bool(reference_photos(v))), help="Photos of the subject to compare with (held-out ones measure "
             "likeness, not memory); default: the instance images."),
        flag("--metrics_drift_prompts", type=Accepts("a readable text file, a prompt a line", lambda v: bool(
             read_drift_prompts(v))), help="Prompts without the subject, one a line, for drift; default: another "
             "option's."),
        flag("--metrics_dino_model", type=model_source, default="facebook/dinov2-base", help="The DINO model: DINOv2, "
             "or the DreamBooth paper's facebook/dino-vits16."),
        flag("--metrics_clip_model", type=model_source, default="openai/clip-vit-base-patch32", help="The CLIP model."),
        flag("--keep_best", choices=["subject", "prompt", "balanced"], help="Keep the LoRA of the best scored "
             "validation in <output_dir>/best/; balanced: the best subject score with drift at most --max_drift."),
        flag("--max_drift", type=number(0, 2), help="balanced's drift limit; default: the final validation's drift.")]

    def check(self):
        args, names, keep, others = self.args, self.names, self.args.keep_best, self.others
        given, file = f"--validation_metrics {args.validation_metrics}", vars(args).get("validation_prompts_file")
        prompts = [p for p in (args.validation_prompt or args.final_validation_prompt,) if p]
        prompts += [s.prompt for s in read_validation_prompts(file)] if file else []  # option: validation_extras
        refuse(not prompts, f"{given} needs validation images: add --validation_prompt (a prompt naming the subject)")
        wanted = "--metrics_drift_prompts"
        wanted += ", --class_prompt"  # option: class_images
        wanted += ", --output_preservation with --class_word"  # option: trigger_words
        refuse("drift" in names and not others, f"{given}: drift needs prompts without the subject ({wanted})")
        refuse("subject" in names and not (args.metrics_reference_dir or args.instance_data_dir or vars(args).get(
            "dataset_name")), f"{given}: no instance images to compare with: give --metrics_reference_dir")
        refuse(keep and {*KEEP_BEST_SCORES[keep]} - {*names}, f"{given} lacks the scores --keep_best {keep} compares")
        hint = "holds a word of --instance_prompt the drift prompts lack"
        hint = f"holds --trigger_word {args.trigger_word}" if args.trigger_word else hint  # option: trigger_words
        refuse(keep in ("subject", "balanced") and not any(self._names_subject(p, others) for p in prompts),
               f"--keep_best {keep} compares subject scores, and no validation prompt names the subject ({hint})")
        refuse(keep and fsdp_requested(),  # option: fsdp
               "--keep_best under FSDP: not supported (the LoRA is sharded during "
               "validation); choose from validation/metrics.jsonl")
        refuse(args.max_drift is not None and keep != "balanced", "--max_drift applies to --keep_best balanced")

    def check_model(self, model):
        """A scoring model's config that cannot be read (a typo, not cached offline), or of a model of another kind
        (the two flags swapped, a diffusers folder), stops the run before anything is written, not at its end."""
        from transformers import PretrainedConfig
        for which, source in self.sources.items():
            try:
                config = PretrainedConfig.get_config_dict(source)[0]
            except (OSError, ValueError) as e:
                raise UsageError(f"--metrics_{which}_model {source}: cannot read its config ({e})") from None
            kind = config.get("model_type")
            held = f"a {kind} model" if kind else config.get("_class_name", "no config.json")  # diffusers': its class
            refuse(kind not in SCORERS[which][0], f"--metrics_{which}_model {source} holds {held}; expected "
                   f"{SCORERS[which][1]}")

    @property
    def others(self):
        """Prompts without the subject (drift's): --metrics_drift_prompts, else another option's.
        Output preservation's prompt.
        The class images' prompt."""
        args, found, text = self.args, [], self.args.instance_prompt
        found = [args.class_prompt] if args.class_prompt else found  # option: class_images
        if text and (word := vars(args).get("class_word")):  # option: trigger_words
            found = [preservation_text(text, args.trigger_word, word)]  # option: trigger_words
        return read_drift_prompts(args.metrics_drift_prompts) if args.metrics_drift_prompts else found

    def validation_specs(self):
        return [ValidationSpec(p) for p in self.others] if "drift" in self.names else []

    def _names_subject(self, text, others):
        """Whether a validation prompt names the subject: not one of `others`, and holding a word of the instance prompt
        that `others` lack (the rare token: sks), else (no such word) any.
        With a trigger word: holding it."""
        words = lambda t: set(re.findall(r"\w+", (t or "").lower()))  # noqa: E731
        rare = words(self.args.instance_prompt) - set().union(*map(words, others))
        named = not others or not rare or bool(rare & words(text))
        if word := vars(self.args).get("trigger_word"):  # option: trigger_words
            named = mentions(text := with_trigger(text, word), word)  # option: trigger_words
        return named and text not in others

    def setup(self, run):
        """The scoring models and the subject's photos, on the main process: what cannot be read stops the run now."""
        from accelerate import PartialState
        args, self.run, state = self.args, run, PartialState()
        if state.is_main_process:
            self.models = MetricModels(**self.sources)
            photos = reference_photos(d) if (d := args.metrics_reference_dir) else run.data.dataset.instances
            if "subject" in self.names:
                self.references = self.models.dino_features([r.load() for r in photos], state.device)

    def validated(self, accelerator, folder, tag, step, specs, scales, images):
        """Score a validation's images at strength 1 (else the largest shown), and the base model's first or when they
        were remade (the history restarts at step 0, where the curves start); record, plot, log; --keep_best keeps."""
        count, at = len(images) // (len(specs) * len(scales)), scales.index(1.0 if 1.0 in scales else max(scales))
        rows = [(s.prompt, (k * len(scales) + at) * count + i) for k, s in enumerate(specs) for i in range(count)]
        base = {r: Image.open(Path(folder, f"base-{r}.png")).convert("RGB") for _, r in rows}  # the same noise
        self.history = read_history(folder)
        made = json_digest("base", read_base_record(folder))  # what the base images are of (validation/base.json)
        first = [] if [e.get("made") for e in self.history[:1] if e["tag"] == "base"] == [made] else [
            (base, 0, "base", {"made": made})]
        for batch, n, label, extra in first + [(dict(enumerate(images)), step, tag, {})]:
            scores = self._scores(accelerator, rows, batch, base)
            entry = {"step": n, "tag": label, **scores, "images": [f"{label}-{r}.png" for _, r in rows], **extra}
            self.history = [e for e in self.history if e["step"] < n] + [entry]  # a resumed run redoes later steps
            with writing(path := Path(folder, "metrics.jsonl")):
                write_text_atomic(path, "".join(json.dumps(e) + "\n" for e in self.history))
                metrics_plot(self.history).save(Path(folder, "metrics.png"))
            accelerator.log({f"metrics/{k}": v for k, v in scores.items()}, step=n)
            text = ", ".join(f"{k} {v:.3f}" for k, v in scores.items()) or "no prompt names the subject"
            text += self._keep(accelerator, folder, entry) if self.args.keep_best and label != "base" else ""
            logger.info(f"validation metrics, {'the base model' if label == 'base' else f'step {n}'}: {text} "
                        "(validation/metrics.png)")

    def _scores(self, accelerator, rows, images, base):
        """{score: value} of `images` by row: subject over the rows naming it, prompt over all, drift against `base`."""
        names, device, scores, others, dino = self.names, accelerator.device, {}, self.others, self.models.dino_features
        subject = [images[r] for p, r in rows if self._names_subject(p, others)]
        if "subject" in names and subject:
            scores["subject"] = subject_score(dino(subject, device), self.references)
        if "prompt" in names:
            scores["prompt"] = paired_score(*self.models.clip_embeddings([images[r] for _, r in rows],
                                                                          [p for p, _ in rows], device))
        drifted = [r for p, r in rows if p in others]
        if "drift" in names and drifted:
            features = dino([images[r] for r in drifted] + [base[r] for r in drifted], device)
            scores["drift"] = 1 - paired_score(features[:len(drifted)], features[len(drifted):])
        return scores

    def _keep(self, accelerator, folder, entry):
        """Save the scored LoRA if it may be chosen, drop those that no longer may, copy the best to best/ -> words."""
        args, run, scored, out = self.args, self.run, Path(folder, "scored"), Path(self.args.output_dir, "best")
        keep, target = may_be_kept(self.history, args.keep_best, args.max_drift), scored / f"step-{entry['step']}"
        if entry["step"] in keep:
            with run.hooks.context("validation_weights"):
                state = lora_state_dict(accelerator, run.transformer, run.hooks)
            with writing(scored / "."):
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir(parents=True)
                write_lora_files(accelerator, run.transformer, state, target,
                                 torch.float32 if args.upcast_before_saving else run.weight_dtype, run.hooks)
        for old in (p for p in scored.glob("step-*") if int(p.name[5:]) not in keep):
            shutil.rmtree(old)
        best, scores = best_entry(self.history, args.keep_best, args.max_drift), KEEP_BEST_SCORES[args.keep_best]
        if best is None:
            shutil.rmtree(out, ignore_errors=True)
            return (f"; no validation within --max_drift {args.max_drift}, no best LoRA" if best_entry(
                self.history, args.keep_best, math.inf) else f"; no validation has a {' and '.join(scores)} score yet "
                "(subject: no prompt names the subject), no best LoRA")
        if not (scored / f"step-{best['step']}").is_dir():  # a run from a later checkpoint dropped it
            return f"; best ({args.keep_best}): step {best['step']}, whose LoRA is gone from {scored}: {out} unchanged"
        with writing(out):
            copy_folder(scored / f"step-{best['step']}", out)
        return f"; best ({args.keep_best}): step {best['step']}, in {out}"

    def retagged(self, folder, old, new):
        """The earlier final validation of a continued run, renamed: its scores follow."""
        if history := read_history(folder):
            write_text_atomic(Path(folder, "metrics.jsonl"), "".join(json.dumps({**e, "tag": new, "images": [
                n.replace(old, new, 1) for n in e["images"]]} if e["tag"] == old else e) + "\n" for e in history))

    def card(self):
        """The model card's table of the run's scores (validation/metrics.jsonl), and which LoRA best/ holds."""
        args, history = self.args, read_history(Path(self.args.output_dir, "validation"))
        rows = [f"| {e['step']} | {' | '.join(f'{e[k]:.3f}' if k in e else '-' for k in SCORER)} |" for e in history]
        best = args.keep_best and best_entry(history, args.keep_best, args.max_drift)
        kept = ["", f"`best/` holds the LoRA of step {best['step']} (--keep_best {args.keep_best})."] if best else []
        return ["", "Validation metrics (subject: DINO similarity to the subject's photos; prompt: CLIP image-prompt "
                "agreement; drift: 1 - DINO similarity of the drift prompts' images to the base model's):", "",
                "| step | subject | prompt | drift |", "|---|---|---|---|", *rows, *kept] if history else []

# ----------------------------------------------------------------------------------------------------------------
# Option: copies (--write_copy: this script with only the options kept, to read and edit)

# --keep's named set: the diffusers example's scope (class images, Prodigy, 8-bit Adam, its text-encoder flags, FSDP,
# a `datasets` loader)
OPTION_SETS = {"diffusers": ("class_images", "prodigy", "compile", "text_encoders", "fsdp", "dataset")}
MACHINERY = ("seam", "Hooks", "hooks")  # the words of the seam itself: a copy without options names none

@option
class Copies(Option):
    """`--write_copy FILE --keep NAMES`: this script with Parts 1 and 2 and only the options kept, as torchtune's
    `tune cp` copies a recipe to edit. The others go with their sections, the lines marked for them and the docstring
    and comment lines naming their words; the seams no kept option implements are folded (a call becomes what it does
    without options: nothing, its default, the value passed in), and what that leaves unread goes too: parameters,
    dataclass fields, locals, definitions, imports. A copy is written without this option unless it is kept. Cost:
    none in a run; about two CPU-seconds a copy."""

    name, switches, requires = "copies", ("write_copy",), "--write_copy FILE"
    words = ("write_copy", "trimmed copy", "copy writer")
    flags = [flag("--write_copy", metavar="FILE", help="Write this script trimmed to the options kept, and stop."),
             flag("--keep", default="none", help="Options a copy keeps, comma-separated: names --help lists as "
                  f"'option NAME'; none, all, or {', '.join(OPTION_SETS)} (the diffusers example's scope)."),
             flag("--overwrite", action="store_true", help="Replace the copy if the file exists.")]

def write_copy(argv):
    """Write the copy --write_copy names, with the options --keep names (and those they need)."""
    p = _Parser(prog=Path(__file__).name, description="Write a copy of this script with only the options kept.")
    for names, settings in Copies.flags:
        p.add_argument(*names, **settings)
    args, names = p.parse_args(argv), [o.name for o in OPTIONS]
    words = [w.strip() for w in args.keep.split(",") if w.strip()]
    unknown = [w for w in words if w not in (*names, "none", "all", *OPTION_SETS)]
    refuse(unknown, f"--keep {args.keep}: no option {', '.join(unknown)}; this script's options are "
           f"{', '.join(names) or 'none'} (or none, all, {', '.join(OPTION_SETS)})")
    keep = {n for n in names if "all" in words or n in words or any(n in OPTION_SETS.get(w, ()) for w in words)}
    keep = [n for n in names if n in keep or any(n in o.needs for o in OPTIONS if o.name in keep)]
    source, target = Path(__file__), Path(args.write_copy)
    refuse(target.exists() and os.path.samefile(target, source), f"--write_copy {target} is this script; name "
           "another file")
    refuse(target.is_dir(), f"--write_copy {target} is a folder; name a file")
    refuse(not target.absolute().parent.is_dir(), f"--write_copy {target}: no folder {target.parent}; make it first")
    text = source.read_text(encoding="utf-8")  # the modules it imports: `import x` and `from x` lines, __import__
    found = sum(re.findall(r"^\s*(?:import|from) (\w+)|(?:__import__|find_spec)\(\"(\w+)", text, re.M), ())
    owner = "Python's own" if target.stem in sys.stdlib_module_names else "the library" * (target.stem in found)
    refuse(owner, f"--write_copy {target}: run as a script, it would be imported in place of {owner} {target.stem} "
           "module (its folder comes first on the path); name it otherwise")
    refuse(target.exists() and not args.overwrite, f"--write_copy {target} exists; pass --overwrite to replace it")
    header = copy_header(keep, VERSION, hashlib.sha256(text.encode()).hexdigest()[:12])
    text = trimmed_source(text, {o.name: [n for names, _ in o.flags for n in names] for o in OPTIONS}, keep, header)
    with writing(target):
        write_text_atomic(target, text)
        shutil.copymode(source, target)
    print(f"wrote {target}: {len(text.splitlines())} lines, options: {', '.join(keep) or 'none'}")

def copy_header(keep, version, digest):
    """The comment lines that open a copy: what it is, what it came from, where the rest is."""
    import textwrap
    again = ("--write_copy FILE --keep NAMES trims this copy further." if "copies" in keep else
             "It was written without the copy writer (--keep copies keeps it), so it does not trim itself again.")
    text = (f"A copy of train_dreambooth_lora_flux2.py (version {version}; the file it was trimmed from has SHA-256 "
            f"{digest}...) written by --write_copy: Parts 1 and 2, and the options {', '.join(keep) or 'none'}. "
            f"The full script, with every option, is in the project's repository (README.md: Copy and edit). {again}")
    return [line + "\n" for line in textwrap.wrap(text, 118, initial_indent="# ", subsequent_indent="# ")]

def trimmed_source(source, options, keep, header):
    """`source` with only the options `keep` of `options` ({name: its flags}): the others' sections go, the lines
    marked `# option: NAME` for them (`any`: for any option; a marked line that starts a statement takes the whole
    statement, a definition with its decorators; another goes alone, e.g. an entry of a list), and the docstring and
    comment lines naming their flags or words; then the seams the options kept do not implement are folded
    (rewrite). The reading map lists the options kept; `header` (comment lines) replaces an earlier copy's."""
    gone = {name: flags for name, flags in options.items() if name not in keep} | ({} if keep else {"any": []})
    lines, drop = source.splitlines(keepends=True), set()
    for i, line in enumerate(lines):  # a section: from its banner to the next banner
        if (m := re.match(r"# Option: (\w+)", line)) and m.group(1) in gone:
            drop.update(range(i - 1, next(j for j in range(i + 1, len(lines)) if lines[j].startswith(
                ("# ---", "# ===", "if __name__")))))
    marks, texts, trailing = marked_lines(source)
    drop.update(i for name, span in marks if name in gone for i in span)
    classes = {o.name: o for o in OPTIONS}
    words = [w for name, flags in gone.items() for w in [*flags, *getattr(classes.get(name), "words", MACHINERY)]]
    pattern = re.compile("|".join(rf"(?<![\w-]){re.escape(w)}" if w != w.lower() else rf"(?i:(?<![\w-]){re.escape(w)})"
                                  for w in words) or "(?!)")  # (?!): nothing; "$^" matches a blank line
    drop.update(i for i in texts if pattern.search(lines[i]))  # docstring and comment lines naming them
    for i, col in trailing.items():  # the comments after code that name them, a docstring's last line but its quotes
        if col is not None and pattern.search(lines[i][col:]):
            lines[i] = lines[i][:col].rstrip() + "\n" if col else re.sub(r'\S.*(?=""")', "", lines[i])
    kept = [line for i, line in enumerate(lines) if i not in drop]
    text = "".join(kept[:2] + header + kept[next(i for i, line in enumerate(kept) if line.startswith('"""')):])
    implemented = {n for o in OPTIONS if o.name in keep for n in dir(o)}
    folded = SEAMS - implemented | ({"wake"} if not keep else set())
    text = rewrite(text, source, frozenset(folded)) if gone else text  # all kept: the script as it is
    return reading_map(text, [n for n in options if n in keep])

@functools.lru_cache(maxsize=4)  # a second copy of the same source skips the parse
def marked_lines(source):
    """-> ([(option name, the line indexes its `# option: NAME` comment takes)], the indexes of the docstring lines
    (but a docstring's first and last) and of the comment-only lines, {line index: column} of comments after code)."""
    lines, spans, marks, texts, trailing = source.splitlines(keepends=True), {}, [], [], {}
    tree = ast.parse(source)
    for node in ast.walk(tree):  # breadth first: the outermost statement or entry starting on a line is found first
        entries = ([(node, node)] if isinstance(node, ast.stmt) else [(e, e) for e in node.elts] if isinstance(
            node, (ast.List, ast.Tuple, ast.Set)) else [(k or v, v) for k, v in zip(node.keys, node.values)]
            if isinstance(node, ast.Dict) else [])
        for head, entry in entries:  # a statement (a definition from its first decorator), or an entry of a literal
            first = min([head.lineno, *(d.lineno for d in getattr(entry, "decorator_list", []))])
            for start in {first, entry.lineno}:
                spans.setdefault(start - 1, range(first - 1, entry.end_lineno))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            texts += range(node.lineno, node.end_lineno - 1)  # a docstring's lines but its first and last
            trailing[node.end_lineno - 1] = 0 if node.end_lineno > node.lineno else None  # the last: its quotes stay
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        row = token.start[0] - 1
        if token.type == tokenize.COMMENT and not lines[row][:token.start[1]].strip() and not (
                token.string.startswith("# Option: ") or lines[row - 1].startswith("# ---")):  # a banner stays
            texts.append(row)
        elif token.type == tokenize.COMMENT and lines[row][:token.start[1]].strip():
            trailing[row] = token.start[1]
        if token.type == tokenize.COMMENT and (m := re.search(r"# option: (\w+)\b", token.string)):
            span = spans.get(token.start[0] - 1, range(token.start[0] - 1, token.start[0]))
            above = span.start  # the comment lines just above a statement are about it
            while above > 1 and lines[above - 1].lstrip().startswith("#") and not (
                    lines[above - 1].startswith(("# ---", "# ===")) or lines[above - 2].startswith(("# ---", "# ==="))):
                above -= 1
            marks.append((m.group(1), range(above, span.stop)))
    return marks, texts, trailing

def reading_map(text, names):
    """`text` with the reading map's Part 3 paragraph listing the options `names`, wrapped as the docstring is."""
    import textwrap

    def fill(m):
        words = f"{' '.join(m.group(1).split())} {', '.join(names)}." if names else (
            "Part 3, the options: none in this copy (README.md: Copy and edit).")
        return textwrap.fill(words, 120, initial_indent="  ", subsequent_indent="    ") + "\n"
    return re.sub(r"  (Part 3, the options .*?while it is on:) [^.]*\.\n", fill, text, count=1, flags=re.S)

# The rewriter of copies: a seam folded, and what that leaves unread removed, keeping the layout and the comments

PURE_CALLS = {"Hooks", "len", "bool", "list", "tuple", "dict", "set"}  # what a dropped assignment may call
SAFE_BASES = {"torch.utils.data.Dataset", "torch.utils.data.Sampler"}  # a method of theirs no line names may go
FOLDED_CALLS = {"each", "first", "chain", "collect", "context", "flag"}

class Source:
    """One parse of a copy being rewritten: its tree (each node knows its `parent` and `owner`, the outermost function
    holding it), where names are read and attributes named, and the pass's edits: spans replaced, in groups that are
    applied whole or not at all (an edit overlapping one taken already waits for the next pass)."""

    def __init__(self, text):
        self.text, self.tree, self.lines = text, ast.parse(text), text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.reads, self.attrs, self.owned, self.kinds = {}, {}, {}, {}
        self.stored = collections.Counter()  # (owner, name) -> how often it is assigned there (parameters too)
        self.taken, self.pending, self.dead, self.dying = [], [], set(), set()
        self.order, self.cached = {}, {}
        stack, load, AST = [(self.tree, None)], ast.Load, ast.AST
        while stack:
            node, owner = stack.pop()
            self.order[id(node)] = len(self.order)  # the walk's order: outermost first
            kind = type(node)
            self.kinds.setdefault(kind, []).append(node)
            if kind is ast.Name and type(node.ctx) is load:
                self.reads.setdefault(node.id, []).append(node)
                self.owned.setdefault(owner, {}).setdefault(node.id, []).append(node)
            elif kind is ast.Attribute:
                self.attrs.setdefault(node.attr, []).append(node)
            elif kind is ast.Name or kind is ast.arg:  # a name a function assigns is its own there, not a global
                self.stored[owner, getattr(node, "id", None) or node.arg] += 1
            top = kind is ast.Module or kind is ast.ClassDef and owner is None  # a function's class is its own
            for field in node._fields:
                value = getattr(node, field, None)
                for child in value if type(value) is list else (value,):
                    if isinstance(child, AST):
                        child.parent = node
                        child.owner = child if top and type(child) is ast.FunctionDef else owner
                        stack.append((child, child.owner))

    def span(self, node):
        return (self.starts[node.lineno - 1] + node.col_offset,
                self.starts[node.end_lineno - 1] + node.end_col_offset)

    def outer(self, node):
        """`node`'s span with the grouping parentheses around it."""
        start, stop = self.span(node)
        while True:
            left = self.text[max(0, start - 200):start].rstrip()
            right = self.text[stop:stop + 200]
            callee = re.search(r"(\w+|[\])])\s*\($", left)  # a call's or subscript's parenthesis
            if not (left.endswith("(") and right.lstrip().startswith(")") and (not callee or keyword.iskeyword(
                    callee.group(1)))):
                return start, stop
            start, stop = start - (len(self.text[max(0, start - 200):start]) - len(left)) - 1, \
                stop + len(right) - len(right.lstrip()) + 1

    def source(self, node):
        return self.text[slice(*self.span(node))]

    def begin(self):
        """Edits from here to commit() belong together: taken whole, or dropped if one overlaps an edit taken (the
        next pass, on the parse of the result, finds them again)."""
        self.pending, self.dying = [], set()

    def commit(self):
        if any(not (b <= start or a >= stop) for a, b, _ in self.pending for start, stop, _ in self.taken):
            return False
        self.taken += self.pending
        self.dead |= self.dying  # what the edits remove no longer reads, names or calls anything
        self.pending, self.dying = [], set()
        return True

    def put(self, start, stop, text, gone=None, kept=None):
        """A span replaced; `gone`: the node it removes (less the node `kept`)."""
        self.pending.append((start, stop, text))
        if gone is not None:
            self.dying |= set(map(id, ast.walk(gone))) - set(map(id, ast.walk(kept) if kept is not None else ()))

    def of(self, *kinds):
        """The nodes of these types, outermost first."""
        if kinds not in self.cached:
            found = [n for k in kinds for n in self.kinds.get(k, [])]
            self.cached[kinds] = sorted(found, key=lambda n: self.order[id(n)])
        return self.cached[kinds]

    def live(self, nodes, owner=False):
        return [n for n in nodes if id(n) not in self.dead and (owner is False or n.owner is owner)]

    def replace(self, node, new):
        """`node` replaced by the expression `new` of the same text, in parentheses where its place needs them; the
        continuation lines of a multi-line `new` move with it."""
        text = self.source(new)
        if new.end_lineno > new.lineno:
            line = self.lines[node.lineno - 1]
            floor, shift = len(line) - len(line.lstrip()) + 4, node.col_offset - new.col_offset
            text = "\n".join(text.split("\n")[:1] + [" " * max(floor, len(x) - len(x.lstrip()) + shift) + x.lstrip()
                                                     for x in text.split("\n")[1:]])
        self.put(*self.span(node), f"({text})" if precedence(new, text) < needed(node) else text, node, new)

    def delete(self, stmt):
        """A statement deleted with its decorators and the comment lines just above it (a block's only one: pass)."""
        block = next((b for f in ("body", "orelse", "finalbody") if stmt in (b := getattr(stmt.parent, f, None) or [])),
                     None)
        if block is not None and self.live(block) == [stmt]:
            return self.put(self.starts[stmt.lineno - 1], self.starts[stmt.end_lineno],
                            " " * stmt.col_offset + "pass\n", stmt)
        first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
        while first > 1 and self.lines[first - 2].lstrip().startswith("#") and not self.lines[first - 2].startswith(
                "# ---"):
            first -= 1
        self.put(self.starts[first - 1], self.starts[stmt.end_lineno], "", stmt)

    def unwrap(self, stmt, body):
        """A compound statement replaced by the statements of one of its blocks, dedented."""
        cut = body[0].col_offset - stmt.col_offset
        text = "".join(x[cut:] if x[:cut].isspace() else x for x in self.lines[body[0].lineno - 1:body[-1].end_lineno])
        self.put(self.starts[stmt.lineno - 1], self.starts[body[-1].end_lineno], text)
        blocks = [b for b in (stmt.body, getattr(stmt, "orelse", [])) if b is not body]
        for other in [getattr(stmt, "test", None), *(s for b in blocks for s in b)]:  # what goes with the statement
            if other is not None:
                self.dying |= set(map(id, ast.walk(other)))

    def remove(self, elements, removed):
        """Elements of a comma-separated list (parameters, arguments) removed; the others keep their separators."""
        kept = [e for e in elements if e not in removed]
        spans = [self.outer(e) if not isinstance(e, (ast.arg, ast.keyword)) else self.span(e) for e in elements]
        start, stop = spans[0][0], spans[-1][1]
        pieces = []
        for e, (a, b) in zip(elements, spans):
            if e in kept:
                after = next((s[0] for s in spans if s[0] >= b), b)
                pieces.append(self.text[a:after])
        text = "".join(pieces).rstrip().rstrip(",")
        if "#" in text.rsplit("\n", 1)[-1]:  # a comment may end it: the closing bracket goes on a line of its own
            text += "\n" + " " * elements[0].col_offset
        self.put(start, stop, text)
        for e in removed:
            self.dying |= set(map(id, ast.walk(e)))

    def apply(self):
        text = self.text
        for a, b, new in sorted(self.taken, key=lambda e: (e[0], e[1]), reverse=True):
            text = text[:a] + new + text[b:]
        return text

def precedence(node, text=""):
    if isinstance(node, ast.Tuple) and not text.startswith("("):
        return 0
    if isinstance(node, ast.BoolOp):
        return 3 if isinstance(node.op, ast.Or) else 4
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return 5
    return {ast.NamedExpr: 0, ast.Lambda: 1, ast.IfExp: 2, ast.Compare: 6, ast.BinOp: 8}.get(type(node), 14)

def needed(node):
    """The least precedence an expression needs in `node`'s place."""
    parent = node.parent
    if isinstance(parent, ast.BoolOp):
        return 5 if isinstance(parent.op, ast.And) else 4
    if isinstance(parent, (ast.Compare, ast.BinOp)) or isinstance(parent, ast.UnaryOp) and not isinstance(
            parent.op, ast.Not):
        return 9
    if isinstance(parent, ast.UnaryOp):
        return 6
    if getattr(parent, "value", None) is node and isinstance(parent, (ast.Attribute, ast.Subscript)) or (
            isinstance(parent, ast.Call) and parent.func is node):
        return 14
    return 0 if isinstance(parent, (ast.Assign, ast.Return, ast.Expr)) else 1

def constant(node):
    """(True, value) of a literal constant or an empty list, else (False, None)."""
    if isinstance(node, ast.Constant):
        return True, node.value
    return (True, []) if isinstance(node, ast.List) and not node.elts else (False, None)

def pure(node):
    """Whether `node` can be left unevaluated: it calls nothing but PURE_CALLS."""
    return all(not isinstance(n, (ast.Call, ast.Await, ast.Yield, ast.NamedExpr)) or getattr(
        n.func, "id", None) in PURE_CALLS for n in ast.walk(node) if not isinstance(n, ast.Lambda))

def inside(node, outer):
    while node is not None and node is not outer:
        node = getattr(node, "parent", None)
    return node is outer

def in_fstring(node):
    while (node := getattr(node, "parent", None)) is not None:
        if isinstance(node, ast.JoinedStr):
            return True
    return False

# ---- the passes: each adds its edits to a Source, a group at a time (begin, edits, commit)

def fold_seams(src, folded):
    """The calls of folded seams: each/collect -> nothing ([] in an expression), first -> its default, chain -> the
    value, context -> no item, flag -> False; wake (no option kept) -> nothing. SEAMS keeps the others."""
    for stmt in src.tree.body:
        if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", "") == "SEAMS" and id(stmt) not in src.dead:
            kept = [e.value for e in getattr(stmt.value, "elts", []) if e.value not in folded]
            if len(kept) < len(getattr(stmt.value, "elts", kept)):  # the others, wrapped as the literal was
                import textwrap
                text = textwrap.fill(", ".join(f'"{k}"' for k in kept), 116, initial_indent="    ",
                                     subsequent_indent="    ")
                src.begin()
                src.put(*src.span(stmt.value), "{\n" + text + "}" if kept else "set()", stmt.value)
                src.commit()
    for node in src.of(ast.Call):
        if not type(node.func) is ast.Attribute or id(node) in src.dead:
            continue
        receiver, method = node.func.value, node.func.attr
        seam = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
        receiver = receiver.func if isinstance(receiver, ast.Call) else receiver  # Hooks(args).chain(...) too
        if getattr(receiver, "id", getattr(receiver, "attr", "")) not in ("hooks", "Hooks") or not (
                method == "wake" and "wake" in folded or method in FOLDED_CALLS and seam in folded):
            continue
        parent, default = node.parent, next((k.value for k in node.keywords if k.arg == "default"), None)
        src.begin()
        if method in ("each", "collect", "wake") and isinstance(parent, ast.Expr):
            src.delete(parent)
        elif method == "first" and isinstance(default, ast.Lambda):
            src.replace(node, default.body)
        elif method == "chain":
            src.replace(node, node.args[1])
        elif method == "context":
            others, stmt = [i for i in parent.parent.items if i is not parent], parent.parent
            if others:
                head = ", ".join(src.text[src.span(i.context_expr)[0]:src.span(i.optional_vars or i.context_expr)[1]]
                                 for i in others)
                last = stmt.items[-1]
                src.put(src.span(stmt)[0], src.span(last.optional_vars or last.context_expr)[1], f"with {head}",
                        parent.context_expr)
            else:
                src.unwrap(stmt, stmt.body)
                src.dying |= set(map(id, ast.walk(parent.context_expr)))
        else:
            text = {"each": "[]", "collect": "[]", "flag": "False"}.get(method) or (
                "None" if default is None else src.source(default) + "()")
            src.put(*src.span(node), text, node)
        src.commit()

def fold_constants(src):
    """What folding leaves: not False, None is None, A and True, False or A, x + [], *[], for _ in [], if True, ..."""
    for node in src.of(ast.UnaryOp, ast.Compare, ast.BoolOp, ast.BinOp, ast.Starred, ast.ListComp, ast.GeneratorExp,
                       ast.Call, ast.IfExp, ast.If, ast.For, ast.Assign):
        if id(node) in src.dead:
            continue
        src.begin()
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and constant(node.operand)[0]:
            src.put(*src.span(node), repr(not constant(node.operand)[1]), node)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)) \
                and constant(node.left)[0] and constant(node.comparators[0])[0]:
            same = constant(node.left)[1] is constant(node.comparators[0])[1]
            src.put(*src.span(node), repr(same == isinstance(node.ops[0], ast.Is)), node)
        elif isinstance(node, ast.BoolOp):
            fold_operands(src, node)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and (True, []) in (
                constant(node.left), constant(node.right)):
            src.replace(node, node.right if constant(node.left) == (True, []) else node.left)
        elif isinstance(node, ast.Starred) and constant(node.value) == (True, []):
            elements = getattr(node.parent, "elts", None) or node.parent.args
            src.remove(elements, [node]) if len(elements) > 1 else src.put(*src.span(node), "", node)
        elif isinstance(node, (ast.ListComp, ast.GeneratorExp)) and constant(node.generators[0].iter) == (True, []):
            src.put(*src.span(node), "[]" if isinstance(node, ast.ListComp) else "()", node)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("any", "tuple") and len(node.args) == 1 \
                and (constant(node.args[0]) == (True, []) or isinstance(node.args[0], ast.Tuple)
                     and not node.args[0].elts):
            src.put(*src.span(node), "False" if node.func.id == "any" else "()", node)
        elif isinstance(node, ast.IfExp) and constant(node.test)[0]:
            src.replace(node, node.body if constant(node.test)[1] else node.orelse)
        elif isinstance(node, ast.If) and constant(node.test)[0]:
            body = node.body if constant(node.test)[1] else node.orelse
            src.unwrap(node, body) if body else src.delete(node)
        elif isinstance(node, ast.If) and not node.orelse and all(isinstance(s, ast.Pass) for s in node.body) and \
                pure(node.test) or isinstance(node, ast.For) and constant(node.iter) == (True, []):
            src.delete(node)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and [getattr(t, "id", None) for t in
                                                                                   node.targets] == [node.value.id]:
            src.delete(node)  # x = x
        src.commit()

def fold_operands(src, node):
    """`A and True` -> A, `False or A` -> A, `False and A` -> False, ...; a last operand only where truth is tested."""
    parent, values = node.parent, node.values
    truth = isinstance(parent, (ast.If, ast.While, ast.IfExp, ast.BoolOp, ast.UnaryOp, ast.Assert)) or (
        isinstance(parent, ast.Call) and getattr(parent.func, "id", "") in ("refuse", "bool", "any", "all"))
    neutral = isinstance(node.op, ast.And)  # the value an operand may have and go
    for i, value in enumerate(values):
        known, v = constant(value)
        if known and bool(v) != neutral and (i == 0 or truth and all(map(pure, values[:i]))):
            return src.put(*src.span(node), repr(v), node)  # False and A, or (A pure, its truth tested) A and False
        if known and bool(v) == neutral and (i < len(values) - 1 or truth):
            if i == len(values) - 1:  # with the operator before it
                return src.put(src.outer(values[i - 1])[1], src.outer(value)[1], "", value)
            return src.put(src.outer(value)[0], src.outer(values[i + 1])[0], "", value)  # with the operator after it

def call_sites(src, fn):
    """The calls of `fn` (a method: by its attribute name), or None where it is also used another way."""
    calls = []
    for node in src.live((src.attrs if isinstance(fn.parent, ast.ClassDef) else src.reads).get(fn.name, [])):
        call = node.parent
        if not isinstance(call, ast.Call) or call.func is not node or any(
                isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            return None
        calls.append(call)
    return calls

def argument(call, position, name):
    """What `call` passes for the parameter at `position` (a bound method's `self` not counted) named `name`."""
    return call.args[position] if position < len(call.args) else next(
        (k for k in call.keywords if k.arg == name), None)

def arguments(call):
    return sorted(call.args + call.keywords, key=lambda e: (e.lineno, e.col_offset))

@functools.lru_cache(maxsize=2)
def full_reads(full):
    """{function name: the names it reads} in the full script."""
    reads = {}
    for owner, names in Source(full).owned.items():
        if owner is not None:
            reads.setdefault(owner.name, set()).update(names)
    return reads

def dead_parameters(src, full):
    """Parameters no longer read (the full script's function read them) or always given their default constant:
    removed with what the calls pass, the constant written where the parameter was read."""
    functions = [n for n in src.of(ast.FunctionDef) if n.owner is n and id(n) not in src.dead]
    names = [fn.name for fn in functions]
    for fn in functions:
        method = isinstance(fn.parent, ast.ClassDef)
        if names.count(fn.name) > 1 or fn.name.startswith("__") or any(getattr(d, "id", getattr(d, "attr", "")) in (
                "property", "contextmanager", "staticmethod") for d in fn.decorator_list):
            continue
        calls = call_sites(src, fn)
        if not calls:
            continue
        a = fn.args
        positional = (a.posonlyargs + a.args)[1 if method else 0:]
        defaults = dict(zip([p.arg for p in a.posonlyargs + a.args][::-1], a.defaults[::-1]))
        defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
        edits, assigned = [], None
        for position, p in enumerate(positional + a.kwonlyargs):
            passed = [argument(c, position if position < len(positional) else 10**6, p.arg) for c in calls]
            values = [x.value if isinstance(x, ast.keyword) else x for x in passed]
            loads = src.live(src.owned.get(fn, {}).get(p.arg, []))
            default = defaults.get(p.arg)
            if not loads and p.arg in full_reads(full).get(fn.name, ()):
                value = None
            elif default is not None and constant(default)[0] and not any(map(in_fstring, loads)) and all(
                    v is None or constant(v) == constant(default) and constant(v)[0] for v in values):
                value = src.source(default)
            elif isinstance(default, ast.Name) and default.id.isupper() and all(v is None for v in values):
                value = default.id  # a module constant no call overrides
            else:
                continue
            if assigned is None:  # `x = x or ...`: the reads after it are not the parameter's value
                assigned = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and type(n.ctx) is ast.Store}
            if all(v is None or pure(v) for v in values) and p.arg not in assigned:
                edits.append((p, passed, loads, value))
        if not edits:
            continue
        src.begin()
        elements = [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
                    *([a.kwarg] if a.kwarg else [])]
        for p in elements:  # a parameter's span runs to the end of its default
            if (d := defaults.get(p.arg)) is not None:
                p.end_lineno, p.end_col_offset = d.end_lineno, d.end_col_offset
        src.remove(elements, [p for p, *_ in edits])
        for i, call in enumerate(calls):
            gone = [x for _, passed, *_ in edits if (x := passed[i]) is not None]
            if gone:
                src.remove(arguments(call), gone)
        for p, _, loads, value in edits:
            for n in loads if value is not None else []:
                src.put(*src.span(n), value, n)
        src.commit()

def dead_fields(src):
    """Fields of a dataclass no line reads, removed with what its constructor's calls pass for them."""
    used = {name for name, nodes in src.attrs.items() if src.live(nodes)} | {
        k.arg for n in src.of(ast.Call) if getattr(n.func, "attr", "") == "replace" for k in n.keywords}
    for cls in src.tree.body:
        if not isinstance(cls, ast.ClassDef) or not any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
            continue
        fields = [s for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        calls = [n.parent for n in src.reads.get(cls.name, []) if isinstance(n.parent, ast.Call)]
        for call in calls:
            if len(call.args) > len(fields):  # a field dropped while a call passes it by position
                raise ValueError(f"line {call.lineno}: {cls.name}() given {len(call.args)} values for {len(fields)}")
        if any(k.arg is None for call in calls for k in call.keywords):  # `**fields`: any field may be passed
            continue
        dead = [(i, f) for i, f in enumerate(fields) if f.target.id not in used and id(f) not in src.dead]
        if not dead:
            continue
        src.begin()
        for _, field in dead:
            src.delete(field)
        for call in [n.parent for n in src.live(src.reads.get(cls.name, [])) if isinstance(n.parent, ast.Call)]:
            gone = [x for i, f in dead if (x := argument(call, i, f.target.id)) is not None]
            if gone:
                src.remove(arguments(call), gone)
        src.commit()

def dead_locals(src):
    """A function's assignments of names it reads nowhere but there (pure values), and of a constant it never
    assigns again (written where it is read)."""
    for stmt in src.of(ast.Assign):
        fn = getattr(stmt, "owner", None)
        if fn is None or len(stmt.targets) != 1 or id(stmt) in src.dead:
            continue
        def read(name):  # elsewhere in the function than this statement's value
            return any(not inside(n, stmt.value) for n in src.live(src.owned[fn].get(name, [])))

        target = stmt.targets[0]
        src.begin()
        if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple) and len(target.elts) == len(
                stmt.value.elts) and all(isinstance(t, ast.Name) for t in target.elts):
            kept = [(t, v) for t, v in zip(target.elts, stmt.value.elts) if read(t.id) or not pure(v)]
            if kept and len(kept) < len(target.elts):  # `a, b = x, y` with b read nowhere: `a = x`
                src.put(*src.span(stmt), ", ".join(src.source(t) for t, _ in kept) + " = " + ", ".join(
                    src.source(v) for _, v in kept))
                src.dying |= {id(n) for t, v in zip(target.elts, stmt.value.elts) if (t, v) not in kept
                              for n in ast.walk(v)}
        elif isinstance(target, ast.Name) and not read(target.id) and pure(stmt.value):
            src.delete(stmt)
        elif isinstance(target, ast.Name) and src.stored[fn, target.id] == 1 and isinstance(stmt.value, ast.Constant):
            loads = src.live(src.owned[fn].get(target.id, []))
            if not any(map(in_fstring, loads)):
                src.delete(stmt)
                for n in loads:
                    src.put(*src.span(n), src.source(stmt.value), n)
        src.commit()

def dead_definitions(src):
    """Module-level functions, classes and names nothing else reads, methods no attribute names, imports unread."""
    def unused(names, stmt, index):  # (nothing of the script is looked up by a name in a string)
        return all(n != "main" and all(inside(r, stmt) or index is src.reads and r.owner and (r.owner, n) in src.stored
                                                         for r in src.live(index.get(n, []))) for n in names)

    for stmt in src.tree.body:
        if id(stmt) in src.dead:
            continue
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        names = [stmt.name] if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) else [
            t.id for t in targets if isinstance(t, ast.Name)] if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and (
            stmt.value is None or pure(stmt.value)) and all(isinstance(t, ast.Name) for t in targets) else []
        registered = any(getattr(d, "id", "") == "option" for d in getattr(stmt, "decorator_list", []))
        if names and not registered and unused(names, stmt, src.reads):
            src.begin()
            src.delete(stmt)
            src.commit()
            continue
        if isinstance(stmt, ast.ClassDef) and {ast.unparse(b) for b in stmt.bases if not isinstance(
                b, ast.Name)} <= SAFE_BASES and "Option" not in {getattr(b, "id", "") for b in stmt.bases}:
            for fn in stmt.body:
                if isinstance(fn, ast.FunctionDef) and not fn.name.startswith("__") and unused(
                        [fn.name], fn, src.attrs):
                    src.begin()
                    src.delete(fn)
                    src.commit()
    for stmt in src.of(ast.Import, ast.ImportFrom):
        if getattr(stmt, "module", "") == "__future__" or id(
                stmt) in src.dead:
            continue
        owner = getattr(stmt, "owner", None)
        reads = src.owned.get(owner, {}) if owner is not None else src.reads
        gone = [a for a in stmt.names if not src.live(reads.get(a.asname or a.name.split(".")[0], []))]
        src.begin()
        if len(gone) == len(stmt.names):
            src.delete(stmt)
        elif gone:
            head = "import " if isinstance(stmt, ast.Import) else f"from {'.' * stmt.level}{stmt.module or ''} import "
            src.put(*src.span(stmt), head + ", ".join(ast.unparse(a) for a in stmt.names if a not in gone))
        src.commit()

def tidy(text):
    """Trailing comments of lines over WIDTH moved above them; the blank lines deletions left, shortened."""
    lines = text.splitlines(keepends=True)
    moves = {t.start[0] - 1: t.start[1] for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type == tokenize.COMMENT and len(lines[t.start[0] - 1].rstrip("\n")) > 120
             and lines[t.start[0] - 1][:t.start[1]].strip()}
    for row, col in sorted(moves.items(), reverse=True):
        line = lines[row]
        lines[row:row + 1] = [" " * (len(line) - len(line.lstrip())) + line[col:].rstrip("\n") + "\n",
                              line[:col].rstrip() + "\n"]
    text = re.sub(r"\n{4,}", "\n\n\n", "".join(lines))
    text = re.sub(r"# -{112}\n# [^\n]*\n\n*(?=# -{112}\n|# ={112}\n)", "", text)  # a banner left with no section
    return re.sub(r"\n\n\n(?!# ---|# ===|if __name__)", "\n\n", text)

@functools.lru_cache(maxsize=64)  # the tests ask for the same copies again
def rewrite(text, full, folded):
    """`text` with the seams `folded` folded and what that leaves unused removed, to a fixed point. Within a pass the
    rules run until none finds more (what one removes no longer counts as read for the next); a pass's result is
    parsed again for what only a new parse shows (`not False` where a call was)."""
    while True:
        src = Source(text)
        while True:
            taken = len(src.taken)
            for rule in (lambda: fold_seams(src, folded), lambda: fold_constants(src),
                         lambda: dead_parameters(src, full), lambda: dead_fields(src), lambda: dead_locals(src),
                         lambda: dead_definitions(src)):
                rule()
            if len(src.taken) == taken:
                break
        new = src.apply()
        if new == text:
            return tidy(text)
        text = new

if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as stopped:
        print(f"error: {stopped}" if stopped.code < 128 else str(stopped), file=sys.stderr)
        sys.exit(stopped.code)
    except KeyboardInterrupt as interrupt:  # a second stop signal, or Ctrl-C before training: at once, no traceback
        print("stopped at once; --resume_from_checkpoint latest continues from the last checkpoint", file=sys.stderr)
        sys.exit(interrupt.args[0] if interrupt.args and isinstance(interrupt.args[0], int) else 130)
