"""Every flag is validated before anything loads: a table of values each flag must refuse, kept complete by a test
that enumerates the parser, and damaged checkpoints refused (by path) or skipped (`latest`)."""

import argparse
import json
import logging
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_dreambooth_lora_flux2 as T
from tests.conftest import ROOT, SCRIPT, launch

# Values each numeric or path flag must refuse. Written here, not derived from the script's flag declarations, so a rule
# that is too lax fails. Path tokens: MISSING (nothing there), FILE (a file), FOLDER (a folder), UNDER_FILE (a path
# whose parent is a file: nothing can be created there).
REFUSED = {
    "pretrained_model_name_or_path": ["FILE", "MISSING", "no spaces allowed/in ids"],
    "cache_dir": ["FILE", "UNDER_FILE"],
    "instance_data_dir": ["MISSING", "FILE"],
    "cond_data_dir": ["MISSING", "FILE"],
    "repeats": ["0", "-3", "1.5", "x"],
    "datasets": ["[]", "a folder", "{folder: x}", "[1, 2]", "[unclosed"],  # not a list of entries (entries: test_folders)
    "blocks_to_swap": ["-1", "1.5"],
    "class_data_dir": ["FILE", "UNDER_FILE"],
    "num_class_images": ["0", "-1"],
    "prior_loss_weight": ["-0.5", "nan", "inf"],
    "sample_batch_size": ["0"],
    "prior_generation_precision": ["fp8"],
    "resolution": ["0", "-16", "40", "8192", "512,512", "512,40", "512,", "512;768"],
    "output_preservation_weight": ["-1", "nan"],
    "text_encoder_quantization": ["int4", "fp8"],
    "transformer_quantization": ["nf4", "int4"],
    "adapter": ["lycoris"],
    "lokr_factor": ["0", "-2", "1.5"],
    "lora_format": ["kohya"],
    "validation_prompts_file": ["MISSING", "FOLDER"],
    "validation_lora_scales": ["", "a", "1,,2"],
    "aspect_ratio_buckets": ["32,33", "abc", ";", "0,32"],
    "max_sequence_length": ["0", "-1"],
    "text_encoder_out_layers": ["-1", "3 3", "x"],
    "dataloader_num_workers": ["-1"],
    "precompute_cache_max_gb": ["-1", "nan"],
    "from_manifest": ["MISSING", "FOLDER"],
    "latent_sampling": ["median"],
    "caption_dropout": ["-0.1", "1.5", "nan"],
    "ema_decay": ["1", "-0.1", "1.5"],
    "config": ["MISSING", "FOLDER"],
    "trigger_word": ["", "   ", " sks"],
    "ema_device": ["gpu", "cuda:99"],
    "rank": ["0", "-4"],
    "lora_alpha": ["0", "-1"],
    "lora_dropout": ["1", "-0.5"],
    "lora_layers": [",", ""],  # names are checked against the model: test_..._checked_against_the_models_configs
    "learning_rate": ["0", "-1e-4", "inf", "nan"],
    "lr_scheduler": ["exponential"],
    "lr_warmup_steps": ["-1"],
    "lr_num_cycles": ["0"],
    "lr_power": ["0", "-1"],
    "optimizer": ["sgd"],
    "adam_beta1": ["1", "-0.1"],
    "adam_beta2": ["1.5", "1"],
    "adam_weight_decay": ["-1", "inf"],
    "adam_epsilon": ["0", "-1e-8"],
    "prodigy_beta3": ["1", "-0.5"],
    "prodigy_decouple": ["maybe"],
    "prodigy_use_bias_correction": ["2"],
    "prodigy_safeguard_warmup": ["on?"],
    "max_grad_norm": ["0", "-1"],
    "train_batch_size": ["0", "-1"],
    "num_train_epochs": ["0"],
    "max_train_steps": ["0", "-10"],
    "gradient_accumulation_steps": ["0"],
    "weighting_scheme": ["uniform"],
    "timestep_shift": ["0", "-1", "inf", "sometimes", "1e40", "1e-10"],  # float32 sigmas: NaN beyond (test_learning)
    "logit_mean": ["nan", "inf"],
    "logit_std": ["0", "-1"],
    "mode_scale": ["2", "-1.5", "nan"],
    "guidance_scale": ["-1", "nan"],
    "seed": ["-1", str(2**32), "1.5"],
    "mixed_precision": ["fp8"],
    "attention_backend": ["no_such_kernel", "sage"],
    "bnb_quantization_config_path": ["MISSING", "FOLDER", "nf8"],
    "memory_plan": ["on", "AUTO"],
    "gpu_memory": ["0", "-24GB", "24TB", "GB"],
    "host_memory": ["0GB", "lots"],
    "remote_text_encoder_url": ["ftp://example.com/x", "not a url"],
    "output_dir": ["FILE", "UNDER_FILE"],
    "checkpointing_steps": ["0", "-500"],
    "checkpoints_total_limit": ["0"],
    "resume_from_checkpoint": ["MISSING", "FILE"],
    "report_to": ["tensorbored", "tensorboard,nope"],
    "logging_dir": ["FILE_IN_OUTPUT"],
    "logging_steps": ["0", "-1", "1.5"],
    "validation_image": ["MISSING", "FOLDER", "FILE"],  # FILE: a text file, not an image
    "validation_epochs": ["0"],
    "validation_steps": ["0", "-1"],
    "num_validation_images": ["-1"],
    "validation_batch": ["0"],
    "validation_inference_steps": ["0"],
    "intermediate_inference_steps": ["0", "-1"],
    "validation_transformer": ["FILE", "MISSING", "no spaces allowed/in ids"],  # its files: test_validation
    "transformer_file": ["FILE", "MISSING", "FOLDER", "https://example.com/x.safetensors"],  # its files: test_transformer_file
    "validation_guidance_scale": ["-1", "nan"],
    "validation_metrics": ["dino,size", "DINO", ""],
    "metrics_reference_dir": ["MISSING", "FILE"],
    "metrics_drift_prompts": ["MISSING", "FOLDER"],
    "metrics_dino_model": ["FILE", "MISSING", "no spaces allowed/in ids"],
    "metrics_clip_model": ["FILE", "no spaces allowed/in ids"],
    "keep_best": ["best", "drift"],
    "hub_model_id": ["my lora", "me/my/lora", "me/my--lora", "-lora", "lora.git"],  # the Hub's own rules
    "max_drift": ["-1", "nan"],
}
# Flags that accept any text (prompts, names: the Hub itself is the judge of a revision, and only where it is read)
FREE_TEXT = {"revision", "variant", "dataset_name", "dataset_config_name", "image_column", "caption_column", "cond_image_column",
             "instance_prompt", "class_prompt", "hub_token", "validation_prompt", "final_validation_prompt",
             "class_word", "init_lora"}  # init_lora: a file, folder or Hub file, read (and judged) later
