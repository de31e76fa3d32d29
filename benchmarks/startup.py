"""Start-up on large image folders: the scan-and-hash stage, cold and warm, with its peak host memory.

What is measured: the stage the script runs on the instance folder before it loads any model (`load_instance_images`
with the disk cache: every image checked by decoding, hashed, its caption read), in a fresh process per row, on
folders of 100, 1,000 and 10,000 JPEGs of 3.8 megapixels (2400x1600, ~1.5 MB each, generated once: smooth colour
fields with film grain, so they compress like photographs). Model loading and precompute are not part of it: they do
not depend on how the folder is scanned.

Rows per folder size:
  before  the scan as it was before the scan index: one thread, each image decoded at full size, then a SHA-256 of
          every file (replayed here with the script's own helpers)
  cold    this script's scan with an empty cache folder: JPEGs decoded at 1/8 scale and hashed on every core
  warm    the same again: the index written by the cold row says the files are unchanged (size, mtime)
"scan s" is the stage alone; "process s" is the child's whole life (Python, torch and the script imported: the same
in every row); "peak RSS" is the child's high-water mark, "imports" its RSS before the stage.

A second table times the whole script, from `python train_dreambooth_lora_flux2.py ...` to its first optimizer step
(the "step 1/1" log line), on the same folders with the tiny random FLUX.2 model of the tests (`tests/tiny_flux2.py`,
with a VAE that downsamples 8x as the real one does)
and `--cache_latents --resolution 512` (64 with --tiny): scan, model loads, text and VAE precompute, cache bookkeeping, the first
batch. Rows: `cold` (empty cache folder: every image decoded at its bucket and encoded, every caption encoded) and
`warm` (the same command again: nothing decoded or encoded; what is left is what scales with the dataset at a warm
start: the scan index, one header read per cache entry, the lease, the manifest). With a real model the model loads
and encodes add their own, dataset-independent or per-image, cost; the tiny model shows the trainer's own overhead. The OS page cache is
warm in every row (the files were just generated or read): "cold" means no index, not an empty page cache; reading
from a cold disk adds the same read time to "before" and "cold".

    python benchmarks/startup.py                  # 10,000 images in /tmp/startup-bench-images (~15 GB, kept for reuse)
    python benchmarks/startup.py --sizes 100 1000 # smaller folders only
    python benchmarks/startup.py --tiny           # 4 small images, seconds: the CI smoke test
    python benchmarks/startup.py --no-first-step  # the scan table only (--no-scan: the other one)
    rm -rf /tmp/startup-bench-images              # when done

The parent process never imports torch, numpy or Pillow: a child's ru_maxrss starts at its parent's RSS (Linux keeps
the high-water mark across fork and exec), so a light parent keeps the children's figures honest.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
FULL = {"sizes": (100, 1000, 10000), "width": 2400, "height": 1600, "resolution": 512}
TINY = {"sizes": (4,), "width": 320, "height": 240, "resolution": 64}


# ---------------------------------------------------------------------------------------------------------------
# Children (fresh interpreters)


GRAIN = {}  # per worker process: one film-grain tile, cropped at a random offset for every image


def generate_one(task):
    """Write image i: a smooth colour field (upscaled noise) with film grain; every second image gets a caption."""
    import numpy as np
    from PIL import Image, ImageChops

    folder, i, width, height = task
    if (width, height) not in GRAIN:
        tile = np.random.default_rng(0).integers(110, 146, (height + 64, width + 64, 3), dtype=np.uint8)
        GRAIN[width, height] = Image.fromarray(tile)
    rng = np.random.default_rng(i)
    field = Image.fromarray(rng.integers(0, 255, (12, 18, 3), dtype=np.uint8)).resize((width, height), Image.Resampling.BICUBIC)
    detail = Image.fromarray(rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)).resize((width, height))
    left, top = (int(v) for v in rng.integers(0, 64, 2))
    grain = GRAIN[width, height].crop((left, top, left + width, top + height))
    image = ImageChops.add(Image.blend(field, detail, 0.25), grain, scale=1.0, offset=-128)
    path = Path(folder, f"img_{i:05d}.jpg")
    image.save(path, quality=90)
    if i % 2 == 0:
        path.with_suffix(".txt").write_text(f"a photo of sks dog, picture {i}\n", encoding="utf-8")
    for written in (path, path.with_suffix(".txt")):  # a dataset that exists already, not one being edited
        if written.exists():
            os.utime(written, (time.time() - 3600,) * 2)


def generate(folder, count, width, height):
    import concurrent.futures

    folder.mkdir(parents=True, exist_ok=True)
    todo = [(str(folder), i, width, height) for i in range(count) if not (folder / f"img_{i:05d}.jpg").exists()]
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count()) as pool:
        for done, _ in enumerate(pool.map(generate_one, todo, chunksize=16), 1):
            if done % 500 == 0:
                print(f"  generated {done} of {len(todo)}", file=sys.stderr, flush=True)


def scan(mode, folder, cache):
    """One row: the scan of `folder` as `mode` does it -> JSON on stdout."""
    import logging
    import resource

    sys.path.insert(0, str(ROOT))
    from accelerate import PartialState

    import train_dreambooth_lora_flux2 as T

    PartialState()
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731 - KiB on Linux -> MiB
    imports = peak()
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(T.__name__).addHandler(handler)
    logging.getLogger(T.__name__).setLevel(logging.INFO)
    start = time.perf_counter()
    if mode == "before":
        count = before_scan(T, Path(folder))
        decoded, unchanged = count, 0
    else:
        args = T.parse_args(["--pretrained_model_name_or_path", "-", "--instance_prompt", "p", "--instance_data_dir",
                             folder, "--precompute_cache_dir", cache])
        T.load_instance_images(args, T.open_cache(args), PartialState())
        m = re.search(r"(\d+) unchanged since the last scan, (\d+) decoded", "\n".join(lines))
        unchanged, decoded = int(m.group(1)), int(m.group(2))
    print(json.dumps({"seconds": time.perf_counter() - start, "decoded": decoded, "unchanged": unchanged,
                      "imports_mib": imports, "peak_mib": peak()}))


def before_scan(T, folder):
    """The scan before the index: every image opened and decoded at full size in one thread, then every file hashed
    in 1 MiB blocks (file_digest), as the disk cache's latent keys asked for it."""
    import warnings

    from PIL import Image

    paths = [p for p in sorted(folder.iterdir())
             if not p.name.startswith(".") and p.suffix.lower() in T.IMAGE_EXTENSIONS and p.is_file()]
    for path in paths:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                T.oriented_size(im)
                im.load()
        if path.with_suffix(".txt").is_file():
            path.with_suffix(".txt").read_text(encoding="utf-8-sig")
    for path in paths:
        T.file_digest(str(path))
    return len(paths)


