"""The disk cache as a product: the per-user default, the bound and LRU eviction, leases between live runs, write
failures, interruptible precompute, sourceless training (--from_manifest) and the start-up scan's index."""

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import ROOT, SCRIPT, base_args, free_port, launch
from tests.tiny_flux2 import make_images

LORA = "pytorch_lora_weights.safetensors"


@pytest.fixture(autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState()  # the cache warns through accelerate's logger


def age(path, seconds=3600):
    """Date a file back, as a dataset that already exists (files changed seconds ago are not indexed)."""
    os.utime(path, (time.time() - seconds,) * 2)


def entries(root):
    return sorted(p.relative_to(root).as_posix() for p in Path(root).glob("*/??/*.safetensors"))


# ---------------------------------------------------------------------------------------------------- the folder


def test_default_cache_folder_is_per_user_and_none_keeps_memory():
    env = {"XDG_CACHE_HOME": "/x/cache", "HOME": "/home/u"}
    assert T.resolve_cache_dir(None, env) == Path("/x/cache/train_dreambooth_lora_flux2")
    assert T.resolve_cache_dir(None, {"HOME": "/home/u"}) == Path("/home/u/.cache/train_dreambooth_lora_flux2")
    # the XDG spec: a relative XDG_CACHE_HOME is invalid and ignored
    assert T.resolve_cache_dir(None, {"XDG_CACHE_HOME": "rel", "HOME": "/home/u"}) == Path("/home/u/.cache/train_dreambooth_lora_flux2")
    assert T.resolve_cache_dir("none", env) is None and T.resolve_cache_dir("None", env) is None
    assert T.resolve_cache_dir("/data/c", env) == Path("/data/c")


def test_a_write_that_fails_warns_once_and_keeps_entries_in_memory(tmp_path, monkeypatch, caplog):
    import safetensors.torch

    store = T.DiskStore(tmp_path, lambda key: T.json_digest(key), T.DiskCache(tmp_path))
    store["kept"] = torch.ones(2)

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    store["lost"] = torch.zeros(2)
    store["later"] = torch.full((2,), 3.0)
    assert torch.equal(store["lost"], torch.zeros(2)) and torch.equal(store["later"], torch.full((2,), 3.0))
    assert "lost" in store and len(store) == 3
    assert caplog.text.count("cannot write the precompute cache") == 1
    assert f"{tmp_path} ([Errno 28] No space left on device)" in caplog.text
    fresh = T.DiskStore(tmp_path, lambda key: T.json_digest(key), T.DiskCache(tmp_path))  # the next run: complete entries only
    assert "kept" in fresh and "lost" not in fresh and "later" not in fresh and not list(tmp_path.rglob("*.tmp"))


# ---------------------------------------------------------------------------------------------------- bound and leases


def _stores(root, keys, ages):
    store = T.DiskCache(root).store("prompts", lambda key: T.json_digest(key))
    for key, seconds in zip(keys, ages):
        store[key] = torch.ones(256)
        age(store.path(key), seconds)
    return store


def test_reading_an_entry_marks_it_used_so_eviction_takes_the_least_recently_used(tmp_path):
    store = _stores(tmp_path, "abc", (300, 200, 100))  # a is the oldest
    reader = T.DiskCache(tmp_path).store("prompts", lambda key: T.json_digest(key))  # a later run
    assert torch.equal(reader["a"], torch.ones(256))
    size = store.path("a").stat().st_size
    result = T.evict_lru(tmp_path, 2 * size)
    assert [store.path(k).exists() for k in "abc"] == [True, False, True]
    assert (result.size_before, result.size_after, result.evicted, result.evicted_bytes) == (3 * size, 2 * size, 1, size)


def test_eviction_never_deletes_the_runs_own_entries_even_over_the_bound(tmp_path):
    store = _stores(tmp_path, "ab", (300, 100))
    own = T.DiskCache(tmp_path).relative(store.path("a"))
    result = T.evict_lru(tmp_path, 0, keep=[own])
    assert entries(tmp_path) == [own] and result.size_after == result.protected_bytes == store.path("a").stat().st_size


LEASE_HOLDER = """
import sys
sys.path.insert(0, sys.argv[1])
from accelerate import PartialState
import train_dreambooth_lora_flux2 as T
PartialState()
folder = T.DiskCache(sys.argv[2])
store = folder.store("prompts", lambda key: T.json_digest(key))
lease = T.take_lease(folder.root, [folder.relative(store.path("used"))])
print("leased", flush=True)
sys.stdin.readline()  # the other run evicts meanwhile
print("read", float(store["used"].sum()), flush=True)  # the training loop reads its entries at every lookup
sys.stdin.readline()
"""


def test_eviction_spares_a_live_runs_entries_and_reclaims_them_once_it_is_gone(tmp_path):
    """Two processes: a live run holding a lease on one entry, and this one evicting everything it may."""
    store = _stores(tmp_path, ["used", "unused"], (300, 200))
    holder = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, str(ROOT), str(tmp_path)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "leased"
        T.evict_lru(tmp_path, 0)
        assert store.path("used").exists() and not store.path("unused").exists()
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().split() == ["read", "256.0"]
    finally:
        holder.kill()  # SIGKILL: no clean-up runs, its lease file stays behind
        holder.wait()
    assert len(list((tmp_path / "leases").glob("*.json"))) == 1
    T.evict_lru(tmp_path, 0)
    assert entries(tmp_path) == [] and not list((tmp_path / "leases").glob("*.json"))  # stale lease removed


def test_a_failed_eviction_warns_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    from accelerate import Accelerator

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(T, "evict_lru", denied)
    with caplog.at_level(logging.INFO):
        T.settle_cache(Accelerator(cpu=True), T.DiskCache(tmp_path, 0), [])
    assert f"could not bound the precompute cache {tmp_path} ([Errno 13] Permission denied)" in caplog.text
    assert f"precompute cache {tmp_path}: reused 0 entries (0 B), wrote 0 (0 B)" in caplog.text


def test_in_memory_copies_are_reported_and_a_large_total_is_a_warning(monkeypatch, caplog):
    cache = T.SampleCache()
    cache.put("a", torch.zeros(1, 1000))  # 4 kB
    with caplog.at_level(logging.INFO):
        T.report_memory_copies(T.Caches(cache), 1)
        assert "in-memory" not in caplog.text  # one process: nothing is duplicated
        T.report_memory_copies(T.Caches(cache), 8)
        assert [r.levelname for r in caplog.records] == ["INFO"]
        assert "4.0 kB per process, copied into each of 8 processes on this machine (32.0 kB" in caplog.text
        monkeypatch.setattr(T, "DUPLICATED_RAM_WARN_BYTES", 30_000)
        T.report_memory_copies(T.Caches(cache), 8)
    assert caplog.records[-1].levelname == "WARNING" and "--precompute_cache_dir none" in caplog.records[-1].message


# ---------------------------------------------------------------------------------------------------- scan index


def test_warm_scan_neither_decodes_nor_hashes_unchanged_files(tmp_path, monkeypatch):
    folder = tmp_path / "images"
    make_images(str(folder))
    for path in folder.iterdir():
        age(path)
    real, decoded = T.inspect_image, []
    monkeypatch.setattr(T, "inspect_image", lambda path: decoded.append(Path(path).name) or real(path))
    index = T.ScanIndex()
    cold = T.scan_image_folder(folder, index=index)
    assert (index.hits, index.decoded, len(decoded)) == (0, 6, 6)
    assert all(r.sha256 == hashlib.sha256(Path(r.path).read_bytes()).hexdigest() for r in cold)
    stored = T.ScanIndex(json.loads(json.dumps(index.files)))  # written to the cache folder and read back
    decoded.clear()
    warm = T.scan_image_folder(folder, index=stored)
    assert (stored.hits, stored.decoded, decoded) == (6, 0, [])
    view = lambda records: [(r.name, r.size, r.sha256, r.caption) for r in records]  # noqa: E731
    assert view(warm) == view(cold)
    Image.new("RGB", (30, 20), (1, 2, 3)).save(folder / "img_02.png")  # edited: new size and mtime
    age(folder / "img_02.png", 60)
    edited = T.scan_image_folder(folder, index=stored)
    assert decoded == ["img_02.png"] and edited[2].size == (30, 20) and edited[2].sha256 != cold[2].sha256


def test_files_changed_just_before_the_scan_are_not_indexed(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "old.png")
    age(tmp_path / "old.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "new.png")  # its mtime is now: a same-size edit could keep it
    index = T.ScanIndex()
    T.scan_image_folder(tmp_path, index=index)
    assert set(index.files) == {"old.png"}


def test_cold_scan_is_spread_over_threads(tmp_path, monkeypatch):
    for k in range(4):
        Image.new("RGB", (8, 8), (k, 0, 0)).save(tmp_path / f"{k}.png")
    real, threads = T.inspect_image, set()

    def slow(path):
        threads.add(threading.get_ident())
        time.sleep(0.2)
        return real(path)

    monkeypatch.setattr(T, "inspect_image", slow)
    monkeypatch.setattr(T, "cpu_cores", lambda: 2)  # a thread per core
    records = T.scan_image_folder(tmp_path)
    assert len(threads) == 2 and threading.get_ident() not in threads and [r.name for r in records] == [f"{k}.png" for k in range(4)]


def test_truncated_jpeg_is_refused_by_the_reduced_scale_decode(tmp_path):
    import numpy as np

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (256, 256, 3), np.uint8)).save(tmp_path / "cut.jpg")
    data = (tmp_path / "cut.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    Image.new("RGB", (8, 8)).save(tmp_path / "fine.jpg")
    with pytest.raises(T.UsageError, match="cut.jpg: image file is truncated") as error:
        T.scan_image_folder(tmp_path)
    assert "fine.jpg" not in str(error.value)


@pytest.mark.slow
def test_startup_benchmark_tiny_mode_prints_cold_and_warm_rows_of_the_scan_and_of_the_whole_script():
    proc = subprocess.run([sys.executable, "benchmarks/startup.py", "--tiny"], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    scan_table, _, script_table = proc.stdout.partition("To the first step")
    rows = {(int(m[0]), m[1]): (int(m[2]), int(m[3])) for m in
            re.findall(r"^\s*(\d+)\s+(before|cold|warm)\s+(\d+)\s+(\d+)\s", scan_table, re.MULTILINE)}
    assert rows == {(4, "before"): (4, 0), (4, "cold"): (4, 0), (4, "warm"): (0, 4)}, proc.stdout
    first_steps = {m[0]: (int(m[1]), int(m[2]), float(m[3])) for m in
                   re.findall(r"^\s*4\s+(cold|warm)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+\d+$", script_table, re.MULTILINE)}
    # the whole script ran to its first step twice: cold encoded 4 images and 3 prompts (2 captions, the instance
    # prompt), warm found them all in the cache
    assert {k: v[:2] for k, v in first_steps.items()} == {"cold": (4, 3), "warm": (0, 0)}, proc.stdout
    assert all(v[2] > 0 for v in first_steps.values())


# ---------------------------------------------------------------------------------------------------- flags


def _manifest_file(tmp_path, kind="M"):
    """A complete manifest (M), one of another format (NOT), one without data.seed, one of a run without latents."""
    data = {**{flag: None for flag in T.MANIFEST_DATA_FLAGS}, "buckets": [[32, 32]], "seed": 0}
    model = {"family": "Flux2Pipeline", "prompt_identity": [], "latent_identity": []}
    manifest = T.build_manifest(data, model, [], [], [], [], tmp_path)
    if kind == "NOT":
        manifest["format"] = "other"
    elif kind == "NOSEED":
        del manifest["data"]["seed"]
    elif kind == "NOLATENTS":
        manifest["model"]["latent_identity"] = None
    path = tmp_path / f"manifest-{kind}.json"
    path.write_text(json.dumps(manifest))
    return str(path)


@pytest.mark.parametrize("extra, message", [
    (["--dataset_name", "d"], "--instance_prompt is required"),
    (["--instance_data_dir", ".", "--instance_prompt", "p", "--caption_column", "text"], "--caption_column has no effect without --dataset_name"),
    (["--from_manifest", "M", "--cache_latents", "--instance_data_dir", "."], "--from_manifest replaces --instance_data_dir"),
    (["--from_manifest", "M"], "--from_manifest needs --cache_latents"),
    (["--from_manifest", "M", "--cache_latents", "--precompute_cache_dir", "none"], "--from_manifest needs the disk cache"),
    (["--from_manifest", "M", "--cache_latents", "--masked_loss"], "--from_manifest cannot train with --masked_loss"),
    (["--from_manifest", "/nonexistent/m.json", "--cache_latents"], "--from_manifest /nonexistent/m.json: expected a readable file"),
    (["--from_manifest", "NOT", "--cache_latents"], "not a dataset_manifest.json of this trainer"),
    (["--from_manifest", "NOSEED", "--cache_latents"], "incomplete, data.seed missing"),
    (["--from_manifest", "NOLATENTS", "--cache_latents"], "written by a run without --cache_latents"),
])
def test_cache_flags_are_checked_before_anything_loads(extra, message, tmp_path):
    extra = [_manifest_file(tmp_path, a) if a in ("M", "NOT", "NOSEED", "NOLATENTS") else a for a in extra]
    with pytest.raises(T.UsageError, match=message):
        args = T.parse_args(["--pretrained_model_name_or_path", "m", *extra])
        T.validate_args(args)
        T.read_manifest(args.from_manifest)  # what --from_manifest reads first, before any model


def test_manifest_settings_replace_the_data_flags_and_say_so(tmp_path, caplog):
    data = {flag: None for flag in T.MANIFEST_DATA_FLAGS}
    data.update(instance_prompt="a sks dog", repeats=2, resolution=32, random_flip=True, buckets=[[32, 48], [48, 32]], seed=7)
    image = {"name": "a.png", "size": [48, 32], "caption": None, "sha256": "ab" * 32}
    manifest = T.build_manifest(data, {}, [], [], [], [], tmp_path)
    manifest["instances"] = [image]
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--from_manifest", __file__, "--repeats", "3"])
    instances, classes = T.apply_manifest(args, manifest)
    assert (args.instance_prompt, args.repeats, args.resolution, args.random_flip, args.seed) == ("a sks dog", 2, 32, True, 7)
    assert T.resolve_buckets(args) == [(32, 48), (48, 32)] and classes == []
    assert instances[0].content_hash() == "ab" * 32 and instances[0].size == (48, 32) and instances[0].path is None
    assert "--repeats 3 ignored" in caplog.text and "--resolution" not in caplog.text  # not given: no warning


@pytest.mark.parametrize("given", [[], ["--caption_dropout", "0.1"]])
def test_a_manifest_replays_its_caption_dropout(tmp_path, caplog, given):
    """A manifest written with --caption_dropout 0.3 trains with it: replayed without the flag it was 0 (a different
    LoRA, silently); given differently, the manifest's wins with a warning, as for the other data flags."""
    data = {**{flag: None for flag in T.MANIFEST_DATA_FLAGS}, "caption_dropout": 0.3, "buckets": [[32, 32]], "seed": 7}
    model = {"family": "Flux2Pipeline", "prompt_identity": "p", "latent_identity": "l"}
    (tmp_path / T.MANIFEST_NAME).write_text(json.dumps(T.build_manifest(data, model, [], [], [], [], tmp_path)))
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--from_manifest", str(tmp_path / T.MANIFEST_NAME),
                         *given])
    T.apply_manifest(args, T.read_manifest(args.from_manifest))
    assert args.caption_dropout == 0.3
    assert ("--caption_dropout 0.1 ignored: the cached data were made with 0.3" in caplog.text) == bool(given)
    del data["caption_dropout"]  # every manifest records it: one without is incomplete, not replayed as 0
    (tmp_path / T.MANIFEST_NAME).write_text(json.dumps(T.build_manifest(data, model, [], [], [], [], tmp_path)))
    with pytest.raises(T.UsageError, match="incomplete, data.caption_dropout missing"):
        T.read_manifest(args.from_manifest)


