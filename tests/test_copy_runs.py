"""Each single-option copy trains (issue 51): `--write_copy FILE --keep NAME` for every option, each copy run on the
tiny model with the smallest run that turns its option on, and one effect of the option seen in what the run did.

Runs launch the copy as a script (forked from the zygote, as every tiny run), except three that run the copy's
main() in this process, where the test can reach into it: block_swap (it needs CUDA: its check is lifted, as
tests/test_swap.py lifts it), attention (the kernel's calls are counted, as tests/test_speed.py counts them) and
prodigy (prodigyopt is not installed: tests/test_paths.py's stand-in). fsdp runs two processes with accelerate's FSDP
forced on the CPU (tests/test_fsdp.py); compile trains with 8-bit AdamW (--compile's inductor is minutes on a cold
CPU); memory_plan plans for a card given with --gpu_memory (no GPU here), then trains.

test_parts.py trains the copy without options to the full script's LoRA; test_copies.py checks every copy's text.
"""

import json
import logging
import shutil

import pytest
import torch
import yaml
from PIL import Image, ImageOps
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import ROOT, base_args, launch
from tests.test_cache import _sourceless, entries
from tests.test_copies import load_copy, write_copies
from tests.test_edit import _picture, edit_args
from tests.test_folders import _two_folders
from tests.test_fsdp import FORCE_FSDP, FSDP_ENV
from tests.test_inputs import _dataset_folder
from tests.test_paths import fake_prodigy  # noqa: F401  (a fixture: prodigy's run asks for it)
from tests.tiny_flux2 import make_images, write_bfl_transformer
from tests.tiny_metrics import build_tiny_dino

NAMES = [o.name for o in T.OPTIONS]
LORA = T.LORA_WEIGHTS_NAME
ONE_STEP = ("--max_train_steps", "1")
RUNS = {}  # option name -> its run: (copy, model, images, tmp_path, request) -> None, asserting the option's effect


def run_of(name):
    def register(function):
        RUNS[name] = function
        return function
    return register


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """{option: the copy keeping only it (and what it needs)}."""
    return write_copies(tmp_path_factory, "single-option-copies", NAMES)


@pytest.fixture(scope="module")
def shared_images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("copy-runs") / "images"
    make_images(str(folder))
    return folder


def test_every_option_has_a_run():
    assert sorted(RUNS) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_single_option_copy_trains_its_smallest_run(name, copies, tiny_model, shared_images, tmp_path, request):
    RUNS[name](copies[name], tiny_model, shared_images, tmp_path, request)


def in_process(copy, request, argv, patch=None):
    """The copy's main(argv) in this process, `patch(module)` first (a fresh module each time) -> the log."""
    request.getfixturevalue("fresh_accelerate")
    caplog = request.getfixturevalue("caplog")
    module = load_copy(copy.read_text(), copy)
    if patch:
        patch(module)
    caplog.set_level(logging.INFO)
    module.main([str(a) for a in argv])
    return caplog.text


@run_of("config")
def run_config(copy, model, images, tmp_path, request):
    """--config: the file's --rank 3 becomes the LoRA's rank (the command line gives the rest)."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"rank": 3, "max_train_steps": 1}))
    launch(base_args(model, images, tmp_path / "out", "--config", tmp_path / "run.yaml"), script=copy)
    downs = [v for k, v in load_file(str(tmp_path / "out" / LORA)).items() if "lora_A" in k]
    assert downs and all(v.shape[0] == 3 for v in downs)
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["rank"] == 3


@run_of("dataset")
def run_dataset(copy, model, images, tmp_path, request):
    """--dataset_name: a local imagefolder's four rows and their captions are what trains."""
    folder = _dataset_folder(tmp_path / "ds", [(f"{c}.png", None) for c in "abcd"])
    args = base_args(model, folder, tmp_path / "out", *ONE_STEP, "--caption_column", "text", "--cache_dir",
                     tmp_path / "hf")
    args[args.index("--instance_data_dir")] = "--dataset_name"
    proc = launch(args, script=copy)
    assert "4 samples" in proc.stderr and "4 unique prompts" in proc.stderr, proc.stderr[-3000:]


@run_of("folders")
def run_folders(copy, model, images, tmp_path, request):
    """--datasets: two folders, the first repeated twice, are 3 x 2 + 3 samples, each folder listed."""
    a, b = _two_folders(tmp_path)
    args = base_args(model, a, tmp_path / "out", *ONE_STEP, "--datasets", json.dumps(
        [{"folder": str(a), "repeats": 2}, {"folder": str(b), "prompt": "a photo of a dog"}]))
    i = args.index("--instance_data_dir")
    proc = launch(args[:i] + args[i + 2:], script=copy)
    assert "9 samples" in proc.stderr and f"- `{b}`: 3 images, repeats 1, prompt `a photo of a dog`" in proc.stderr