# The copy writer's flags: write_copy() parses them apart from a run and refuses a bad --keep or target by name
# (test_inputs.py, test_copies.py); a training run only refuses them given without --write_copy
COPY_WRITER = {"write_copy", "keep"}
# Flags never refused, and why
NEVER_REFUSED = {"precompute_cache_dir": "the cache never stops a run: a folder it cannot write warns, entries stay in memory"}
# Edge values that must still be accepted: the ranges are not stricter than they say
ACCEPTED = {
    "resolution": ["16", "4096", "512,768,1024", "1024,512"], "caption_dropout": ["0", "1"], "ema_decay": ["0", "0.9999"], "seed": ["0", str(2**32 - 1)],
    "mode_scale": ["-1", "1.75"], "lora_dropout": ["0"], "lr_warmup_steps": ["0"], "num_validation_images": ["0"],
    "precompute_cache_max_gb": ["0"], "prior_loss_weight": ["0"], "logit_mean": ["-3"], "text_encoder_out_layers": ["0 2"],
    "dataloader_num_workers": ["0"], "blocks_to_swap": ["0"], "timestep_shift": ["auto", "pipeline", "none", "3", "1e-7", "1e38"], "report_to": ["none", "all", "tensorboard,wandb"],
    "precompute_cache_dir": ["none", "NEW", "FILE", "UNDER_FILE"], "output_dir": ["NEW"], "resume_from_checkpoint": ["latest"],
    "remote_text_encoder_url": ["http://127.0.0.1:8000/predict"], "ema_device": ["cpu"], "aspect_ratio_buckets": ["32,48;48,32"],
    "pretrained_model_name_or_path": ["black-forest-labs/FLUX.2-dev", "FOLDER"], "lora_layers": ["attention,proj_out"],
    "gpu_memory": ["24GB", "24GiB", "24", "7.5 GB"], "host_memory": ["64gb"],
    "prior_generation_precision": ["no"],  # among the diffusers example's choices: its default precision
    "hub_model_id": ["lora", "me/flux2-dog_lora.v2"],
}