# ---------------------------------------------------------------------------------------------------- end to end


def _sourceless(args, manifest):
    """The same command without the image folder and instance prompt, plus --from_manifest."""
    for flag in ("--instance_data_dir", "--instance_prompt"):
        i = args.index(flag)
        args = args[:i] + args[i + 2:]
    return [*args, "--from_manifest", str(manifest)]


@pytest.mark.slow
def test_from_manifest_trains_the_same_lora_with_the_images_deleted(tiny_model, images, tmp_path, own_cache_folder):
    """The sourceless run is given the training flags only: the data flags (flips, repeats, prior preservation, caption
    dropout) come from the manifest. Both runs make validation images: the sourceless one loads the VAE for them,
    never the text encoder (the validation prompt's embedding is in the cache)."""
    from PIL import Image

    classes = tmp_path / "class"
    classes.mkdir()
    for i, colour in enumerate([(200, 30, 30), (30, 200, 30)]):
        Image.new("RGB", (40, 40), colour).save(classes / f"class-{i:05d}.png")
    common = ["--max_train_steps", "4", "--cache_latents",
              "--validation_prompt", "a sks dog in a bucket", "--num_validation_images", "1"]
    first = tmp_path / "with-images"
    launch(base_args(tiny_model, images, first, *common, "--caption_dropout", "0.3", "--random_flip", "--repeats", "2",
                     "--with_prior_preservation",
                     "--class_data_dir", classes, "--class_prompt", "a photo of a dog", "--num_class_images", "2"))
    manifest = json.loads((first / T.MANIFEST_NAME).read_text())
    texts = [e["text"] for e in manifest["entries"]["prompts"]]
    assert {"", "a sks dog in a bucket", "a photo of a dog"} <= set(texts) and len(texts) == 9  # 5 captions, instance prompt
    latents = manifest["entries"]["latents"]
    assert {e["flip"] for e in latents} == {False, True} and {e["kind"] for e in latents} == {"instance", "class"}
    assert {e["image"] for e in latents if e["kind"] == "instance"} == {p.name for p in images.glob("*.*g")}
    assert {e["image"] for e in latents if e["kind"] == "class"} == {"class-00000.png", "class-00001.png"}
    assert [c["name"] for c in manifest["classes"]] == ["class-00000.png", "class-00001.png"]
    assert manifest["data"]["repeats"] == 2 and manifest["data"]["with_prior_preservation"]
    assert manifest["model"]["family"] == "Flux2Pipeline"
    assert set(entries(own_cache_folder)) == {e["entry"] for e in manifest["entries"]["prompts"] + latents}

    shutil.rmtree(images)
    shutil.rmtree(classes)
    second = tmp_path / "sourceless"
    proc = launch(_sourceless(base_args(tiny_model, images, second, *common), first / T.MANIFEST_NAME))
    assert "loading the text encoder" not in proc.stderr and "loading the VAE" in proc.stderr
    a, b = load_file(str(first / LORA)), load_file(str(second / LORA))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (second / "validation").rglob("*.png")) == sorted(
        p.name for p in (first / "validation").rglob("*.png")) != []

    (own_cache_folder / latents[3]["entry"]).unlink()  # an entry gone: refused before any model loads
    refused = launch(_sourceless(base_args(tiny_model, images, tmp_path / "refused", *common), first / T.MANIFEST_NAME),
                     check=False)
    assert refused.returncode == 2 and "loading" not in refused.stderr and "Traceback" not in refused.stderr
    needed = len(manifest["entries"]["prompts"]) + len(latents)
    assert f"1 of {needed} cache entries are missing from {own_cache_folder} (from {latents[3]['image']})" in refused.stderr