@run_of("masked_loss")
def run_masked_loss(copy, model, images, tmp_path, request):
    """--masked_loss with an all-black mask beside every image: nothing trains (loss 0, every LoRA B stays zero)."""
    folder = tmp_path / "images"
    for path in make_images(str(folder)):
        with Image.open(path) as image:
            Image.new("L", image.size, 0).save(path.rsplit(".", 1)[0] + "_mask.png")
    proc = launch(base_args(model, folder, tmp_path / "out", *ONE_STEP, "--masked_loss"), script=copy)
    assert "step 1/1 loss 0.0000" in proc.stderr, proc.stderr[-3000:]
    ups = [v for k, v in load_file(str(tmp_path / "out" / LORA)).items() if "lora_B" in k]
    assert ups and all(not v.any() for v in ups)


@run_of("disk_cache")
def run_disk_cache(copy, model, images, tmp_path, request):
    """--precompute_cache_dir: the prompts and latents are entries there."""
    launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--cache_latents", "--precompute_cache_dir",
                     tmp_path / "cache"), script=copy)
    found = entries(tmp_path / "cache")
    assert any(e.startswith("prompts/") for e in found) and any(e.startswith("latents/") for e in found), found


@run_of("manifest")
def run_manifest(copy, model, images, tmp_path, request):
    """A run writes dataset_manifest.json; --from_manifest trains from it and the cache alone, the images deleted, to
    the same LoRA."""
    images, common = tmp_path / "images", [*ONE_STEP, "--cache_latents", "--precompute_cache_dir", tmp_path / "cache"]
    make_images(str(images))
    launch(base_args(model, images, tmp_path / "first", *common), script=copy)
    shutil.rmtree(images)
    manifest = tmp_path / "first" / T.MANIFEST_NAME
    proc = launch(_sourceless(base_args(model, images, tmp_path / "second", *common), manifest), script=copy)
    assert f"--from_manifest {manifest}: 6 instance images and 0 more" in proc.stderr
    a, b = (load_file(str(tmp_path / out / LORA)) for out in ("first", "second"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@run_of("class_images")
def run_class_images(copy, model, images, tmp_path, request):
    """--with_prior_preservation with an empty --class_data_dir: the base model generates the class image."""
    proc = launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--with_prior_preservation",
                            "--class_data_dir", tmp_path / "class", "--class_prompt", "a photo of a dog",
                            "--num_class_images", "1"), script=copy)
    assert "generating 1 class images" in proc.stderr
    assert [p.name for p in (tmp_path / "class").iterdir()] == ["class-00000.png"]


@run_of("edit")
def run_edit(copy, model, images, tmp_path, request):
    """--cond_data_dir: each target trains with its same-stem condition image (64 px: the pipelines' least)."""
    targets, conds = tmp_path / "targets", tmp_path / "conds"
    targets.mkdir()
    conds.mkdir()
    for i in range(2):
        _picture(64, 64, i).save(targets / f"p{i}.png")
        ImageOps.invert(_picture(64, 64, i)).save(conds / f"p{i}.png")
    proc = launch(edit_args(model, targets, conds, tmp_path / "out", *ONE_STEP), script=copy)
    assert "edit training: 2 condition images for 2 targets, 1 per target" in proc.stderr


@run_of("ema")
def run_ema(copy, model, images, tmp_path, request):
    """--use_ema: the LoRA is the average, the last raw weights beside it."""
    proc = launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--use_ema"), script=copy)
    assert (tmp_path / "out" / T.RAW_LORA_WEIGHTS_NAME).is_file() and "LoRA weights are the EMA" in proc.stderr


@run_of("hub")
def run_hub(copy, model, images, tmp_path, request):
    """--hub_model_id without --push_to_hub (no network): the model card loads the LoRA from that repository."""
    launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--hub_model_id", "someone/dog-lora"), script=copy)
    assert "pipe.load_lora_weights('someone/dog-lora'" in (tmp_path / "out" / "README.md").read_text()


@run_of("adapters")
def run_adapters(copy, model, images, tmp_path, request):
    """--adapter lokr: the file holds LoKr's factors, no LoRA's."""
    launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--adapter", "lokr"), script=copy)
    keys = load_file(str(tmp_path / "out" / LORA)).keys()
    assert any("lokr_w1" in k for k in keys) and not any("lora_A" in k for k in keys)


