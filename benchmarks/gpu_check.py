"""The GPU check: the whole script on a real-shaped FLUX.2 [klein] 4B, and the step benchmark's rows, in one run of at
most --budget_s seconds that prints one table last. benchmarks/gpu_check.sh installs the wheels and calls this.

    python benchmarks/gpu_check.py                # on the GPU machine (../shared/GPU.md), OUT=... for the results
    python benchmarks/gpu_check.py --dry-run      # the commands it would run, nothing run
    python benchmarks/gpu_check.py --tiny         # the same runs on the tests' tiny model on the CPU (CI)

In order, each started only while its usual time fits what is left of the budget:
  build     real_shapes.py klein4b: a random-weight checkpoint folder of the real architecture, on this machine's disk
  whole     the README's first command as written, scaled to 100 steps (a fifth of its 500) with its own validation
            flags, so validations and steps keep their proportion: wall time split into start-up, precompute,
            training, validation and saving (the script's last log line; issue 54)
  upstream_whole  the diffusers example on the same folder, steps and validation schedule, when present
  readme    the README's first command, as written (--memory_plan auto plans for this whole GPU), on that folder: 30
            steps at 1024 px, batch 1, one final validation of 8 inference steps (whole-process seconds, precompute
            seconds, s/step, peak GPU memory, the plan's estimated peak and flags)
  nf4       the README command without the plan, with --gradient_checkpointing --bnb_quantization_config_path nf4
            --text_encoder_quantization nf4 (QLoRA as the script loads it)
  build_klein9b, klein9b  the same build and README command for [klein] 9B (9 B transformer + Qwen3 8B, 35 GB: 58 s
            to write, 120 s to run on an H200, 2026-11-26)
  klein9b_24gb  the [klein] 9B README command on this GPU made a 24 GB card
  step      gpu_step.py rows for [klein] 4B at the default LoRA targets: checkpointing on/off x bf16/fp8, eager
  readme_24gb  the README command on this GPU made a 24 GB card (torch.cuda.set_per_process_memory_fraction), with
            --gpu_memory 24GB: the plan for that card must run there, its peak near the plan's estimate
  readme_48gb, readme_16gb  the same at 48 and at 16 GB
  no_gc     the README command without the plan, without --gradient_checkpointing
  compile   the README command without the plan, with --gradient_checkpointing --compile
  dev       gpu_step.py: [dev] at 1024 px, bf16, checkpointing (with --blocks_to_swap half under 100 GiB)
  dev_nf4   gpu_step.py: [dev] NF4 with half the blocks swapped (the 24 GB command's kind: 19.7 GiB, 2.45 s/it on an
            H200, 2026-11-26, from a separate call once quantising moved to the GPU)
  upstream  the diffusers example (benchmarks/upstream/train_dreambooth_lora_flux2_klein.py, fetched, kept out of git)
            on the same folder and flags, when present
  step_compile  gpu_step.py: [klein] 4B compiled, checkpointing, bf16
--skip takes these names, comma-separated (an unknown one is refused, listing them), --budget_s seconds >= 0.
Each run's log is OUT/NAME.log; each result a JSON line in OUT/gpu_check.jsonl (gpu_step's rows in OUT/gpu_step.jsonl).
Whole-script peaks come from the process itself (torch.cuda.max_memory_allocated / max_memory_reserved at exit, through
--measure), s/step is the median of the step lines after the first three (compilation and warm-up stay out).
"""

import argparse
import importlib.util
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "train_dreambooth_lora_flux2.py"
UPSTREAM = ROOT / "benchmarks" / "upstream" / "train_dreambooth_lora_flux2_klein.py"
PEAK = "gpu_check peak"  # the line --measure prints at exit
CARD = "GPU_CHECK_CARD_GB"  # --measure makes the GPU a card of this many GB