def build_model(path):
    """The tests' tiny FLUX.2 [dev], with a VAE that downsamples 8x like the real one: the tests' VAE downsamples 2x,
    so at 512 px its attention would span 65,536 positions and time that, not the trainer."""
    import torch
    from diffusers import AutoencoderKLFlux2

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_flux2 import build_tiny_flux2

    build_tiny_flux2(path)
    torch.manual_seed(0)
    AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                       up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(4, 8, 8, 8), layers_per_block=1,
                       latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                       use_post_quant_conv=False).save_pretrained(Path(path, "vae"))


def first_step(folder, cache, model, out, resolution):
    """One row of the second table: the script itself, to its first step -> (seconds, peak RSS MiB, its log)."""
    command = [sys.executable, str(ROOT / "train_dreambooth_lora_flux2.py"), "--pretrained_model_name_or_path", model,
               "--instance_data_dir", folder, "--instance_prompt", "a photo of sks dog", "--output_dir", out,
               "--precompute_cache_dir", cache, "--cache_latents", "--resolution", str(resolution), "--train_batch_size", "1",
               "--max_train_steps", "1", "--max_sequence_length", "64", "--seed", "0",
               "--text_encoder_out_layers", "1", "2"]  # the tiny text encoder has 2 layers
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds, log = None, []
    for line in proc.stderr:
        log.append(line)
        if seconds is None and re.search(r"step 1/1 loss", line):
            seconds = time.perf_counter() - start
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own high-water mark (RUSAGE_CHILDREN only grows)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or seconds is None:
        sys.exit(f"the script failed ({proc.returncode}):\n{''.join(log)[-4000:]}")
    return seconds, usage.ru_maxrss / 1024, "".join(log)