# a setting of an option needs the option on
SWITCHES = {"ema_decay": ["--use_ema"], "ema_device": ["--use_ema"], "gpu_memory": ["--memory_plan", "auto"],
            "host_memory": ["--memory_plan", "auto"],
            "remote_text_encoder_url": ["--text_encoder_quantization", "int8"]}


def _actions():
    return [a for a in T.build_parser()._actions if a.dest != "help"]


@pytest.fixture
def places(tmp_path):
    (tmp_path / "file.txt").write_text("a file, not a folder\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "images").mkdir()
    return {"MISSING": str(tmp_path / "missing"), "FILE": str(tmp_path / "file.txt"),
            "FOLDER": str(tmp_path / "folder"), "UNDER_FILE": str(tmp_path / "file.txt" / "sub"),
            "NEW": str(tmp_path / "new" / "folder"), "images": str(tmp_path / "images"), "out": str(tmp_path / "out")}


def _validate(places, flag, value):
    """validate_args on a valid command with `--flag value` (a UsageError is the script's exit 2) -> the value as
    given on the command line."""
    if value == "FILE_IN_OUTPUT":  # --logging_dir is relative to --output_dir
        Path(places["out"]).mkdir(exist_ok=True)
        (Path(places["out"]) / "logs-file").write_text("")
        value = "logs-file"
    value = places.get(value, value)
    argv = ["--pretrained_model_name_or_path", "nobody/tiny-model", "--instance_data_dir", places["images"],
            "--instance_prompt", "a photo of sks dog", "--output_dir", places["out"]]
    # --flag=value: argparse takes "-1e-4" after a space for an option (its message then names no value)
    argv += [f"--{flag}", *value.split(" ")] if flag == "text_encoder_out_layers" else [f"--{flag}={value}"]
    argv += SWITCHES.get(flag, [])  # what turns the flag's option on (without it the flag is refused)
    T.validate_args(T.parse_args(argv))
    return value


def test_every_flag_says_what_it_accepts_in_its_declaration_and_has_a_row_here():
    """A new flag fails here until its declaration says what it accepts (a type= rule, choices, or a switch) and this
    file says what it must refuse (REFUSED), or that it is free text."""
    for action in _actions():
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        categories = REFUSED, FREE_TEXT, NEVER_REFUSED, COPY_WRITER
        assert sum(action.dest in c for c in categories) + switch == 1, action.dest
        if action.dest in REFUSED:  # numbers, choices, paths: the declaration holds the rule
            assert isinstance(action.type, T.Accepts) or action.choices, action.dest
        if action.dest in FREE_TEXT:
            assert action.type is None and not action.choices, action.dest


def test_help_shows_every_flags_rule_and_default_and_lists_only_what_it_accepts():
    """--help: every flag has one or two sentences of help, its default (or what happens without it), and what it
    accepts, which is the rule its value is checked against."""
    helps = {a.dest: T._HelpFormatter("x")._get_help_string(a) % {"default": a.default} for a in _actions()}
    for action in _actions():
        text = helps[action.dest]
        assert action.help and action.help.count(". ") <= 2 and len(action.help) <= 240, action.dest
        if isinstance(action.type, T.Accepts):
            assert f"Accepts {action.type.what}." in text, action.dest
        if action.default is not None and action.default is not False:
            assert f"Default: {action.default}." in text, action.dest
        elif isinstance(action, argparse._StoreTrueAction):
            assert "Default" not in text, action.dest  # a switch is off unless given
        elif not action.required:
            assert "Default: none." in text or "default: " in action.help, action.dest  # or what its absence means
    parser = T.build_parser()
    backends = next(a for a in _actions() if a.dest == "attention_backend").type.what
    listed = backends.split(": ")[1].split(", ")
    assert set(listed) == set(T.TRAINING_ATTENTION_BACKENDS) - set(T.BROKEN_ATTENTION_BACKENDS)
    trackers = next(a for a in _actions() if a.dest == "report_to")
    for tracker in T.TRACKERS:  # every tracker the help names is accepted
        assert tracker in trackers.type.what and parser.parse_args(["--pretrained_model_name_or_path", "m", "--report_to", tracker])
    out = launch(["--help"], check=False, timeout=300)
    words = " ".join(out.stdout.split())  # argparse wraps the help at the terminal's width
    assert out.returncode == 0 and "Default: 512." in words and "Accepts an integer >= 1." in words


def test_docs_flags_table_is_generated_from_the_parser():
    """docs/flags.md is tests/flags_doc.py's rendering of the parser; run `make docs` after changing a flag."""
    from tests.flags_doc import DOC, render

    assert DOC.read_text(encoding="utf-8") == render(), "docs/flags.md is stale: run `make docs`"


def test_a_valid_command_passes(places):
    _validate(places, "repeats", "2")


@pytest.mark.parametrize("flag, value", [(f, v) for f, values in REFUSED.items() for v in values])
def test_bad_value_is_refused_naming_the_flag_and_the_value(flag, value, places):
    shown = {"FILE_IN_OUTPUT": "logs-file"}.get(value, places.get(value, value))
    with pytest.raises(T.UsageError) as refused:
        _validate(places, flag, value)
    message = str(refused.value)
    assert f"--{flag}" in message and "\n" not in message, message
    assert shown in message or (_number(shown) is not None and str(_number(shown)) in message), message


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None


@pytest.mark.parametrize("flag, value", [(f, v) for f, values in ACCEPTED.items() for v in values])
def test_edge_values_are_accepted(flag, value, places):
    _validate(places, flag, value)


def test_lora_layers_and_text_encoder_layers_are_checked_against_the_models_configs(tiny_model, places, caplog):
    from accelerate import PartialState

    PartialState()
    args = T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--instance_data_dir", places["images"],
                         "--instance_prompt", "p", "--text_encoder_out_layers", "1", "2"])
    T.check_model_fit(args)  # the tiny model's own layers fit
    for layers, message in ((["1", "9"], "this text encoder has layers 0 to 2"),
                            (["0", "1", "2"], "3 layers of width 16 make 48 features; this transformer takes 32")):
        args.text_encoder_out_layers = [int(v) for v in layers]
        with pytest.raises(T.UsageError, match=message):
            T.check_model_fit(args)
    args.text_encoder_out_layers, args.lora_layers = [1, 2], "no_such_module"
    with pytest.raises(T.UsageError, match="--lora_layers no_such_module"):
        T.check_model_fit(args)