def readme_command():
    """The flags of the README's first `accelerate launch train_dreambooth_lora_flux2.py` command."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"accelerate launch train_dreambooth_lora_flux2\.py((?:[^\n]*\\\n)*[^\n]*)", text).group(1)
    return shlex.split(block.replace("\\\n", " "))


def set_flags(flags, **changes):
    """flags with each --name set to its value: a string or list of strings replaces (or adds) the value, True adds
    the switch, False removes the flag and its value."""
    flags = list(flags)
    for name, value in changes.items():
        flag = f"--{name}"
        if flag in flags:
            i = flags.index(flag)
            end = i + 1
            while end < len(flags) and not flags[end].startswith("--"):
                end += 1
            del flags[i:end]
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, *([value] if isinstance(value, str) else value)]
    return flags


def make_images(folder, size, count=5):
    """`count` photos-like RGB images (smooth gradients plus noise), size x size, like the README's five dog photos."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for i in range(count):
        base, freq = rng.uniform(40, 200, 3), rng.uniform(2, 12, 3)
        img = np.stack([base[c] + 50 * np.sin(freq[c] * (xx + (c + 1) * yy)) for c in range(3)], -1)
        img = np.clip(img + rng.normal(0, 10, img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img, "RGB").save(folder / f"dog_{i}.jpg", quality=92)
    return folder


def plan(args, work, out, cuda_gib):
    """-> [(name, argv, usual seconds on an H100/H200[, extra environment])] in priority order."""
    py = sys.executable
    model, images = work / ("tiny-klein" if args.tiny else "klein4b"), work / "images"
    build = [py, str(ROOT / "benchmarks/real_shapes.py"), "klein4b", str(model)] + ["--tiny"] * args.tiny
    model9 = work / ("tiny-klein9b" if args.tiny else "klein9b")
    build9 = [py, str(ROOT / "benchmarks/real_shapes.py"), "klein9b", str(model9)] + ["--tiny"] * args.tiny
    # QLoRA through the script's own loading: NF4 transformer and text encoder (bitsandbytes needs CUDA: int8 text
    # encoder alone on the CPU)
    nf4 = dict(text_encoder_quantization="int8") if args.tiny else dict(bnb_quantization_config_path="nf4",
                                                                         text_encoder_quantization="nf4")
    launch = [py, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
              "--dynamo_backend", "no", "--mixed_precision", "bf16", str(Path(__file__).resolve()), "--measure"]
    flags = set_flags(readme_command(), pretrained_model_name_or_path=str(model), instance_data_dir=str(images),
                      max_train_steps="30", validation_epochs="1000", validation_inference_steps="8",
                      logging_steps="1", seed="0", precompute_cache_dir=str(work / "cache"))
    if args.tiny:  # seconds on a CPU: 64 px, 3 steps, the tiny text encoder's layers
        flags = set_flags(flags, resolution="64", max_train_steps="3", validation_inference_steps="2",
                          text_encoder_out_layers=["1", "2", "3"])

    def script(name, **changes):
        return [*launch, str(SCRIPT), *set_flags(flags, output_dir=str(work / name), **changes)]

    step = [py, str(ROOT / "benchmarks/gpu_step.py"), "--out", str(out / "gpu_step.jsonl"), "--batch", "1",
            "--attention", "native"] + (["--tiny", "--resolutions", "64"] if args.tiny else ["--resolutions", "1024"])
    klein = "tiny" if args.tiny else "klein4b"
    runs = [
        ("build", build, 90),
        ("whole", [*launch, str(SCRIPT), *whole_flags(flags, work, args.tiny)], 300),
    ]
    if UPSTREAM.exists() and importlib.util.find_spec("torchvision"):  # the example needs torchvision
        same = upstream_flags(whole_flags(flags, work, args.tiny), work, "upstream_whole", validate=True)
        runs.append(("upstream_whole", [*launch, str(UPSTREAM), *same], 400))
    runs += [
        ("readme", script("readme"), 110),
        ("nf4", script("nf4", memory_plan=False, gradient_checkpointing=True, **nf4), 100),
        ("build_klein9b", build9, 80),
        ("klein9b", script("klein9b", pretrained_model_name_or_path=str(model9)), 150),
        ("klein9b_24gb", script("klein9b_24gb", pretrained_model_name_or_path=str(model9), gpu_memory="24GB"), 170,
         {CARD: "24"}),
        ("step", step + ["--models", klein, "--modes", "eager", "--gc", "on,off", "--precision", "bf16,fp8"], 90),
        ("readme_24gb", script("readme_24gb", gpu_memory="24GB"), 100, {CARD: "24"}),
        ("readme_48gb", script("readme_48gb", gpu_memory="48GB"), 90, {CARD: "48"}),
        ("readme_16gb", script("readme_16gb", gpu_memory="16GB"), 110, {CARD: "16"}),
        ("no_gc", script("no_gc", memory_plan=False, gradient_checkpointing=False), 90),
        ("compile", script("compile", memory_plan=False, gradient_checkpointing=True, compile=True), 170),
        ("dev", step + ["--models", "tiny" if args.tiny else "dev", "--modes", "eager", "--gc", "on", "--precision",
                        "bf16"] + (["--swap", "half"] if 0 < cuda_gib < 100 else []), 80),
        ("dev_nf4", step + ["--models", "tiny" if args.tiny else "dev", "--modes", "eager", "--gc", "on", "--precision",
                            "bf16" if args.tiny else "nf4", "--swap", "half"], 80),
    ]
    if UPSTREAM.exists() and importlib.util.find_spec("torchvision"):  # the example needs torchvision
        runs.append(("upstream", [*launch, str(UPSTREAM), *upstream_flags(flags, work, "upstream")], 150))
    runs.append(("step_compile", step + ["--models", klein, "--modes", "compile", "--gc", "on", "--precision", "bf16"],
                 120))
    return runs


def whole_flags(flags, work, tiny):
    """The README's first command scaled to a fifth of its 500 steps (100; 6 on the CPU) with its own validation
    schedule (--validation_epochs as written, the pipeline's sampling steps): validations keep their share."""
    readme = readme_command()
    epochs = readme[readme.index("--validation_epochs") + 1]
    # its own cache folder: a user's first run encodes everything, and the readme row after it stays a cold start
    return set_flags(flags, output_dir=str(work / "whole"), precompute_cache_dir=str(work / "whole-cache"),
                     max_train_steps="6" if tiny else "100",
                     validation_epochs="1" if tiny else epochs, logging_steps="25",
                     validation_inference_steps="2" if tiny else False)


def upstream_flags(flags, work, name, validate=False):
    """The same run for the diffusers example; without its validations unless `validate`: it has no flag for their
    sampling steps (its pipeline's 50, four images, at epoch 0 and again after training)."""
    ours_only = dict(validation_inference_steps=False, logging_steps=False, precompute_cache_dir=False)
    if not validate:
        ours_only.update(validation_epochs=False, validation_prompt=False, skip_final_inference=True)
    return set_flags(flags, output_dir=str(work / name), **ours_only)


def tqdm_seconds(log):
    """Seconds per step from the last update of a "Steps" tqdm bar (its smoothed rate; the example logs no steps)."""
    rates = re.findall(r"Steps:\s+100%[^\r\n]*?([\d.]+)(s/it|it/s)", log)
    if not rates:
        return None
    value, unit = rates[-1]
    return float(value) if unit == "s/it" else 1 / float(value)


def figures(log, out_dir):
    """A whole-script run's figures from its log and output folder."""
    def stamp(line):  # None for a line without the logger's timestamp (another process's output ran into it)
        try:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            return None

    lines = log.splitlines()
    logged = re.findall(r" step (\d+)/\d+ loss \S+ lr \S+ ([\d.]+) s/step", log)  # every --logging_steps, and the last
    steps = [float(seconds) for _, seconds in logged]
    result = dict(steps=max((int(n) for n, _ in logged), default=0),
                  s_per_step=statistics.median(steps[3:] or steps) if steps else tqdm_seconds(log))
    start = [t for t in (stamp(x) for x in lines if "loading the text encoder" in x) if t]
    done = [t for t in (stamp(x) for x in lines if re.search(r"encoded \d+ of \d+ missing images|all latents cached",
                                                             x)) if t]
    if start and done:
        result["precompute_s"] = round(done[-1] - start[0], 1)
    part = r"([\d.]+) s \(\d+%\)"
    split = re.search(rf"where the time went: start-up {part}, precompute {part}, training {part}, validation {part}, "
                      rf"saving {part}; ([\d.]+) s", log)
    if split:  # the script's own account of its time (its last log line)
        result.update(zip(("startup_s", "precompute_part_s", "training_s", "validation_s", "saving_s", "total_s"),
                          map(float, split.groups())))
    planned = re.findall(r"chosen: estimated peak ([\d.]+) GiB", log)
    if planned:  # --memory_plan auto's estimate, and the flags it chose
        result.update(plan_gib=float(planned[-1]), plan_flags=re.findall(r"^flags: (.*)$", log, flags=re.M)[-1])
    for line in lines:
        if line.startswith(PEAK):
            result.update(json.loads(line[len(PEAK):]))
    lora = out_dir / "pytorch_lora_weights.safetensors"
    result["lora_mb"] = round(lora.stat().st_size / 1e6, 2) if lora.exists() else None
    result["validation_pngs"] = len(list(out_dir.glob("validation/*.png")))
    return result


def measure(argv):
    """Run the script given (accelerate launch runs this file with --measure SCRIPT ARGS) and print its peak GPU
    memory at exit, whatever the exit."""
    import atexit
    import runpy

    import torch

    def peak():
        if torch.cuda.is_available():
            print(PEAK + json.dumps(dict(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                                         peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))),
                  file=sys.stderr, flush=True)

    atexit.register(peak)
    if os.environ.get(CARD) and torch.cuda.is_available():  # a 24 GB RTX 4090 holds 24,564 MiB (an A10 or L4 about
        # 22.5 GiB: "N GB" here means the larger kind); 1 GiB of it for the CUDA context
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (float(os.environ[CARD]) - 1) * 2**30 / total))
    sys.argv, sys.path[0] = argv, str(Path(argv[0]).resolve().parent)  # as `python SCRIPT` would run it
    runpy.run_path(argv[0], run_name="__main__")


