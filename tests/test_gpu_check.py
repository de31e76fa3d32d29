"""The GPU check's pieces on the CPU: real_shapes.py writes checkpoints of the real architectures (their sizes checked
on the meta device, the tiny one written and loaded), and gpu_check.sh runs its whole plan on the tiny model."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import ROOT, launch
from tests.tiny_flux2 import build_tiny_flux2, build_tiny_flux2_klein

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import real_shapes  # noqa: E402


@pytest.mark.parametrize("model, transformer_b, text_encoder_b", [
    ("klein4b", 3.88, 4.02),   # FLUX.2 [klein] 4B; Qwen3-4B's model card: 4.0 B
    ("klein9b", 9.08, 8.19),   # [klein] 9B; Qwen3-8B: 8.2 B
    ("dev", 32.22, 24.01),     # [dev]: 32 B; Mistral-Small-3.1-24B: 24 B (untied output layer, vision tower)
])
def test_real_shapes_have_the_real_models_sizes(model, transformer_b, text_encoder_b):
    """Each spec on the meta device (nothing allocated): parameter counts of the published models, and the text
    encoder has the layers the family's default --text_encoder_out_layers read."""
    import transformers

    spec = real_shapes.SPECS[model]
    with torch.device("meta"):
        text_encoder = getattr(transformers, spec.text_encoder)(spec.text_config())
        transformer = real_shapes.build_transformer(spec.transformer, "meta", torch.bfloat16)
    count = lambda m: sum(p.numel() for p in m.parameters()) / 1e9  # noqa: E731
    assert count(transformer) == pytest.approx(transformer_b, abs=0.01)
    assert count(text_encoder) == pytest.approx(text_encoder_b, abs=0.01)
    layers = text_encoder.config.get_text_config().num_hidden_layers
    assert max(spec.out_layers) < layers
    assert spec.transformer["joint_attention_dim"] == text_encoder.config.get_text_config().hidden_size * 3


def test_the_real_shapes_have_one_owner_that_imports_no_benchmark():
    """real_shapes.py owns the FLUX.2 shapes; gpu_step.py imports them (the two once imported each other)."""
    import ast

    import gpu_step

    nodes = list(ast.walk(ast.parse(Path(real_shapes.__file__).read_text())))
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
    assert imported.isdisjoint(path.stem for path in (ROOT / "benchmarks").glob("*.py"))
    assert all(gpu_step.MODELS[name] is spec.transformer for name, spec in real_shapes.SPECS.items())


@pytest.mark.slow
def test_real_shapes_tiny_writes_the_tests_model_in_bf16_shards(tmp_path):
    """--tiny: the tests' tiny [klein] and [dev] (same configs as tiny_flux2.py's), made in bf16, written in shards
    of --shard_size, loadable by diffusers as the Hub folder is."""
    out = tmp_path / "tiny"
    tiny_klein = Path(build_tiny_flux2_klein(str(tmp_path / "tests-tiny")))
    proc = launch(["--tiny", "klein4b", out, "--shard_size", "20KB"], script=ROOT / "benchmarks" / "real_shapes.py",
                  check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--text_encoder_out_layers 1 2 3" in proc.stdout
    for part in ("transformer", "text_encoder", "vae"):
        ours, theirs = (json.loads((folder / part / "config.json").read_text()) for folder in (out, tiny_klein))
        ignore = {"_diffusers_version", "transformers_version", "dtype", "torch_dtype", "_name_or_path"}
        assert {k: v for k, v in ours.items() if k not in ignore} == {k: v for k, v in theirs.items()
                                                                    if k not in ignore}, part
    shards = sorted((out / "transformer").glob("*.safetensors"))
    assert len(shards) > 1 and (out / "transformer" / "diffusion_pytorch_model.safetensors.index.json").exists()
    with safe_open(str(shards[0]), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "model_index.json").read_text())["is_distilled"] is False
    from diffusers import Flux2KleinPipeline
    pipe = Flux2KleinPipeline.from_pretrained(str(out), torch_dtype=torch.bfloat16)
    assert pipe.transformer.config.num_layers == 1 and pipe.tokenizer.chat_template
    # [dev]: the Mistral text encoder and the Hub's PixtralProcessor tokenizer folder
    dev, tiny_dev = tmp_path / "dev", Path(build_tiny_flux2(str(tmp_path / "tests-dev")))
    proc = launch(["--tiny", "dev", dev], script=ROOT / "benchmarks" / "real_shapes.py", check=False, timeout=300)
    assert proc.returncode == 0 and "--text_encoder_out_layers 1 2" in proc.stdout, proc.stdout + proc.stderr
    for part in ("transformer", "text_encoder", "vae"):
        ours, theirs = (json.loads((folder / part / "config.json").read_text()) for folder in (dev, tiny_dev))
        assert {k: v for k, v in ours.items() if k not in ignore} == {k: v for k, v in theirs.items()
                                                                    if k not in ignore}, part
    assert sorted(p.name for p in (dev / "tokenizer").iterdir()) == sorted(p.name for p in (tiny_dev / "tokenizer")
                                                                           .iterdir())
    assert json.loads((dev / "model_index.json").read_text())["tokenizer"] == ["transformers", "PixtralProcessor"]
    # a folder it wrote is written again from scratch: --configs_only over those weights leaves none of them
    real_shapes.main(["--tiny", "klein4b", str(out), "--configs_only"])
    assert not list(out.rglob("*.safetensors")) and (out / "transformer" / "config.json").exists()