def test_a_sourceless_run_needs_no_text_encoder_not_even_its_config(tiny_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    shutil.rmtree(model / "text_encoder")
    args = T.parse_args(["--pretrained_model_name_or_path", str(model), "--instance_data_dir", str(tmp_path),
                         "--instance_prompt", "p", "--text_encoder_out_layers", "1", "2"])
    with pytest.raises(T.UsageError, match="cannot read its text_encoder config"):
        T.check_model_fit(args)
    args.from_manifest = str(tmp_path / "dataset_manifest.json")
    T.check_model_fit(args)  # the manifest's prompt identity pins the layers


@pytest.mark.parametrize("extra, warning", [
    (["--caption_dropout", "0.8"], "most instance samples train on the empty prompt"),
    (["--with_prior_preservation", "--class_prompt", "c", "--class_data_dir", "c", "--prior_loss_weight", "0"],
     "their loss counts for nothing"),
    (["--class_prompt", "a dog"], "without --with_prior_preservation"),
    (["--output_preservation", "--trigger_word", "s", "--class_word", "d", "--output_preservation_weight", "0"],
     "counts for nothing"),
    (["--max_sequence_length", "8"], "captions are cut short or away"),
    (["--resolution", "3072"], "beyond FLUX.2's 4-megapixel range"),
    (["--learning_rate", "0.05"], "usually diverge above 1e-2"),
    (["--optimizer", "prodigy", "--learning_rate", "1e-4"], "usually 1.0"),
    (["--dataloader_num_workers", "4096"], "more workers than"),
    (["--max_train_steps", "100", "--checkpointing_steps", "500"], "no checkpoint is written before the end"),
    (["--max_train_steps", "100", "--checkpointing_steps", "50", "--lr_scheduler", "cosine", "--lr_warmup_steps", "500"],
     "never reaches its peak"),
    (["--validation_prompt", "v", "--num_validation_images", "0"], "no validation images are made"),
    (["--rank", "512"], "trains like a full fine-tune"),
    (["--validation_prompt", "v", "--final_validation_prompt", "f"], "--final_validation_prompt is ignored"),
    (["--validation_image", "IMAGE"], "--validation_image without a validation prompt"),
    (["--do_fp8_training"], "2.1 to 2.3 times slower than bf16"),  # measured eager (docs/speed.md); compiled: not measured
])
def test_legal_but_surprising_values_get_one_warning(extra, warning, tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "x.png")
    extra = [str(tmp_path / "x.png") if a == "IMAGE" else a for a in extra]
    base = ["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir", "."]
    notes = T.surprising_values(T.parse_args([*base, *extra]))
    assert len(notes) == 1 and warning in notes[0], notes
    assert T.surprising_values(T.parse_args(base)) == []  # the defaults surprise nobody
    if extra == ["--do_fp8_training"]:  # compiled fp8 was not measured slower: no warning
        assert T.surprising_values(T.parse_args([*base, *extra, "--compile"])) == []


@pytest.mark.slow
def test_a_bad_flag_exits_2_with_one_line_before_anything_loads(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--pretrained_model_name_or_path", "nobody/model",
                           "--instance_data_dir", str(tmp_path), "--instance_prompt", "p", "--repeats", "0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --repeats 0: expected an integer >= 1", proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPT), "--pretrained_model_name_or_path", "nobody/model",
                           "--instance_data_dir", str(tmp_path), "--instance_prompt", "p", "--repeats", "x"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --repeats x: expected an integer >= 1", proc.stderr


@pytest.mark.parametrize("flag, value, what", [("gpu_memory", "24000MB", "a size up to 1024 GiB, e.g. 24GB or "
                                                                "24564MiB (a bare number is read in GiB)"),
                                               ("seed", "1.5", "an integer from 0 to 4294967295"),
                                               ("timestep_shift", "sometimes", "none, auto, pipeline or a number from 1e-7 to 1e38")])
def test_a_value_that_is_not_even_of_the_flags_kind_is_told_what_it_accepts(flag, value, what, places):
    """argparse said "invalid memory_size value" (a function's name): the refusal says what the flag takes instead."""
    with pytest.raises(T.UsageError, match=f"^--{flag} {value}: expected {re.escape(what)}$"):
        _validate(places, flag, value)


def test_a_flag_is_read_only_by_its_full_name_and_keep_is_named_with_write_copy():
    """argparse's prefixes read --keep as --keep_best ("invalid choice: 'ema'", or "--keep_best has no effect"): a
    training command refuses --keep naming --write_copy (the copies option's check of its settings), and an
    abbreviation as an unknown flag."""
    base = ["--pretrained_model_name_or_path", "m", "--instance_data_dir", ".", "--instance_prompt", "p"]
    for keep in (["--keep", "ema"], ["--keep", "subject"], ["--keep=subject"], ["--seed", "1", "--keep", "all"]):
        with pytest.raises(T.UsageError, match=r"^--keep has no effect without --write_copy FILE$"):
            T.validate_args(T.parse_args([*base, *keep]))
    with pytest.raises(T.UsageError, match=r"^unrecognized arguments: --max_train 5 \(see --help\)$"):
        T.parse_args([*base, "--max_train", "5"])
    assert T.parse_args([*base, "--max_train_steps=5", "--keep_best", "subject"]).max_train_steps == 5


def test_the_diffusers_examples_command_line_parses_as_before(monkeypatch, tmp_path):
    """Switches take an optional true or false (to undo a --config file's true): the diffusers example's README gives
    them bare, each followed by another flag (its first command, /work/shared/reference/diffusers-README_flux2.md)."""
    command = shlex.split("""--pretrained_model_name_or_path=m --instance_data_dir=. --output_dir=out
        --do_fp8_training --gradient_checkpointing --remote_text_encoder --cache_latents
        --instance_prompt="a photo of sks dog" --resolution=1024 --train_batch_size=1 --guidance_scale=1 --use_8bit_adam
        --gradient_accumulation_steps=4 --optimizer="adamW" --learning_rate=1e-4 --report_to="wandb"
        --lr_scheduler="constant" --lr_warmup_steps=100 --max_train_steps=500
        --validation_prompt="A photo of sks dog in a bucket" --validation_epochs=25 --seed="0" --push_to_hub""")
    monkeypatch.chdir(tmp_path)
    args = T.parse_args(command)
    switches = [a[2:] for a in command if "=" not in a]
    assert len(switches) == 6 and all(vars(args)[name] is True for name in switches)
    assert (args.instance_prompt, args.resolution, args.optimizer) == ("a photo of sks dog", 1024, "adamw")


# ---------------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture
def checkpoints(checkpoint_run, tmp_path):
    """An output folder with whole checkpoints at steps 2 and 4, written by save_checkpoint; -> (args, run parts)."""
    accelerator, run = checkpoint_run
    out = tmp_path / "out"
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir", ".",
                         "--output_dir", str(out)])
    out.mkdir()  # main() makes it before training
    T.save_checkpoint(args, accelerator, run, 2)
    T.save_checkpoint(args, accelerator, run, 4)
    return args, accelerator, run