def table(results, steps):
    lines = ["| run | exit | whole s | precompute s | s/step | peak allocated GiB | peak reserved GiB | plan GiB "
             "| LoRA MB | PNGs |", "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in results:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k in ("name", "rc", "wall_s", "precompute_s", "s_per_step",
                                                                 "peak_allocated_gib", "peak_reserved_gib", "plan_gib",
                                                                 "lora_mb",
                                                                 "validation_pngs")) + " |")
    split = [r for r in results if "training_s" in r]
    if split:  # where each whole run's time went, as the script says it
        lines += ["", "| run | start-up s | precompute s | training s | validation s | saving s | validation share |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['startup_s']} | {r['precompute_part_s']} | {r['training_s']} | "
                  f"{r['validation_s']} | {r['saving_s']} | {100 * r['validation_s'] / r['total_s']:.0f}% |"
                  for r in split]
    if steps:
        lines += ["", "| gpu_step.py | s/step | peak GiB | MFU |", "|---|---|---|---|"]
        for r in steps:
            name = f"{r['model']} {r['mode']} gc {r['gc']} {r['precision']} {r['resolution']}px swap {r['swap']}"
            lines.append(f"| {name} | {fmt(r.get('s_per_step'))} | {fmt(r.get('peak_gib'))} | "
                         f"{fmt(r.get('mfu')) if r.get('mfu') is not None else r.get('error', '-')} |")
    return "\n".join(lines)


