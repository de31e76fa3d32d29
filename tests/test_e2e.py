"""The real script under `accelerate launch` on the tiny FLUX.2 model; every test asserts on what it wrote."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, SCRIPT, base_args, launch
from tests.tiny_flux2 import MAX_SEQUENCE_LENGTH, make_images

LORA = "pytorch_lora_weights.safetensors"


def sample_log(out):
    return [json.loads(line) for line in (out / "logs" / "samples-0.jsonl").read_text().splitlines()]


def assert_lora_works(model, out, expect_modules=None):
    """Keys are diffusers-style, B matrices were trained, and Flux2Pipeline.load_lora_weights changes the output."""
    from diffusers import Flux2Pipeline

    state = load_file(str(out / LORA))
    assert state and all(k.startswith("transformer.") for k in state)
    assert any(v.abs().sum() > 0 for k, v in state.items() if "lora_B" in k)
    if expect_modules is not None:
        assert {k.split(".lora_")[0].split(".", 3)[-1] for k in state} <= expect_modules
    pipe = Flux2Pipeline.from_pretrained(model, tokenizer=None)
    embeds = torch.randn(1, MAX_SEQUENCE_LENGTH, 32, generator=torch.Generator().manual_seed(0))
    run = lambda: pipe(prompt_embeds=embeds, height=32, width=32, num_inference_steps=2, output_type="pt",  # noqa: E731
                       generator=torch.Generator().manual_seed(0)).images
    before = run()
    pipe.load_lora_weights(str(out))
    assert not torch.equal(before, run())


CONFIGS = {
    "static_prompt": ([], False),
    "txt_captions": ([], True),
    "cache_latents": (["--cache_latents"], True),
    "aspect_buckets": (["--use_aspect_ratio_buckets", "--resolution", "48"], True),
    "lora_layers": (["--lora_layers", "to_q,to_qkv_mlp_proj"], True),
}


# static_prompt (the README's command under `accelerate launch`) is `make test-fast`'s end-to-end run
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * (n != "static_prompt")) for n in CONFIGS])
def test_training_runs_and_writes_a_loadable_lora(name, tiny_model, tmp_path):
    extra, captions = CONFIGS[name]
    images = tmp_path / "images"
    make_images(str(images), captions=captions)
    out = tmp_path / "out"
    # one configuration through `accelerate launch` itself (as do two other tests), the rest forked: the same script
    proc = launch(base_args(tiny_model, images, out, "--max_train_steps", "3", "--checkpointing_steps", "100", *extra),
                  via_accelerate=name == "static_prompt")
    assert "Steps" in proc.stderr  # the progress bar
    log = sample_log(out)
    assert len(log) == 3 and all(len(r["indices"]) == 1 for r in log)
    if name == "aspect_buckets":  # each sample trains in its image's bucket of the 48 px ladder (48², 32x64, 64x32)
        from tests.tiny_flux2 import IMAGE_SPECS

        latent_hw = {(64, 40): [8, 16], (40, 64): [16, 8], (48, 48): [12, 12]}  # (w, h) -> bucket / 4 (VAE, patches)
        assert all(r["latent_hw"] == latent_hw[IMAGE_SPECS[r["indices"][0]][:2]] for r in log)
        assert "unique prompts" in proc.stderr
    assert_lora_works(tiny_model, out, {"attn.to_q", "attn.to_qkv_mlp_proj"} if name == "lora_layers" else None)
    if name == "lora_layers":  # exactly the named layers, in both the double- and the single-stream block
        assert {k.split(".lora_")[0] for k in load_file(str(out / LORA))} == {
            "transformer.transformer_blocks.0.attn.to_q", "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj"}
    assert (out / "README.md").is_file()


def test_aspect_buckets_train_on_several_shapes(tiny_model, images, tmp_path):
    out = tmp_path / "out"
    launch(base_args(tiny_model, images, out, "--aspect_ratio_buckets", "32,48;48,32;32,32", "--num_train_epochs", "2"))
    shapes = {tuple(r["latent_hw"]) for r in sample_log(out)}
    assert shapes == {(8, 12), (12, 8), (8, 8)}  # latents are 1/4 of the pixels after the 2x VAE and 2x2 patches
    epochs = [sorted(i for r in sample_log(out) if r["epoch"] == e for i in r["indices"]) for e in (0, 1)]
    assert epochs == [list(range(6))] * 2


def test_captions_reach_the_prompt_cache(tiny_model, images, tmp_path):
    out = tmp_path / "out"
    proc = launch(base_args(tiny_model, images, out, "--max_train_steps", "1"))
    assert "6 unique prompts" in proc.stderr  # 5 captions + the instance prompt for the uncaptioned image


@pytest.mark.slow
def test_prior_preservation_generates_missing_class_images(tiny_model, images, tmp_path):
    class_dir = tmp_path / "class"
    class_dir.mkdir()
    from PIL import Image

    Image.new("RGB", (40, 40), (1, 2, 3)).save(class_dir / "class-00001.png")  # the user's own, mid-numbering
    before = (class_dir / "class-00001.png").read_bytes()
    out = tmp_path / "out"
    proc = launch(base_args(tiny_model, images, out, "--max_train_steps", "2", "--with_prior_preservation",
                            "--class_data_dir", class_dir, "--class_prompt", "a photo of a dog",
                            "--num_class_images", "8", "--sample_batch_size", "3"))
    generated = sorted(p.name for p in class_dir.iterdir())
    assert generated == [f"class-{i:05d}.png" for i in range(8)]
    assert (class_dir / "class-00001.png").read_bytes() == before  # never overwritten
    assert "Generating class images" in proc.stderr
    assert "8 samples" in proc.stderr  # more class images than instance samples: every class image gets a sample
    assert_lora_works(tiny_model, out)


@pytest.mark.slow
def test_validation_images_are_png_and_in_the_model_card(tiny_model, images, tmp_path):
    out = tmp_path / "out"
    launch(base_args(tiny_model, images, out, "--num_train_epochs", "2", "--validation_prompt", "a photo of sks dog",
                     "--validation_epochs", "1", "--num_validation_images", "2", "--report_to", "tensorboard"),
           via_accelerate=True)
    names = sorted(p.name for p in (out / "validation").iterdir())
    assert names == ["base-0.png", "base-1.png", "base.json", "epoch-0001-0.png", "epoch-0001-1.png", "final-0.png",
                     "final-1.png", "progress-0.json", "progress-0.png"]  # epoch 2's are the final; base.json: what made base-*
    from PIL import Image

    with Image.open(out / "validation" / "final-0.png") as im:
        assert im.format == "PNG" and im.size == (32, 32)
    folder = out / "validation"
    assert json.loads((folder / "progress-0.json").read_text())["columns"] == [
        {"tag": "epoch-0001", "step": 6}, {"tag": "final", "step": 12}]
    with Image.open(folder / "progress-0.png") as sheet:  # base, epoch 1, final: three columns of two rows
        sheet = sheet.convert("RGB")
        assert sheet.height == 14 + 2 * 32 + 4 * 4 and sheet.width >= 3 * 32 + 4 * 4
        base = [sheet.crop((4, 22 + r * 36, 36, 54 + r * 36)) for r in range(2)]
        for r in range(2):  # the base model's images are in the first column, in row order
            assert list(base[r].getdata()) == list(Image.open(folder / f"base-{r}.png").convert("RGB").getdata())
    assert list(Image.open(folder / "base-0.png").getdata()) != list(Image.open(folder / "final-0.png").getdata())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "logs").rglob("events.out.tfevents.*")).parent), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 13))  # one line per optimizer step
    assert {"lr", "step_seconds"} <= set(events.Tags()["scalars"])
    assert {"validation/epoch-0001", "validation/final"} <= set(events.Tags()["images"])
    card = (out / "README.md").read_text()
    assert "validation/final-0.png" in card and "validation/final-1.png" in card and "a photo of sks dog" in card
    assert "![progress](validation/progress-0.png)" in card


@pytest.mark.slow
def test_a_prompts_file_and_a_final_prompt_make_a_sheet_and_a_card_that_work(tiny_model, images, tmp_path):
    """--validation_prompts_file and --final_validation_prompt: the final prompt is a row of every validation (it was
    the final's alone, whose extra row remade the base images and restarted the sheet), so the sheet keeps the
    training's columns; the card
    captions each image with its prompt and strength, lists strength 1 in the widget, and its snippet loads the LoHa
    (diffusers' load_lora_weights cannot) with a quoted prompt as valid Python."""
    import yaml
    from diffusers import Flux2Pipeline
    from PIL import Image

    prompts, out = tmp_path / "prompts.txt", tmp_path / "out"
    prompts.write_text('a "sks" dog on a beach\n')
    launch(base_args(tiny_model, images, out, "--max_train_steps", "2", "--validation_steps", "1", "--num_validation_images",
                     "1", "--validation_prompts_file", prompts, "--final_validation_prompt", "a sks dog in snow",
                     "--validation_lora_scales", "0,1", "--adapter", "loha"))
    folder = out / "validation"
    assert [s["prompt"] for s in json.loads((folder / "base.json").read_text())["specs"]] == [
        "a sks dog in snow", 'a "sks" dog on a beach']
    assert json.loads((folder / "progress-0.json").read_text())["columns"] == [{"tag": "step-000001", "step": 1},
                                                                               {"tag": "final", "step": 2}]
    with Image.open(folder / "progress-0.png") as sheet:  # labels, base, step 1, final: four rows
        assert sheet.height == 14 + 4 * 32 + 4 * 6
    card = (out / "README.md").read_text()
    widget = yaml.safe_load(card.split("---")[1])["widget"]  # strength 1: rows 1 and 3
    assert [(w["text"], w["output"]["url"]) for w in widget] == [("a sks dog in snow", "validation/final-1.png"),
                                                                 ('a "sks" dog on a beach', "validation/final-3.png")]
    assert "(validation/final-2.png)\na \"sks\" dog on a beach (LoRA strength 0)" in card
    code = card.split("```py\n")[1].split("```")[0]
    pipe = Flux2Pipeline.from_pretrained(tiny_model, tokenizer=None, text_encoder=None)
    exec(code.split("enable_model_cpu_offload()")[1].split("\nimage = pipe(")[0].split("\n", 1)[1], {"pipe": pipe})
    written = load_file(str(out / LORA))
    key = next(k for k in written if k.endswith(".hada_w1_a"))
    module = pipe.transformer.get_submodule(key.removeprefix("transformer.").removesuffix(".hada_w1_a"))
    assert torch.equal(module.hada_w1_a["default"].data, written[key])
    assert "image = pipe('a sks dog in snow', guidance_scale=4)" in code  # [dev]'s pipeline's, as validation


@pytest.mark.slow
def test_dataset_name_accepts_a_local_folder(tiny_model, tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "hf"
    paths = make_images(str(folder), captions=False)
    rows = [{"file_name": Path(p).name, "text": f"a photo of sks dog number {i}"} for i, p in enumerate(paths)]
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (folder / "notes.md").unlink()
    out = tmp_path / "out"
    args = base_args(tiny_model, folder, out, "--max_train_steps", "2", "--caption_column", "text")
    args[args.index("--instance_data_dir")] = "--dataset_name"
    proc = launch(args)
    assert "6 unique prompts" in proc.stderr  # the six captions of the column
    assert_lora_works(tiny_model, out)


@pytest.mark.slow
def test_resume_from_latest_checkpoint_matches_a_straight_run(tiny_model, images, tmp_path):
    """5 batches per epoch, accumulation 2, a checkpoint inside epoch 0, an accumulation window across the epoch
    boundary, warm-up, LoRA dropout (global RNG) and --timestep_shift auto (the resumed steps draw the same shifted
    noise levels): the resumed LoRA equals the straight one bit for bit."""
    (images / "img_05.png").unlink()
    common = ["--gradient_accumulation_steps", "2", "--max_train_steps", "5", "--checkpointing_steps", "2",
              "--lr_scheduler", "linear", "--lr_warmup_steps", "2", "--lora_dropout", "0.1", "--random_flip",
              "--use_ema", "--ema_decay", "0.9", "--caption_dropout", "0.3", "--timestep_shift", "auto"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch(base_args(tiny_model, images, straight, *common))
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    shutil.copytree(straight / "checkpoint-4", resumed / "checkpoint-4.partial")  # killed while writing: ignored
    proc = launch(base_args(tiny_model, images, resumed, *common, "--resume_from_checkpoint", "latest"))
    assert "resumed from" in proc.stderr and "checkpoint-2" in proc.stderr
    assert "checkpoint-4.partial is incomplete" in proc.stderr  # skipped, with a warning
    for name in (LORA, "pytorch_lora_weights_raw.safetensors"):  # the EMA (restored from the checkpoint) and raw
        a, b = load_file(str(straight / name)), load_file(str(resumed / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sample_log(resumed) == sample_log(straight)[4:]  # the same batches, none repeated, none skipped
    assert {r["epoch"] for r in sample_log(straight)} == {0, 1}


@pytest.mark.slow
def test_no_network_access_without_push_to_hub(tiny_model, images, tmp_path):
    """Any socket connection made by the script (or libraries it calls) is recorded and refused."""
    guard = tmp_path / "guard"
    guard.mkdir()
    record = tmp_path / "connections.txt"
    (guard / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import socket
        _connect = socket.socket.connect
        def connect(self, address):
            if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
                with open({str(record)!r}, "a") as f:
                    f.write(repr(address) + "\\n")
                raise OSError("network disabled by test")
            return _connect(self, address)
        socket.socket.connect = connect
    """))
    out = tmp_path / "out"
    launch(base_args(tiny_model, images, out, "--max_train_steps", "1", "--validation_prompt", "a dog",
                     "--num_validation_images", "1"),
           env={"HF_HUB_OFFLINE": "0", "PYTHONPATH": f"{guard}:{ROOT}"})
    assert (out / LORA).is_file() and (out / "README.md").is_file()
    assert not record.exists(), record.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["--instance_data_dir", "/nonexistent/images"], "--instance_data_dir /nonexistent/images: expected an existing"),
    (["--resolution", "40"], "--resolution 40: expected sides from 16 to 4096, multiples of 16"),
    (["--train_batch_size", "7"], "--train_batch_size 7 leaves no full batch"),
    (["--with_prior_preservation", "--class_data_dir", "c"], "--with_prior_preservation needs --class_prompt"),
    (["--resume_from_checkpoint", "/nonexistent/checkpoint-3"], "no such checkpoint"),
])
def test_bad_input_exits_2_with_one_message_before_loading_models(extra, message, images, tmp_path):
    # no such model (offline, a Hub id never downloaded): reaching any model load would fail differently
    args = base_args("nobody/no-such-model", images, tmp_path / "out", *extra)
    proc = launch(args, check=False, timeout=300)  # forked from the zygote: the same exit, without 3 s of imports
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def _without_seed(args):
    i = args.index("--seed")
    return args[:i] + args[i + 2:]


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["memory", "disk", "unwritable"])
def test_two_processes_share_the_work_and_agree(cache, tiny_model, images, tmp_path):
    """No --seed: the drawn seed is agreed, each epoch the ranks train disjoint batches covering every batch,
    each rank encodes half the unique inputs (gathered in memory, or through the disk cache; a cache folder that
    cannot be written warns and falls back to memory), and both end with the same LoRA."""
    out = tmp_path / "out"
    for path in images.iterdir():  # a dataset that exists already (files changed seconds ago are not indexed)
        os.utime(path, (time.time() - 3600,) * 2)
    (tmp_path / "a-file").write_text("where the cache folder should be")
    extra = {"memory": ["--precompute_cache_dir", "none"], "disk": ["--precompute_cache_dir", tmp_path / "cache"],
             "unwritable": ["--precompute_cache_dir", tmp_path / "a-file" / "cache"]}[cache]
    proc = launch(_without_seed(base_args(tiny_model, images, out, "--num_train_epochs", "3", "--cache_latents",
                                          "--center_crop", "--checkpointing_steps", "2", *extra)), num_processes=2)
    logs = [[json.loads(line) for line in (out / "logs" / f"samples-{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    for epoch in range(3):
        per_rank = [[i for row in log if row["epoch"] == epoch for i in row["indices"]] for log in logs]
        assert len(per_rank[0]) == len(per_rank[1]) == 3
        assert sorted(per_rank[0] + per_rank[1]) == list(range(6))
    assert [r["indices"] for r in logs[0]] != [r["indices"] for r in logs[1]]
    for rank in (0, 1):
        assert f"[RANK {rank}] encoded 3 of 6 missing prompts" in proc.stderr
        assert f"[RANK {rank}] encoded 3 of 6 missing images" in proc.stderr
    if cache == "disk":  # rank 0 scans first; rank 1 finds its scan index
        assert f"[RANK 1] scanned {images}: 6 images, 6 unchanged since the last scan, 0 decoded" in proc.stderr
    if cache == "memory":
        assert "in-memory precompute cache: " in proc.stderr and "copied into each of 2 processes" in proc.stderr
    if cache == "unwritable":
        for rank in (0, 1):  # once per process, naming the folder and the error
            assert proc.stderr.count(f"[RANK {rank}] cannot write the precompute cache {tmp_path / 'a-file' / 'cache'} "
                                     "([Errno 20] Not a directory") == 1
        assert "wrote 0 (0 B), kept 12 in memory" in proc.stderr
    fingerprints = set(re.findall(r"\[RANK \d\] LoRA fingerprint (\w+)", proc.stderr))
    assert len(re.findall(r"LoRA fingerprint", proc.stderr)) == 2 and len(fingerprints) == 1
    assert sorted(p.name for p in (out / "checkpoint-6").glob("rng-*.json")) == ["rng-0.json", "rng-1.json"]
    assert_lora_works(tiny_model, out)


@pytest.mark.slow
def test_sigterm_checkpoints_and_resumes_to_the_straight_result(tiny_model, images, tmp_path):
    common = ["--max_train_steps", "150", "--checkpointing_steps", "1000", "--lora_dropout", "0.1"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *base_args(tiny_model, images, stopped, *common)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = stopped / "logs" / "samples-0.jsonl"
    deadline = time.time() + 300
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    checkpoints = list(stopped.glob("checkpoint-*"))
    assert len(checkpoints) == 1 and "--resume_from_checkpoint latest" in stderr and "Traceback" not in stderr
    assert 3 <= int(checkpoints[0].name.split("-")[1]) < 150 and not (stopped / LORA).exists()
    launch(base_args(tiny_model, images, stopped, *common, "--resume_from_checkpoint", "latest"))
    launch(base_args(tiny_model, images, straight, *common))
    a, b = load_file(str(straight / LORA)), load_file(str(stopped / LORA))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_default_disk_cache_makes_reruns_encode_only_what_changed(tiny_model, images, tmp_path, own_cache_folder):
    """No flag: the per-user cache folder. Reruns reuse entries and the scan index; a bound of 0 deletes every
    entry the run does not use."""
    cache = own_cache_folder
    for path in images.iterdir():  # a dataset that exists already (files changed seconds ago are not indexed)
        os.utime(path, (time.time() - 3600,) * 2)
    args = lambda out, *extra: base_args(tiny_model, images, out, "--max_train_steps", "3", "--cache_latents",  # noqa: E731
                                         "--center_crop", "--repeats", "4", *extra)
    cold = launch(args(tmp_path / "cold")).stderr
    assert "encoded 6 of 6 missing prompts (6 unique)" in cold and "encoded 6 of 6 missing images" in cold
    assert cold.count("loading the text encoder") == 1 and "loading the VAE" in cold
    assert f"precompute cache {cache}: reused 0 entries (0 B), wrote 12 (" in cold and "of the 50.0 GB bound" in cold
    assert "6 images, 0 unchanged since the last scan, 6 decoded and hashed" in cold

    warm = launch(args(tmp_path / "warm")).stderr
    assert "encoded 0 of 0 missing prompts" in warm
    assert "loading the text encoder" not in warm and "loading the VAE" not in warm
    assert "all latents cached; the VAE is not loaded" in warm
    assert f"precompute cache {cache}: reused 12 entries" in warm and "wrote 0 (0 B)" in warm
    assert "6 images, 6 unchanged since the last scan, 0 decoded and hashed" in warm
    a, b = load_file(str(tmp_path / "cold" / LORA)), load_file(str(tmp_path / "warm" / LORA))
    assert all(torch.equal(a[k], b[k]) for k in a)  # disk entries are the exact tensors the cold run trained on

    (images / "img_00.png").rename(images / "renamed.png")  # same bytes, new name: still a hit
    (images / "img_00.txt").rename(images / "renamed.txt")
    renamed = launch(args(tmp_path / "renamed")).stderr
    assert "encoded 0 of 0 missing prompts" in renamed and "all latents cached" in renamed

    (images / "img_01.txt").write_text("a photo of sks dog under a yellow umbrella\n")  # one caption edited
    edited = launch(args(tmp_path / "edited", "--precompute_cache_max_gb", "0")).stderr
    assert "encoded 1 of 1 missing prompts" in edited and "loading the VAE" not in edited
    assert "1 least-recently-used entries deleted" in edited  # the old caption's embedding; the run's own stay
    assert len(list(cache.glob("*/??/*.safetensors"))) == 12 and "over the bound" in edited
    assert not list(cache.rglob("*.tmp")) and not list(cache.glob("leases/*"))  # leases end with their run


def test_latent_sampling_sample_with_live_flips_trains(tiny_model, images, tmp_path):
    out = tmp_path / "out"
    proc = launch(base_args(tiny_model, images, out, "--num_train_epochs", "2", "--cache_latents", "--random_flip",
                            "--latent_sampling", "sample"))
    assert "encoded 12 of 12 missing images" in proc.stderr  # 6 crops x both orientations
    assert_lora_works(tiny_model, out)


@pytest.mark.slow
def test_dataloader_workers_give_the_batches_of_the_main_process_across_epochs(tiny_model, images, tmp_path):
    """Images decoded in 2 worker processes that live for the whole run (pickled dataset, epoch carried with each
    index) train the same LoRA as decoding in the main process, into the second epoch's new crops and flips."""
    common = ["--max_train_steps", "7", "--random_flip"]  # 6 batches an epoch
    loras = {}
    for workers in ("0", "2"):
        out = tmp_path / f"workers-{workers}"
        proc = launch(base_args(tiny_model, images, out, *common, "--dataloader_num_workers", workers))
        said = "images decoded by 2 DataLoader workers" if workers == "2" else "images decoded in the main process"
        assert said in proc.stderr, proc.stderr[-2000:]
        loras[workers] = load_file(str(out / LORA))
    assert loras["0"].keys() == loras["2"].keys()
    assert all(torch.equal(loras["0"][k], loras["2"][k]) for k in loras["0"])