def _damage(folder, how):
    if how == "missing training.safetensors":
        (folder / "training.safetensors").unlink()
    elif how == "training.json not JSON":
        (folder / "training.json").write_text("{'optimizer': ")
    elif how == "trainer_state.json without a step":
        (folder / T.TRAINER_STATE_NAME).write_text(json.dumps({"seed": 0}))
    elif how == "training.safetensors cut short":
        data = (folder / "training.safetensors").read_bytes()
        (folder / "training.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "rng-0.json unreadable":  # root reads any file: a folder where the file should be cannot be read
        (folder / "rng-0.json").unlink()
        (folder / "rng-0.json").mkdir()
    elif how == "a tensor missing from training.safetensors":
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "training.safetensors"))
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, str(folder / "training.safetensors"))
    else:
        raise ValueError(how)


DAMAGE = {"missing training.safetensors": "training.safetensors is missing",
          "training.json not JSON": "training.json is damaged",
          "trainer_state.json without a step": "trainer_state.json has no global_step and seed",
          "training.safetensors cut short": "training.safetensors is damaged",
          "rng-0.json unreadable": "rng-0.json cannot be read",
          "a tensor missing from training.safetensors": "training.safetensors lacks 1 tensors"}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_is_refused_by_path_and_skipped_by_latest(how, checkpoints, caplog):
    args, _, _ = checkpoints
    out = Path(args.output_dir)
    assert T.checkpoint_problem(out / "checkpoint-4") is None
    _damage(out / "checkpoint-4", how)
    args.resume_from_checkpoint = str(out / "checkpoint-4")
    with pytest.raises(T.UsageError) as refused:
        T.find_resume_checkpoint(args)
    assert str(refused.value).startswith(f"--resume_from_checkpoint {out / 'checkpoint-4'}: a damaged checkpoint: ")
    assert DAMAGE[how] in str(refused.value) and "\n" not in str(refused.value)
    args.resume_from_checkpoint = "latest"
    with caplog.at_level(logging.WARNING):
        assert T.find_resume_checkpoint(args) == out / "checkpoint-2"
    assert f"skipping {out / 'checkpoint-4'}: {DAMAGE[how]}" in caplog.text
    _damage(out / "checkpoint-2", how)
    with pytest.raises(T.UsageError, match="none of the 2 checkpoints .* can be resumed from"):
        T.find_resume_checkpoint(args)