SLOW_WRITES = """
import time
import safetensors.torch
_save_file = safetensors.torch.save_file
def slow_save_file(*args, **kwargs):  # every cache entry takes a while to write: time to signal mid-precompute
    time.sleep(0.5)
    return _save_file(*args, **kwargs)
safetensors.torch.save_file = slow_save_file
"""


def _slowed(tmp_path):
    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SLOW_WRITES)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{folder}:{ROOT}"}


def _wait_for_entries(proc, root, count):
    deadline = time.time() + 300
    while len(entries(root)) < count:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_ctrl_c_during_precompute_keeps_the_cached_entries_exits_130_and_a_rerun_encodes_only_the_rest(
        tiny_model, images, tmp_path, own_cache_folder):
    """SIGINT (Ctrl-C) here; SIGTERM (exit 143) in the two-process test below."""
    args = base_args(tiny_model, images, tmp_path / "out", "--max_train_steps", "1", "--cache_latents", "--center_crop")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_slowed(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_entries(proc, own_cache_folder, 2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    cached = len(entries(own_cache_folder))
    assert proc.returncode == 130 == 128 + signal.SIGINT, stderr[-3000:]
    assert f"cached {cached} of 12 entries; rerun the same command to continue" in stderr and "Traceback" not in stderr
    assert 2 <= cached < 12 and not list(own_cache_folder.rglob("*.tmp")) and not (tmp_path / "out" / LORA).exists()
    rerun = launch(args).stderr
    encoded = [int(n) for n in re.findall(r"encoded (\d+) of \d+ missing (?:prompts|images)", rerun)]
    assert len(encoded) == 2 and sum(encoded) == 12 - cached


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _local_rank(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return env.get(b"LOCAL_RANK")


@pytest.mark.slow
def test_a_signal_to_one_process_during_precompute_stops_every_process(tiny_model, images, tmp_path, own_cache_folder):
    args = base_args(tiny_model, images, tmp_path / "out", "--max_train_steps", "1", "--cache_latents", "--center_crop")
    env = {**_slowed(tmp_path), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), str(SCRIPT), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_entries(proc, own_cache_folder, 1)
    (rank1,) = [c for c in _children(proc.pid) if _local_rank(c) == b"1"]
    os.kill(rank1, signal.SIGTERM)  # rank 0 is not signalled: it must stop at the same batch
    _, stderr = proc.communicate(timeout=300)
    stops = re.findall(r"\[RANK (\d)\] cached (\d+) of 12 entries; rerun the same command to continue", stderr)
    assert sorted(rank for rank, _ in stops) == ["0", "1"] and stops[0][1] == stops[1][1], stderr[-4000:]
    assert int(stops[0][1]) == len(entries(own_cache_folder)) < 12
    # the first process to exit does so with 128 + SIGTERM; torchrun may then terminate the other before its own exit
    # (its exit code is tested with one process above), so only the first is certain
    assert f"exitcode  : {128 + signal.SIGTERM}" in stderr, stderr[-4000:]
