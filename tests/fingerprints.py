"""LoRA fingerprints of thirteen tiny configurations: a restructure that changes no behaviour leaves all of them equal.

    python tests/fingerprints.py WORK_DIR [--save before.json] [--compare before.json] [--only NAME ...]

Each configuration runs the real script on the CPU on tiny random FLUX.2 checkpoints (built once in WORK_DIR) and
reads the "LoRA fingerprint" line it logs (a SHA-256 of the trained LoRA tensors), then hashes the saved LoRA file. --compare
prints SAME or DIFFERENT per configuration and exits 1 if any differs. About four CPU-minutes in all, two at a time.
Not a test (too slow for CI): the restructure issues ask for it before and after.
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tiny_flux2 import (KLEIN_TEXT_ENCODER_OUT_LAYERS, TEXT_ENCODER_OUT_LAYERS, build_tiny_flux2,  # noqa: E402
                              build_tiny_flux2_klein, make_images)

SCRIPT = ROOT / "train_dreambooth_lora_flux2.py"


def prepare(work):
    """Models and data folders in `work` (kept between calls) -> their paths."""
    paths = {name: work / name for name in ("dev", "klein", "images", "masked", "class", "targets", "conds", "alts")}
    if not (work / "ready").is_file():
        build_tiny_flux2(str(paths["dev"]))
        build_tiny_flux2_klein(str(paths["klein"]))
        make_images(str(paths["images"]))
        make_images(str(paths["masked"]))
        for path in sorted(paths["masked"].glob("img_0[0-2].*")):
            if path.suffix != ".txt":
                with Image.open(path) as im:
                    mask = Image.new("L", im.size, 0)
                    mask.paste(255, (0, 0, im.width // 2, im.height))
                mask.save(paths["masked"] / f"{path.stem}_mask.png")
        paths["class"].mkdir()
        for k in range(3):
            Image.new("RGB", (40, 36), (60 * k, 90, 200 - 40 * k)).save(paths["class"] / f"c{k}.png")
        rng = np.random.default_rng(0)
        paths["targets"].mkdir()
        paths["conds"].mkdir()
        for i, (w, h) in enumerate([(48, 40), (40, 48), (44, 44), (56, 40)]):
            image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
            image.save(paths["targets"] / f"p{i}.png")
            ImageOps.invert(image).save(paths["conds"] / f"p{i}.png")
            (paths["targets"] / f"p{i}.txt").write_text(f"relight scene {i}")
        make_images(str(paths["alts"]), captions=False)
        for i, path in enumerate(sorted(p for p in paths["alts"].iterdir() if p.suffix in (".png", ".jpg"))):
            if i % 2 == 0:
                path.with_suffix(".txt").write_text(f"[trigger] dog number {i}\na photo of a dog {i}\nsks on grass")
        (work / "ready").write_text("")
    return paths


def configurations(p):
    """name -> (flags, processes); every run 4 optimizer steps of the tiny models at 32 px."""
    dev = ["--pretrained_model_name_or_path", str(p["dev"]), "--text_encoder_out_layers", *map(str, TEXT_ENCODER_OUT_LAYERS)]
    klein = ["--pretrained_model_name_or_path", str(p["klein"]),
             "--text_encoder_out_layers", *map(str, KLEIN_TEXT_ENCODER_OUT_LAYERS)]
    common = ["--instance_prompt", "a photo of sks dog", "--resolution", "32", "--train_batch_size", "1",
              "--learning_rate", "1e-3", "--max_sequence_length", "64", "--seed", "0", "--report_to", "none",
              "--max_train_steps", "4", "--checkpointing_steps", "2", "--rank", "4", "--lora_alpha", "8"]
    images = ["--instance_data_dir", str(p["images"])]
    return {
        "dev-captions-buckets-flip-cached-accum": (dev + images + common + [
            "--use_aspect_ratio_buckets", "--random_flip", "--cache_latents", "--gradient_accumulation_steps", "2"], 1),
        "dev-uncached-sample-shift": (dev + images + common + ["--latent_sampling", "sample", "--timestep_shift", "auto",
                                                              "--lora_dropout", "0.1"], 1),
        "klein": (klein + images + common + ["--cache_latents", "--validation_prompt", "a dog",
                                             "--num_validation_images", "1", "--validation_inference_steps", "2"], 1),
        "prior-caption-dropout": (dev + images + common + [
            "--with_prior_preservation", "--class_data_dir", str(p["class"]), "--class_prompt", "a photo of a dog",
            "--num_class_images", "3", "--caption_dropout", "0.3", "--prior_loss_weight", "0.7"], 1),
        "masked-loss": (dev + ["--instance_data_dir", str(p["masked"])] + common + ["--masked_loss", "--cache_latents"], 1),
        "edit": (klein + ["--instance_data_dir", str(p["targets"]), "--cond_data_dir", str(p["conds"])] + common +
                 ["--cache_latents"], 1),
        "ema": (dev + images + common + ["--use_ema", "--ema_decay", "0.9"], 1),
        "resumed": (dev + images + common + ["--cache_latents"], 1),  # run to step 2, then resumed to 4 (below)
        "two-processes": (dev + images + common + ["--cache_latents", "--random_flip"], 2),
        "alternatives-trigger": (dev + ["--instance_data_dir", str(p["alts"])] + common + [
            "--trigger_word", "sks", "--cache_latents"], 1),
        "output-preservation": (dev + ["--instance_data_dir", str(p["alts"])] + common + [
            "--trigger_word", "sks", "--output_preservation", "--class_word", "dog", "--cache_latents"], 1),
        "two-sizes": (dev + images + common + ["--resolution", "32,48", "--cache_latents"], 1),
        "lokr": (dev + images + common + ["--adapter", "lokr", "--cache_latents"], 1),
    }


def run(name, flags, processes, work):
    out = work / "runs" / name
    subprocess.run(["rm", "-rf", str(out)], check=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(work / "runs" / f"{name}-xdg"),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if processes == 1:
        cmd = [sys.executable, str(SCRIPT)]
    else:
        port = 29500 + sum(map(ord, name)) % 1000
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
               str(port), str(SCRIPT)]
        env["ACCELERATE_USE_CPU"] = "true"
    if name == "resumed":  # stop at step 2 (as a shorter run), then continue from its checkpoint to step 4
        at = flags.index("--max_train_steps")
        short = flags[:at + 1] + ["2"] + flags[at + 2:]
        first = subprocess.run(cmd + short + ["--output_dir", str(out)], env=env, capture_output=True, text=True)
        if first.returncode:
            return name, f"exit {first.returncode}: {first.stderr[-2000:]}"
        (out / "pytorch_lora_weights.safetensors").unlink()
        flags = flags + ["--resume_from_checkpoint", "latest"]
    proc = subprocess.run(cmd + flags + ["--output_dir", str(out)], env=env, capture_output=True, text=True)
    found = sorted(set(re.findall(r"LoRA fingerprint ([0-9a-f]{16})", proc.stderr)))
    if proc.returncode or len(found) != 1:
        return name, f"exit {proc.returncode}, fingerprints {found}: {proc.stderr[-2000:]}"
    return name, f"{found[0]}/{file_digest(out / 'pytorch_lora_weights.safetensors')}"


def file_digest(path):
    """The saved LoRA's tensors (what --use_ema, the layout and the dtype make of the trained weights), 12 hex digits."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for key, value in sorted(load_file(str(path)).items()):
        digest.update(key.encode() + value.float().numpy().tobytes())
    return digest.hexdigest()[:12]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--compare", type=Path)
    parser.add_argument("--only", nargs="+")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    configs = configurations(prepare(args.work.resolve()))
    names = args.only or list(configs)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = dict(pool.map(lambda n: run(n, *configs[n], args.work.resolve()), names))
    before = json.loads(args.compare.read_text()) if args.compare else {}
    differ = False
    for name in names:
        verdict = ""
        if args.compare:
            same = before.get(name) == results[name]
            differ |= not same
            verdict = f"  {'SAME' if same else 'DIFFERENT (was ' + str(before.get(name)) + ')'}"
        print(f"{name:40s} {results[name][:200]}{verdict}")
    if args.save:
        args.save.write_text(json.dumps(results, indent=1))
    sys.exit(1 if differ or any(len(v) != 29 for v in results.values()) else 0)


if __name__ == "__main__":
    main()