def test_a_checkpoint_of_another_rank_or_targets_is_refused_before_anything_changes(checkpoints, tiny_model):
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig

    args, accelerator, run = checkpoints
    checkpoint = Path(args.output_dir, "checkpoint-4")
    assert T.load_checkpoint(checkpoint, accelerator, run) == 4  # the same run resumes
    for config, problem in ((LoraConfig(r=4, target_modules=["to_q"]), "of another shape"),
                            (LoraConfig(r=2, target_modules=["to_q", "to_k"]), "tensors missing")):
        transformer = Flux2Transformer2DModel.from_pretrained(tiny_model, subfolder="transformer")
        T.add_lora(transformer, config)
        before = {n: p.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad}
        other = T.dataclasses.replace(run, transformer=transformer, optimizer=torch.optim.AdamW(before.values()))
        with pytest.raises(T.UsageError, match=f"--resume_from_checkpoint {checkpoint}: its LoRA does not fit .*{problem}"):
            T.load_checkpoint(checkpoint, accelerator, other)
        after = dict(transformer.named_parameters())
        assert all(torch.equal(after[n], v) for n, v in before.items())
    params = list(run.named_params.values())  # the same LoRA, its optimizer in two parameter groups
    split = T.dataclasses.replace(run, optimizer=torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}]))
    with pytest.raises(T.UsageError, match=r"its optimizer holds \[\d+\] parameters per group"):
        T.load_checkpoint(checkpoint, accelerator, split)