@pytest.mark.parametrize("case", ["checkpoint", "file", "shard size", "device"])
def test_real_shapes_refuses_before_writing(case, tmp_path, capsys):
    """OUT holding another checkpoint (new configs over its weights break it), OUT a file, a --shard_size
    save_pretrained cannot read (once after writing part of OUT), a device this machine lacks: exit 2, nothing
    written. The checkpoint is written over with --overwrite."""
    out, argv = tmp_path / "out", ["klein4b", str(tmp_path / "out"), "--tiny"]
    if case == "checkpoint":
        (out / "transformer").mkdir(parents=True)
        (out / "model_index.json").write_text("{}")
        argv, message = argv[:2] + ["--configs_only"], f"OUT {out}: the folder holds files this tool did not write"
    elif case == "file":
        out.write_text("mine")
        message = f"OUT {out}: a file, not a folder"
    elif case == "shard size":
        argv, message = argv + ["--shard_size", "abc"], "argument --shard_size: 'abc': expected a size such as 5GB"
    else:  # not compiled with CUDA here; an invalid device ordinal on a GPU machine
        argv, message = argv + ["--device", "cuda:99"], "--device cuda:99: "
    files = lambda: sorted((str(p), p.is_file() and p.read_text()) for p in tmp_path.rglob("*"))  # noqa: E731
    before = files()
    with pytest.raises(SystemExit) as refused:
        real_shapes.main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and f"error: {message}" in err and "Traceback" not in err, err
    assert files() == before
    if case == "checkpoint":
        real_shapes.main(argv + ["--overwrite"])
        assert json.loads((out / "model_index.json").read_text())["_class_name"] == "Flux2KleinPipeline"


def test_set_flags_replaces_adds_and_removes_values():
    flags = ["--a", "1", "--layers", "9", "18", "27", "--switch", "--b", "x y"]
    assert gpu_check.set_flags(flags, layers=["1", "2"], switch=False, c=True, a="2") == [
        "--b", "x y", "--layers", "1", "2", "--c", "--a", "2"]


def test_figures_read_the_median_after_warm_up_precompute_and_peaks(tmp_path):
    """s/step: the median of the step lines after the first three (compilation stays out); precompute: from loading
    the text encoder to the last image encoded; the peaks from --measure's exit line."""
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / "final-0.png").write_bytes(b"png")
    (tmp_path / "pytorch_lora_weights.safetensors").write_bytes(b"x" * 2_000_000)
    log = "\n".join([
        "2026-11-26 05:59:48,100 INFO __main__: [RANK 0] loading the text encoder",
        "2026-11-26 05:59:51,548 INFO __main__: [RANK 0] loading the VAE",
        "2026-11-26 05:59:52,600 INFO __main__: [RANK 0] encoded 5 of 5 missing images",
        *(f"2026-11-26 06:00:0{i},000 INFO __main__: [RANK 0] step {i}/6 loss 2.1 lr 1.00e-04 {s} s/step peak 9.3 GiB"
          for i, s in enumerate((30.0, 3.0, 2.0, 1.0, 1.2, 1.1), 1)),
        "2026-11-26 06:00:09,000 INFO __main__: [RANK 0] where the time went: start-up 12.5 s (16%), precompute 4.5 s "
        "(6%), training 40.0 s (52%), validation 18.0 s (23%), saving 2.0 s (3%); 77.0 s in all",
        gpu_check.PEAK + '{"peak_allocated_gib": 10.91, "peak_reserved_gib": 13.17}'])
    result = gpu_check.figures(log, tmp_path)
    assert result == dict(steps=6, s_per_step=1.1, precompute_s=4.5, peak_allocated_gib=10.91,
                          peak_reserved_gib=13.17, lora_mb=2.0, validation_pngs=1, startup_s=12.5,
                          precompute_part_s=4.5, training_s=40.0, validation_s=18.0, saving_s=2.0, total_s=77.0)
    assert gpu_check.tqdm_seconds("Steps: 100%|#| 30/30 [00:26<00:00,  1.11it/s, loss=1.1]") == pytest.approx(0.9, 0.01)
    # the diffusers example logs no step lines: its bar's last rate; a line cut into by other output is passed over
    upstream = gpu_check.figures("loading the text encoder (no timestamp)\nSteps:   3%|#| 1/30 [00:03<01:33,  3.23s/it]"
                                 "\rSteps: 100%|#| 30/30 [00:26<00:00,  1.11it/s, loss=1.1]", tmp_path / "none")
    assert upstream["steps"] == 0 and upstream["s_per_step"] == pytest.approx(0.9, 0.01)
    assert "precompute_s" not in upstream and upstream["lora_mb"] is None and upstream["validation_pngs"] == 0