@run_of("trigger_words")
def run_trigger_words(copy, model, images, tmp_path, request):
    """--trigger_word fills [trigger] in the instance prompt and goes before the captions lacking it."""
    proc = launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--trigger_word", "sks", "--instance_prompt",
                            "a photo of [trigger] dog"), script=copy)
    assert "trigger word `sks`" in proc.stderr
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["instance_prompt"] == "a photo of sks dog"


@run_of("text_encoders")
def run_text_encoders(copy, model, images, tmp_path, request):
    """--text_encoder_quantization int8 (torchao, on the CPU): other embeddings, so another LoRA than the copy's own
    float32 run."""
    for out, extra in (("int8", ["--text_encoder_quantization", "int8"]), ("fp32", [])):
        launch(base_args(model, images, tmp_path / out, *ONE_STEP, *extra), script=copy)
    a, b = (load_file(str(tmp_path / out / LORA)) for out in ("int8", "fp32"))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)


@run_of("prodigy")
def run_prodigy(copy, model, images, tmp_path, request):
    """--optimizer prodigy: the optimizer is prodigyopt's, built with the Prodigy flags (a stand-in package)."""
    made = request.getfixturevalue("fake_prodigy")
    in_process(copy, request, base_args(model, images, tmp_path / "out", *ONE_STEP, "--optimizer", "prodigy",
                                        "--learning_rate", "1.0", "--prodigy_decouple", "false"))
    assert len(made) == 1 and made[0]["lr"] == 1.0 and made[0]["decouple"] is False
    assert (tmp_path / "out" / LORA).is_file()


@run_of("fsdp")
def run_fsdp(copy, model, images, tmp_path, request):
    """Two processes under accelerate's FSDP (forced on the CPU, as tests/test_fsdp.py does), loading lean: process 1
    builds an empty transformer; the LoRA saved is gathered whole from the shards."""
    (tmp_path / "force").mkdir()
    (tmp_path / "force" / "sitecustomize.py").write_text(FORCE_FSDP)
    env = {**FSDP_ENV, "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "PYTHONPATH": f"{tmp_path / 'force'}:{ROOT}"}
    proc = launch(base_args(model, images, tmp_path / "out", *ONE_STEP), num_processes=2, env=env, script=copy)
    assert "FSDP (each process holds a shard of the model) over 2 processes" in proc.stderr
    assert "process 1: an empty transformer" in proc.stderr
    lora = load_file(str(tmp_path / "out" / LORA))  # rank 4: a shard over 2 processes would hold 2 rows
    assert lora and all(v.shape[0 if "lora_A" in k else 1] == 4 for k, v in lora.items())


@run_of("block_swap")
def run_block_swap(copy, model, images, tmp_path, request):
    """--blocks_to_swap 2 (both blocks of the tiny transformer), its CUDA requirement lifted for the CPU: the step
    loads and evicts swapped blocks."""
    done = []

    def patch(module):
        carry_out = module.BlockSwapper.carry_out
        module.BlockSwapping.check = lambda self: None
        module.BlockSwapper.carry_out = lambda self, actions: done.extend(actions) or carry_out(self, actions)

    log = in_process(copy, request, base_args(model, images, tmp_path / "out", *ONE_STEP, "--blocks_to_swap", "2",
                                              "--gradient_checkpointing"), patch)
    assert "block swapping: the frozen weights of the last 2 of 2 blocks stay in pinned host memory" in log
    assert {"load", "evict"} <= {action for action, _ in done} and (tmp_path / "out" / LORA).is_file()


@run_of("attention")
def run_attention(copy, model, images, tmp_path, request):
    """--attention_backend _native_math: training's attention runs through that kernel."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    calls, kernel = [], _AttentionBackendRegistry._backends[AttentionBackendName._NATIVE_MATH]
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setitem(_AttentionBackendRegistry._backends, AttentionBackendName._NATIVE_MATH,
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    # the run sets diffusers' process-wide active backend too: restored, or later tests here would run _native_math
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend)
    in_process(copy, request, base_args(model, images, tmp_path / "out", *ONE_STEP, "--attention_backend",
                                        "_native_math"))
    assert len(calls) >= 2 and (tmp_path / "out" / LORA).is_file()  # a double- and a single-stream block


@run_of("compile")
def run_compile(copy, model, images, tmp_path, request):
    """--use_8bit_adam, the option's lever a CPU runs in seconds (--compile's cold inductor compile took 196 s on this
    2-core machine; tests/test_speed.py compiles the full script): the checkpoint's optimizer state is bitsandbytes'."""
    launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--use_8bit_adam", "--checkpointing_steps", "1"),
           script=copy)
    state = load_file(str(tmp_path / "out" / "checkpoint-1" / "training.safetensors"))
    assert any(".optimizer.state." in k and "__bnb_optimizer_quant_state__" in k for k in state), sorted(state)[-4:]


@run_of("int8_weights")
def run_int8_weights(copy, model, images, tmp_path, request):
    """--transformer_quantization int8: the model card says the weights were int8 (tests/test_int8.py trains it)."""
    launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--transformer_quantization", "int8"), script=copy)
    assert "linear weights in int8" in (tmp_path / "out" / "README.md").read_text()


@run_of("copies")
def run_copies(copy, model, images, tmp_path, request):
    """--write_copy from the copy that kept the copy writer: a copy without options, which trains (its text:
    test_copies.py checks it equals the full script's own none copy)."""
    launch(["--write_copy", tmp_path / "none.py"], script=copy)
    launch(base_args(model, images, tmp_path / "out", *ONE_STEP), script=tmp_path / "none.py")
    assert (tmp_path / "out" / LORA).is_file() and "class Hooks" not in (tmp_path / "none.py").read_text()


@run_of("validation_extras")
def run_validation_extras(copy, model, images, tmp_path, request):
    """--validation_lora_scales 0,1: the final validation shows the prompt at both strengths."""
    launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--validation_prompt", "a photo of sks dog",
                     "--num_validation_images", "1", "--validation_lora_scales", "0,1"), script=copy)
    names = {p.name for p in (tmp_path / "out" / "validation").iterdir()}
    assert {"final-0.png", "final-1.png"} <= names and "final-2.png" not in names