def test_state_fit_problem_names_missing_unexpected_and_resized_tensors():
    saved = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "extra": torch.zeros(1)}
    problem = T.state_fit_problem(saved, {"a": (2, 3), "b": (5,), "c": (1,)})
    assert problem == ("1 tensors missing (e.g. c); 1 it has and this model has not (e.g. extra); "
                       "1 of another shape (e.g. b (4,) vs (5,))")
    assert T.state_fit_problem(saved, {k: v.shape for k, v in saved.items()}) is None
    # FSDP1's flat shards have no full shape: names are compared, shapes are not
    assert T.state_fit_problem(saved, {"a": None, "b": None, "extra": None}) is None
    assert T.state_fit_problem(saved, {"a": None, "b": None}) == "1 it has and this model has not (e.g. extra)"


def test_latest_without_checkpoints_starts_from_scratch(tmp_path, caplog):
    from accelerate import PartialState

    PartialState()
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir", ".",
                         "--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])
    with caplog.at_level(logging.WARNING):
        assert T.find_resume_checkpoint(args) is None
    assert "no checkpoint in" in caplog.text


def test_an_incomplete_checkpoint_is_refused_by_path_and_passed_over_by_latest(checkpoints, caplog):
    """Killed while writing: no trainer_state.json (written last), or still named checkpoint-N.partial."""
    args, _, _ = checkpoints
    out = Path(args.output_dir)
    (out / "checkpoint-4" / T.TRAINER_STATE_NAME).unlink()
    (out / "checkpoint-6.partial").mkdir()
    args.resume_from_checkpoint = str(out / "checkpoint-4")
    with pytest.raises(T.UsageError, match="checkpoint-4: not a complete checkpoint .no trainer_state.json."):
        T.find_resume_checkpoint(args)
    args.resume_from_checkpoint = "latest"
    with caplog.at_level(logging.WARNING):
        assert T.find_resume_checkpoint(args) == out / "checkpoint-2"
    assert f"{out / 'checkpoint-4'} is incomplete" in caplog.text and f"{out / 'checkpoint-6.partial'} is incomplete" in caplog.text


def test_a_validation_image_with_a_prompts_file_is_not_called_unvalidated(tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "x.png")
    (tmp_path / "prompts.txt").write_text("a photo of sks dog\n")
    base = ["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir", ".",
            "--validation_image", str(tmp_path / "x.png")]
    assert T.surprising_values(T.parse_args([*base, "--validation_prompts_file", str(tmp_path / "prompts.txt")])) == []