def first_step_table(sizes, tmp, resolution):
    model = tmp / "tiny-flux2"
    child("model", model)
    head = f"{'images':>6} {'scenario':<8} {'images encoded':>14} {'prompts encoded':>15} {'to step 1 s':>11} {'peak RSS MiB':>12}"
    print(f"\nTo the first step (the whole script, tiny model, --cache_latents --resolution {resolution}):\n" + head + "\n" + "-" * len(head))
    for n in sizes:
        folder, cache = tmp / f"n{n}", tmp / f"run-cache-{n}"
        for mode in ("cold", "warm"):
            seconds, peak, log = first_step(folder, cache, model, tmp / f"out-{n}-{mode}", resolution)
            found = lambda what: sum(int(k) for k in re.findall(rf"encoded (\d+) of \d+ missing {what}", log))  # noqa: E731
            print(f"{n:>6} {mode:<8} {found('images'):>14} {found('prompts'):>15} {seconds:>11.1f} {peak:>12.0f}")


# ---------------------------------------------------------------------------------------------------------------
# Parent


def child(*args, timeout=3600):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], check=False, cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"child {args} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1]) if args[0] == "scan" else {}
    return {**result, "process": time.perf_counter() - start}


def subset(pool, folder, count):
    """Hard links to the first `count` images (and captions) of the pool: the same bytes and mtimes, no copies."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for i in range(count):
        for suffix in (".jpg", ".txt"):
            source = pool / f"img_{i:05d}{suffix}"
            if source.exists():
                os.link(source, folder / source.name)


def cpu_name():
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="4 small images: a smoke test that takes seconds")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="folder sizes (default 100 1000 10000)")
    parser.add_argument("--no-first-step", dest="first_step", action="store_false",
                        help="skip the second table (the whole script to its first step)")
    parser.add_argument("--no-scan", dest="scan", action="store_false", help="skip the first table (the scan alone)")
    parser.add_argument("--images", type=Path, default=Path(tempfile.gettempdir(), "startup-bench-images"),
                        help="where the generated images are kept and reused")
    opts = parser.parse_args()
    config = TINY if opts.tiny else FULL
    sizes = sorted(opts.sizes or config["sizes"])
    sys.stdout.reconfigure(line_buffering=True)
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        tmp = Path(tmp)
        pool = tmp / "images" if opts.tiny else opts.images / f"{config['width']}x{config['height']}"
        started = time.perf_counter()
        child("generate", pool, max(sizes), config["width"], config["height"])
        megabytes = sum(p.stat().st_size for p in pool.glob("*.jpg")) / 1e6 / max(1, len(list(pool.glob("*.jpg"))))
        print(f"{max(sizes)} images of {config['width']}x{config['height']} JPEG (~{megabytes:.1f} MB each) in {pool} "
              f"({time.perf_counter() - started:.0f} s to generate or find); {os.cpu_count()} cores, {cpu_name()}\n")
        head = (f"{'images':>6} {'scenario':<8} {'decoded':>7} {'unchanged':>9} {'scan s':>8} {'process s':>9} "
                f"{'peak RSS MiB':>12} {'imports MiB':>11}")
        if opts.scan:
            print(head + "\n" + "-" * len(head))
        for n in sizes:
            folder, cache = tmp / f"n{n}", tmp / f"cache-{n}"
            subset(pool, folder, n)
            for mode in ("before", "cold", "warm") if opts.scan else ():
                r = child("scan", mode, folder, cache)
                print(f"{n:>6} {mode:<8} {r['decoded']:>7} {r['unchanged']:>9} {r['seconds']:>8.2f} {r['process']:>9.1f} "
                      f"{r['peak_mib']:>12.0f} {r['imports_mib']:>11.0f}")
        if opts.first_step:
            first_step_table(sizes, tmp, config["resolution"])
    if not opts.tiny:
        print(f"\nThe generated images stay in {opts.images} for the next run; delete them with rm -rf {opts.images}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        what, rest = sys.argv[2], sys.argv[3:]
        if what == "generate":
            generate(Path(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]))
        elif what == "model":
            build_model(rest[0])
        else:
            scan(*rest)
    else:
        main()