@run_of("transformer_file")
def run_transformer_file(copy, model, images, tmp_path, request):
    """--transformer_file (the tiny [dev]'s transformer in BFL's layout): the transformer loads from it, and
    config.yaml records its SHA-256."""
    path = write_bfl_transformer(model, tmp_path / "bfl.safetensors")
    proc = launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--transformer_file", path), script=copy)
    assert f"loading the transformer from {path}" in proc.stderr
    assert len(yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["transformer_file_sha256"]) == 64


@run_of("validation_transformer")
def run_validation_transformer(copy, model, images, tmp_path, request):
    """--validation_transformer (the tiny [dev] itself: a checkpoint of the same shape): loaded once, it makes the
    base and final images in the --validation_inference_steps given (2; its pipeline's 50 were used without a word),
    and the model card says so."""
    proc = launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--validation_prompt", "a photo of sks dog",
                            "--num_validation_images", "1", "--validation_transformer", model), script=copy)
    assert f"validation on {model} (FLUX.2 [dev]: 2 steps)" in proc.stderr
    assert {"base-0.png", "final-0.png"} <= {p.name for p in (tmp_path / "out" / "validation").iterdir()}
    assert f"made on {model} (FLUX.2 [dev], 2 steps)" in (tmp_path / "out" / "README.md").read_text()


@run_of("memory_plan")
def run_memory_plan(copy, model, images, tmp_path, request):
    """--memory_plan auto for an 80 GB card (no GPU here: --gpu_memory), then the run it planned. The tiny model's
    text encoder (1 GiB of activations counted) sets the least card, where both training rows fit: the plan adds
    nothing, and says so."""
    proc = launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--memory_plan", "auto", "--gpu_memory",
                            "80GB", "--host_memory", "64GB"), script=copy)
    assert "memory plan: FLUX.2 [dev], 32 px, batch 1, rank 4, on 80.0 GiB of GPU memory" in proc.stderr
    assert "flags: (none added)" in proc.stderr and (tmp_path / "out" / LORA).is_file()


@run_of("metrics")
def run_metrics(copy, model, images, tmp_path, request):
    """--validation_metrics dino: the base and final validations scored for the subject (a tiny random DINOv2)."""
    dino = build_tiny_dino(tmp_path / "dino")
    launch(base_args(model, images, tmp_path / "out", *ONE_STEP, "--validation_prompt", "a photo of sks dog",
                     "--num_validation_images", "1", "--validation_metrics", "dino", "--metrics_dino_model", dino),
           script=copy)
    scored = [json.loads(line) for line in (tmp_path / "out" / "validation" / "metrics.jsonl").read_text().splitlines()]
    assert [e["tag"] for e in scored] == ["base", "final"] and all("subject" in e for e in scored)