@pytest.fixture(scope="module")
def tiny_check(tmp_path_factory):
    """benchmarks/gpu_check.sh --tiny, once: every run of the plan but the compiled ones (test_speed.py compiles) and
    the 48 and 16 GB ones, the [klein] 9B ones (on the CPU the tiny 9B is the tiny 4B, and the 24 GB one runs the same
    code), QLoRA's (on the CPU its stand-in is the int8 text encoder, whose whole run test_captions_preservation.py
    makes), readme (the README's command as `whole` runs it, shorter: `whole` is checked for both) and dev (on the CPU
    the tiny model's step, as `step`'s first row)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(tmp / "out"), PYTHON=sys.executable)
    skip = "compile,step_compile,readme,readme_48gb,readme_16gb,nf4,build_klein9b,klein9b,klein9b_24gb,dev"
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--tiny", "--work", str(tmp / "work"), "--skip", skip],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    return proc, tmp


@pytest.mark.slow
def test_gpu_check_tiny_runs_the_readme_command_and_the_step_rows(tiny_check):
    """The README's first command, as written, on the checkpoint real_shapes.py wrote: it trains its steps, saves the
    LoRA, validates, and each figure reaches the JSON lines and the table printed last."""
    proc, tmp = tiny_check
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["name"]: r for r in map(json.loads, (tmp / "out" / "gpu_check.jsonl").read_text().splitlines())}
    assert list(results) == ["build", "whole", "step", "readme_24gb", "no_gc", "dev_nf4"]
    # the README's command scaled with its validation schedule: its time split as the script logs it (issue 54)
    whole = results["whole"]
    assert whole["rc"] == 0 and whole["steps"] == 6 and whole["validation_s"] > 0 and whole["training_s"] > 0
    assert whole["startup_s"] + whole["precompute_part_s"] + whole["training_s"] + whole["validation_s"] + whole[
        "saving_s"] == pytest.approx(whole["total_s"], abs=0.3)
    assert "--validation_epochs 1 " in whole["command"] and "--max_train_steps 6" in whole["command"]
    assert whole["s_per_step"] > 0 and whole["precompute_s"] >= 0 and whole["lora_mb"] > 0
    assert whole["validation_pngs"] >= 1 and "--memory_plan auto" in whole["command"]
    assert "--gradient_checkpointing" not in results["no_gc"]["command"]
    assert "--memory_plan" not in results["no_gc"]["command"]
    # the card the GPU pretends to be is the card planned for: the plan's estimate and flags are its figures
    planned = results["readme_24gb"]
    assert "--gpu_memory 24GB" in planned["command"] and planned["plan_gib"] >= 0 and planned["plan_flags"]
    assert planned["steps"] == 3 and (tmp / "work" / "whole" / "pytorch_lora_weights.safetensors").exists()
    steps = [json.loads(x) for x in (tmp / "out" / "gpu_step.jsonl").read_text().splitlines()]
    assert [(r["gc"], r["swap"]) for r in steps] == [("on", "0"), ("off", "0"), ("on", "half")]
    assert all(r["s_per_step"] > 0 for r in steps)
    log = (tmp / "out" / "gpu_check.log").read_text()
    assert re.search(r"^torch \S+ diffusers \S+ transformers \S+ accelerate \S+ peft \S+$", log, re.M)
    assert log.splitlines()[-1].startswith("| tiny eager gc on bf16 64px swap half")  # the table is last
    assert "| whole | 0 |" in log and "| no_gc | 0 |" in log and "| readme_24gb | 0 |" in log
    assert re.search(r"^\| whole \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d+% \|$", log, re.M)


@pytest.mark.slow
def test_lora_check_applies_the_runs_lora_to_its_checkpoint(tiny_check, tmp_path):
    """benchmarks/lora_check.py (the CPU proof's check): the README run's LoRA lands whole on the checkpoint it was
    trained on; a file missing one tensor is caught."""
    from safetensors.torch import load_file, save_file

    import lora_check

    _, tmp = tiny_check
    model, lora = tmp / "work" / "tiny-klein", tmp / "work" / "whole" / "pytorch_lora_weights.safetensors"
    tensors, modules, problems = lora_check.check(str(model), str(lora))
    assert problems == [] and tensors == 2 * modules > 0
    state = load_file(str(lora))
    state.pop(next(k for k in state if k.endswith("lora_B.weight")))
    save_file(state, str(tmp_path / "broken.safetensors"))
    assert lora_check.check(str(model), str(tmp_path / "broken.safetensors"))[2]


@pytest.mark.slow
def test_gpu_check_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("# ")]
    assert names[:14] == ["build", "whole", "readme", "nf4", "build_klein9b", "klein9b", "klein9b_24gb", "step",
                          "readme_24gb", "readme_48gb", "readme_16gb", "no_gc", "compile", "dev"]
    whole = proc.stdout.split("# whole")[1].splitlines()[1]  # the README's command, a fifth as long, its validations
    for flag in ("--max_train_steps 100", "--validation_epochs 25", "--memory_plan auto", "--resolution 1024"):
        assert flag in whole
    assert "--validation_inference_steps" not in whole and "--skip_final_inference" not in whole
    for run, flags in (("nf4", "--bnb_quantization_config_path nf4 --text_encoder_quantization nf4"),
                       ("klein9b_24gb", "klein9b --gpu_memory 24GB")):
        assert proc.stdout.split(f"# {run} ")[1].splitlines()[1].endswith(flags)
    assert names[-1] == "step_compile" and "{'GPU_CHECK_CARD_GB': '24'}" in proc.stdout.split("# readme_24gb")[1]
    readme = proc.stdout.split("# readme (")[1].splitlines()[1]
    for flag in ("--resolution 1024", "--max_train_steps 30", "--validation_inference_steps 8",
                 "--memory_plan auto", "--train_batch_size 1", "--cache_latents"):
        assert flag in readme
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("flags, message", [
    (["--budget_s", "-5"], ["error: argument --budget_s: '-5': expected seconds >= 0"]),  # was: the plan, exit 0
    (["--skip", "build,nosuchrun"], ["error: --skip build,nosuchrun: no run named nosuchrun; the runs are build, "
                                     "whole, readme, nf4,", ", step_compile, upstream\n"]),
])
def test_gpu_check_refuses_a_negative_budget_and_an_unknown_run(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        gpu_check.main(["--dry-run", "--work", str(tmp_path / "work"), *flags])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and all(part in err for part in message), err
    assert not (tmp_path / "work").exists()


@pytest.mark.slow
def test_the_whole_run_estimate_is_within_10_percent_of_the_h200_gpu_check():
    """benchmarks/gpu_check.sh on an H200 (2026-11-26), the README's first command on real [klein] 4B shapes (rank 4,
    the default targets): the training step peaked at 9.3 GiB with checkpointing and 22.7 without (its step lines),
    the whole process at 10.91 and 22.71 (validation's decode is the first run's peak). The estimate of each, made
    without a GPU, is within 10%."""
    import gpu_step
    from accelerate import PartialState

    PartialState(cpu=True)
    for gc, step, whole in (("on", 9.3, 10.91), ("off", 22.7, 22.71)):
        row = dict(model="klein4b", mode="eager", attention="native", gc=gc, resolution=1024, batch=1,
                   precision="bf16", swap="0", references=0, baseline=False)
        estimate = gpu_step.estimate(row, gpu_step.MODELS["klein4b"], 4, 512)
        assert estimate["estimate_gib"] == pytest.approx(step, rel=0.1)
        assert estimate["run_gib"] == pytest.approx(whole, rel=0.1)
    assert estimate["validation_gib"] < estimate["run_gib"]  # without checkpointing, training is the peak
    # the same command's later rows (H200, 2026-11-26): [klein] 9B with the plan on the whole card (no checkpointing)
    # and on 24 GB (checkpointing), and [klein] 4B with --bnb_quantization_config_path nf4 (whole process peaks)
    for model, gc, precision, whole in (("klein9b", "off", "bf16", 42.92), ("klein9b", "on", "bf16", 20.66),
                                        ("klein4b", "on", "nf4", 5.73)):
        row = dict(model=model, mode="eager", attention="native", gc=gc, resolution=1024, batch=1,
                   precision=precision, swap="0", references=0, baseline=False)
        assert gpu_step.estimate(row, gpu_step.MODELS[model], 4, 512)["run_gib"] == pytest.approx(whole, rel=0.1)
    # gpu_step.py --memory on the same H200 (rank 16, checkpointing): swapping half the blocks, and NF4 (whose
    # unexplained excess the estimate allows for: NF4_ACTIVATIONS)
    # That run quantised the blocks' linear layers only, and PEFT made the other linear weights float32: counted here
    transformer = gpu_step.build_transformer(gpu_step.MODELS["klein4b"], "meta", torch.bfloat16, nf4=False)
    blocks = {id(p) for b in gpu_step.T.transformer_blocks(transformer) for p in b.parameters()}
    outside = sum(p.numel() for p in transformer.parameters() if p.dim() == 2 and id(p) not in blocks)
    for precision, swap, measured in (("bf16", "half", 7.0), ("bf16", "max", 3.4), ("nf4", "0", 5.7),
                                      ("nf4", "half", 5.2)):
        row = dict(model="klein4b", mode="eager", attention="native", gc="on", resolution=1024, batch=1,
                   precision=precision, swap=swap, references=0, baseline=False)
        then = outside * (4 - gpu_step.NF4_BYTES) / 2**30 if precision == "nf4" else 0
        assert gpu_step.estimate(row, gpu_step.MODELS["klein4b"], 16, 512)["estimate_gib"] + then == pytest.approx(
            measured, rel=0.1), (precision, swap)
    # [dev] NF4 the script's way (every linear layer 4-bit, built so by gpu_step.py), rank 16, checkpointing, on the
    # same H200: 19.7 GiB with half the blocks swapped (the 24 GB plan's kind), 25.6 without; both estimates within 2%
    for swap, measured in (("half", 19.7), ("0", 25.6)):
        row = dict(model="dev", mode="eager", attention="native", gc="on", resolution=1024, batch=1,
                   precision="nf4", swap=swap, references=0, baseline=False)
        assert gpu_step.estimate(row, gpu_step.MODELS["dev"], 16, 512)["estimate_gib"] == pytest.approx(
            measured, rel=0.05), swap


def test_nf4_estimate_counts_the_linear_weights_diffusers_quantises():
    """--bnb_quantization_config_path with load_in_4bit: diffusers' quantiser converts every nn.Linear of the
    transformer (no module skipped), and PEFT's k-bit preparation makes what is left (norm weights) float32. The
    estimate's NF4 weights are exactly that, by diffusers' own quantiser on the meta device."""
    import bitsandbytes as bnb
    import gpu_step
    from accelerate import PartialState
    from diffusers import BitsAndBytesConfig
    from diffusers.quantizers import DiffusersAutoQuantizer

    PartialState(cpu=True)
    config = gpu_step.MODELS["klein4b"]
    quantized = gpu_step.build_transformer(config, "meta", torch.bfloat16, nf4=False)
    quantizer = DiffusersAutoQuantizer.from_config(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
                                                   pre_quantized=False)
    quantizer._process_model_before_weight_loading(quantized, device_map=None, keep_in_fp32_modules=[])
    four_bit = sum(m.weight.numel() for m in quantized.modules() if isinstance(m, bnb.nn.Linear4bit))
    rest = sum(p.numel() for p in quantized.parameters()) - four_bit
    row = dict(model="klein4b", mode="eager", attention="native", gc="on", resolution=1024, batch=1, precision="nf4",
               swap="0", references=0, baseline=False)
    weights, _, _ = gpu_step.T.weight_bytes(gpu_step.meta_model(row, config, 16, "default"), 0, "nf4")
    assert weights == pytest.approx(four_bit * gpu_step.NF4_BYTES + rest * 4, rel=1e-9)