def seconds(text):
    value = float(text)
    if not value >= 0:  # a negative budget (or nan) would skip every run and say nothing was wrong
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds >= 0")
    return value


def main(argv=None):
    if argv is None and sys.argv[1:2] == ["--measure"]:
        return measure(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny model on the CPU")
    p.add_argument("--skip", default="", help="runs not to start, comma-separated names")
    p.add_argument("--budget_s", type=seconds, default=440, help="start no run whose usual time passes this")
    p.add_argument("--work", default=os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check"),
                   help="where the checkpoint folder, images and runs go")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="logs and JSON lines")
    args = p.parse_args(argv)
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    import torch
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "CPU"
    cuda_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 0
    runs, skip = plan(args, work, out, cuda_gib), [name for name in args.skip.split(",") if name]
    names = list(dict.fromkeys([run[0] for run in runs] + ["upstream"]))  # upstream: where its file is present
    if set(skip) - set(names):
        p.error(f"--skip {args.skip}: no run named {', '.join(sorted(set(skip) - set(names)))}; the runs are "
                f"{', '.join(names)}")
    runs = [run for run in runs if run[0] not in skip]
    if args.dry_run:
        for name, command, usual, *env in runs:
            print(f"# {name} (about {usual} s{', ' + str(env[0]) if env else ''})\n{shlex.join(command)}")
        return 0
    if not cuda and not args.tiny:
        print("no CUDA GPU here: run with --tiny for the CPU check, or --dry-run")
        return 1
    import accelerate, diffusers, peft, transformers  # noqa: E401 - their versions head the log
    print(" ".join(f"{m.__name__} {m.__version__}" for m in (torch, diffusers, transformers, accelerate, peft)),
          flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("gpu_check.jsonl", "gpu_step.jsonl"):  # this run's rows only
        (out / stale).unlink(missing_ok=True)
    make_images(work / "images", 64 if args.tiny else 1024)
    start, results = time.perf_counter(), []
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    for name, command, usual, *extra in runs:
        left = args.budget_s - (time.perf_counter() - start)
        if usual > left and not args.tiny:
            print(f"skipped {name}: about {usual} s, {left:.0f} s left", flush=True)
            results.append(dict(name=name, rc="skipped"))
            continue
        print(f"== {name}: {shlex.join(command)}", flush=True)
        tic = time.perf_counter()
        with open(out / f"{name}.log", "w") as log:  # its own process group: a timeout stops launcher and trainer
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(env, **dict(*extra)),
                                    cwd=work, start_new_session=True)
            try:
                rc = proc.wait(timeout=None if args.tiny else max(left, 30))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        result = dict(name=name, rc=rc, wall_s=round(time.perf_counter() - tic, 1), device=device,
                      date=time.strftime("%Y-%m-%d"), command=shlex.join(command))
        if "train_dreambooth" in " ".join(command):
            result.update(figures((out / f"{name}.log").read_text(errors="replace"), work / name))
        results.append(result)
        with open(out / "gpu_check.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"   rc {rc}, {result['wall_s']} s; last lines:", flush=True)
        print("\n".join("   " + x[-200:] for x in (out / f"{name}.log").read_text(errors="replace")
                        .splitlines()[-3:]), flush=True)
    steps = [json.loads(x) for x in (out / "gpu_step.jsonl").read_text().splitlines()] \
        if (out / "gpu_step.jsonl").exists() else []
    print(f"\n{device}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - start:.0f} s in all\n")
    print(table(results, steps))
    return 0 if all(r["rc"] in (0, "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
