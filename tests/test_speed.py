"""Speed levers on the CPU: --compile trains like eager (inductor runs on the CPU), --attention_backend is used and
refused where it cannot train, the overlapped data path gives the step the same inputs as a plain lookup, fused
AdamW on CUDA only, and the GPU benchmark's --tiny mode runs the script's own step."""

import json
import random
import shutil
import sys

import pytest
import torch
from types import SimpleNamespace

import train_dreambooth_lora_flux2 as T
from tests.conftest import ROOT, base_args, launch
from tests.tiny_flux2 import JOINT_ATTENTION_DIM, MAX_SEQUENCE_LENGTH

BENCHMARKS = ROOT / "benchmarks"  # run as scripts, forked from the zygote (tests/zygote.py) like the script's runs


def _args(tiny_model, images, tmp_path, *extra):
    return T.parse_args(base_args(tiny_model, images, tmp_path / "out", "--rank", "4", *extra))


def _train(args, tiny_model, shapes, steps_per_shape=2, preservation=0.0):
    """A few steps of the script's own step on fixed inputs -> (losses, LoRA state). Each shape is a bucket. With a
    `preservation` weight each step also has two preservation prompts (--output_preservation)."""
    from accelerate import Accelerator
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    transformer = T.prepare_transformer(args, accelerator, T.load_transformer(args, torch.float32))
    named = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    optimizer = T.setup_optimizer(args, list(named.values()), accelerator)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_model, subfolder="scheduler")
    args.output_preservation_weight = preservation  # the option's step share, at this weight
    run = T.Run(data=T.Data(None, None, 0, None, None, None, hooks=T.Hooks(args)), caches=None,
                weight_dtype=torch.float32, vae=None, latent_stats=None, transformer=transformer, optimizer=optimizer,
                lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), noise_scheduler=scheduler,
                sigmas=scheduler.sigmas.float(), named_params=named, guidance=3.5, shift_steps=50)
    g = torch.Generator().manual_seed(1)
    losses, micro = [], 0
    for h, w in shapes:
        for _ in range(steps_per_shape):
            prompts = 2 if preservation else 1  # [the rows' prompt, their preservation prompt]
            inputs = T.StepInputs(torch.randn(prompts, MAX_SEQUENCE_LENGTH, JOINT_ATTENTION_DIM, generator=g),
                                  torch.tensor([0, 0] + [1, 1] * bool(preservation)), torch.randn(2, 4, h, w, generator=g),
                                  torch.arange(2), encoded=True, extra_rows=2 if preservation else 0)
            loss, *_ = T.training_step(args, accelerator, run, micro, {"indices": [0, 1]}, inputs, lambda: None,
                                      T.StopRequest(""))
            losses.append(loss.item())
            micro += 1
    return losses, {n: p.detach().clone() for n, p in named.items()}


@pytest.mark.slow
def test_compile_trains_like_eager_with_bounded_recompiles(tiny_model, images, tmp_path):
    """Regional compilation: the same losses and LoRA as eager to float32 rounding (inductor reorders sums:
    rtol 1e-4), over two buckets (a new shape recompiles once, with dynamic shapes) and three steps each."""
    from torch._dynamo.utils import counters

    shapes = [(4, 4), (4, 6), (6, 4)]
    eager_losses, eager_lora = _train(_args(tiny_model, images, tmp_path), tiny_model, shapes)
    torch._dynamo.reset()
    counters.clear()
    compiled_losses, compiled_lora = _train(_args(tiny_model, images, tmp_path, "--compile"), tiny_model, shapes)
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-4, atol=1e-6)
    assert compiled_lora.keys() == eager_lora.keys()  # names unchanged: checkpoints and resume are unaffected
    for name in eager_lora:
        torch.testing.assert_close(compiled_lora[name], eager_lora[name], rtol=1e-4, atol=1e-6)
    # per block class (one double-stream, one single-stream block here): a static graph for the first shape, a
    # dynamic one from the second shape on, and nothing for the third. (With several double-stream blocks the first
    # one, whose input does not require grad, gets one more graph per regime.)
    assert counters["stats"]["unique_graphs"] == 4


def test_compile_compiles_every_repeated_block(tiny_model, images, tmp_path):
    from accelerate import Accelerator

    args = _args(tiny_model, images, tmp_path, "--compile")
    transformer = T.prepare_transformer(args, Accelerator(cpu=True), T.load_transformer(args, torch.float32))
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    assert all("forward" in vars(b) and hasattr(vars(b)["forward"], "_torchdynamo_orig_callable") for b in blocks)
    assert "forward" not in vars(transformer)  # the model around the blocks stays eager


def test_attention_backend_is_the_one_that_runs(tiny_model, images, tmp_path, monkeypatch):
    """--attention_backend _native_math: every attention call of training goes through that kernel, and the loss
    equals native SDPA's."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    calls = []
    math_kernel = _AttentionBackendRegistry._backends[AttentionBackendName._NATIVE_MATH]

    def counting(*a, **k):
        calls.append(1)
        return math_kernel(*a, **k)

    monkeypatch.setitem(_AttentionBackendRegistry._backends, AttentionBackendName._NATIVE_MATH, counting)
    # set_attention_backend also sets diffusers' process-wide active backend: restored for the tests after this one
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend)
    native, _ = _train(_args(tiny_model, images, tmp_path), tiny_model, [(4, 4)], steps_per_shape=1)
    assert calls == []
    with_math, _ = _train(_args(tiny_model, images, tmp_path, "--attention_backend", "_native_math"), tiny_model,
                          [(4, 4)], steps_per_shape=1)
    assert len(calls) == 2  # one double-stream and one single-stream block
    torch.testing.assert_close(with_math, native, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, reason", [
    ("bogus", "not a diffusers attention backend"),
    ("sage", "no backward pass"),
    ("flash", "flash-attn"),
    ("xformers", "xformers"),
    ("_native_efficient", "needs a CUDA GPU"),
    ("flex", "no backward pass on the CPU"),  # it would fail at the first backward
    ("_native_cudnn", "illegal memory access"),  # refused everywhere: it crashed real-shaped training on an H100
])
def test_attention_backend_that_cannot_train_here_is_refused(name, reason, tiny_model, images, tmp_path):
    if name in ("_native_efficient", "flex") and torch.cuda.is_available():
        pytest.skip(f"a CUDA GPU is here: {name} is usable")
    with pytest.raises(T.UsageError) as refused:
        T.validate_args(_args(tiny_model, images, tmp_path, "--attention_backend", name))
    message = str(refused.value)
    assert message.startswith(f"--attention_backend {name}: ") and reason in message
    assert "usable here: native, " in message and "_native_math" in message and "sage" not in message.split("usable")[1]


@pytest.mark.slow
def test_bad_attention_backend_exits_2_before_loading_anything(tiny_model, images, tmp_path):
    proc = launch(base_args(tiny_model, images, tmp_path / "out", "--attention_backend", "sage"), check=False,
                  timeout=300)
    assert proc.returncode == 2 and "--attention_backend sage: no backward pass" in proc.stderr
    assert "loading" not in proc.stderr and not (tmp_path / "out").exists()


def test_prefetched_inputs_equal_a_plain_lookup():
    """The overlapped path moves each distinct entry once and expands on the device: rows equal the per-row
    lookup of the old path, for shared prompts, repeated latents, masks and caption dropout."""
    from tests.test_helpers import _records

    dataset = T.DreamBoothDataset(_records([(32, 32)] * 3, ["same", "same", None]), "sks", [(32, 32)], repeats=2,
                                  seed=0, center_crop=True, random_flip=True, with_pixels=False, fixed_crops=True)
    prompts, latents, masks = T.SampleCache(), T.SampleCache(), T.SampleCache()
    for text in {t for s in range(len(dataset)) for t in dataset.prompt_keys(s)} | {""}:
        prompts.put(text, torch.randn(1, 8, 4))
    for key in dataset.cached_latent_keys():
        latents.put(key, torch.randn(1, 4, 2, 2))
        masks.put(key, torch.rand(1, 1, 2, 2))
    caches = T.Caches(prompts, latents, masks)
    sampler = T.BucketBatchSampler(dataset.sample_buckets(), 3, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=T.collate)
    prepare = lambda m, batch: T.gather_inputs(batch, dataset, caches, 0.5, random.Random(m))  # noqa: E731
    prefetcher = T.Prefetcher(loader, 10, prepare, torch.device("cpu"))
    for step, (micro, batch, inputs) in enumerate(prefetcher):
        assert micro == 10 + step
        slots = batch["indices"]
        texts = T.drop_captions([dataset.prompt_key(s, batch["epoch"]) for s in slots], 0.5, random.Random(micro))
        keys = [dataset.latent_key(s, batch["epoch"]) for s in slots]
        assert inputs.embeds.shape[0] == len(set(texts)) and inputs.images.shape[0] == len(set(keys))  # each once
        assert torch.equal(inputs.embeds[inputs.embed_rows], torch.cat([prompts[t] for t in texts]))
        assert torch.equal(inputs.images[inputs.image_rows], torch.cat([latents[k] for k in keys]))
        assert torch.equal(inputs.masks[inputs.image_rows], torch.cat([masks[k] for k in keys]))
        if step == 5:  # across an epoch boundary (2 batches per epoch)
            break


def test_fused_adamw_only_on_cuda(tiny_model, images, tmp_path):
    """Fused AdamW where the accelerator is a CUDA one (a stand-in: the fused kernel also exists on the CPU), not
    under FSDP, on the CPU, or with the 8-bit optimizer."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    def optimizer(device, kind=DistributedType.NO, *flags):
        accelerator = SimpleNamespace(device=torch.device(device), distributed_type=kind, num_processes=1)
        return T.setup_optimizer(_args(tiny_model, images, tmp_path, *flags), [torch.nn.Parameter(torch.zeros(2))],
                                 accelerator)

    param = torch.nn.Parameter(torch.zeros(2))
    cpu = T.setup_optimizer(_args(tiny_model, images, tmp_path), [param], Accelerator(cpu=True))
    assert type(cpu) is torch.optim.AdamW and not cpu.defaults["fused"]
    assert optimizer("cuda").defaults["fused"] is True
    assert not optimizer("cuda", DistributedType.FSDP).defaults["fused"]
    assert type(optimizer("cuda", DistributedType.NO, "--use_8bit_adam")).__name__ == "AdamW8bit"


def test_dataloader_workers_default_to_a_share_of_the_cores(monkeypatch):
    """Decoding overlaps training by default: a share of the cores per process (one left for the loop, at most 8);
    none with --cache_latents, whose batches are lists of indices; an explicit count always wins."""
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert T.loader_workers(None, False, 1) == 8
    assert T.loader_workers(None, False, 4) == 3
    assert T.loader_workers(None, False, 16) == 1
    assert T.loader_workers(None, True, 1) == 0
    assert T.loader_workers(2, True, 1) == 2 and T.loader_workers(0, False, 1) == 0


def test_run_state_is_typed_and_a_misspelt_field_is_an_error():
    import dataclasses

    caches = T.Caches(T.SampleCache())
    with pytest.raises(dataclasses.FrozenInstanceError):
        caches.latent = None  # the typo (latents) the frozen dataclass must refuse
    assert {f.name for f in dataclasses.fields(T.Run)} >= {"transformer", "optimizer", "named_params", "guidance"}
    assert all(dataclasses.fields(cls) and cls.__dataclass_params__.frozen for cls in (T.Data, T.Caches, T.Run))


@pytest.mark.slow
def test_gpu_benchmark_tiny_mode_runs_the_script_step():
    """Eager and --compile rows (inductor on the CPU) through the script's own step, text-to-image and edit (one
    condition image per row, through the script's dataset, caches and step)."""
    def rows_of(modes, references):  # the rows are modes x references: an edit row compiled would be 90 s more
        proc = launch(["--tiny", "--steps", "2", "--batch", "1", "--resolutions", "32", "--gc", "on", "--modes", modes,
                       "--references", references], script=BENCHMARKS / "gpu_step.py", check=False, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout, [line for line in proc.stdout.splitlines() if line.startswith("| tiny |")]

    out, rows = rows_of("eager,compile", "0")
    edit_out, edit_rows = rows_of("eager", "1")
    assert len(rows) == 2 and "| eager | native | on | 32 | 1 | bf16 | 0 | 0 |" in rows[0]
    assert "| compile | native | on | 32 | 1 | bf16 | 0 | 0 |" in rows[1]
    assert len(edit_rows) == 1 and "| eager | native | on | 32 | 1 | bf16 | 0 | 1 |" in edit_rows[0]
    assert all(float(row.split("|")[10]) > 0 for row in rows + edit_rows)
    assert "edit x1" in edit_out and "edit x1" not in out


@pytest.mark.slow
def test_gpu_benchmark_memory_mode_tiny_runs_swapping_rows_and_estimates(tmp_path):
    """--memory in --tiny mode: the grid's rows (swapping only with checkpointing, as the script demands) run the
    script's step, swapping included, and each carries its estimate; swapped rows need pinned host memory."""
    out = tmp_path / "rows.jsonl"
    proc = launch(["--tiny", "--memory", "--steps", "1", "--out", out], script=BENCHMARKS / "gpu_step.py", check=False,
                  timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["gc"], r["swap"]) for r in rows] == [("on", "0"), ("on", "half"), ("on", "max"), ("off", "0")]
    assert all(r["s_per_step"] > 0 and r["estimate_gib"] > 0 for r in rows)
    assert [r["host_gib"] > 0 for r in rows] == [False, True, True, False]
    assert "| tiny 64 px | bf16 | on | max (2) |" in proc.stdout


@pytest.mark.slow
def test_memory_estimate_counts_swapped_blocks_and_matches_the_h100_figures():
    """The estimate on real [klein] 4B shapes (meta device, nothing allocated): swapping N blocks removes N - 2 of
    them from the GPU and puts N in pinned host memory; NF4 weights are about a quarter of bf16; checkpointing keeps
    a fraction of the activations. Against the two rows measured on an H100 (README; the script then adapted
    to_k, to_q, to_v, to_out.0): 8.9 GiB with checkpointing, 19.7 without; the estimate may err high, by < 8%."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_step as G
    from accelerate import PartialState

    PartialState(cpu=True)
    config = G.MODELS["klein4b"]

    def estimate(gc="on", precision="bf16", swap="0", layers="default", references=0):
        row = dict(model="klein4b", mode="eager", attention="native", gc=gc, resolution=1024, batch=1,
                   precision=precision, swap=swap, references=references, baseline=False)
        return G.estimate(row, config, 16, 512, layers)

    plain, half = estimate(), estimate(swap="half")
    assert G.swap_count("half", config) == 12  # the last 12 of 25 blocks: single-stream blocks, all the same size
    block = half["host_gib"] / 12
    assert plain["host_gib"] == 0 and abs((plain["weights_gib"] - half["weights_gib"]) - 10 * block) < 1e-9
    assert 0.25 < estimate(precision="nf4")["weights_gib"] / plain["weights_gib"] < 0.35
    assert estimate(gc="off")["activations_gib"] > 4 * plain["activations_gib"]
    old_default = "to_k,to_q,to_v,to_out.0"
    for gc, measured in (("on", 8.9), ("off", 19.7)):
        assert measured <= estimate(gc=gc, layers=old_default)["estimate_gib"] < 1.08 * measured
    assert G.fits(8.9) == [24, 48, 80] and G.fits(30) == [48, 80] and G.fits(80) == []
    # edit training with one condition image: the same weights, activations for twice the image tokens (+ 512 text)
    edit = estimate(references=1)
    assert edit["weights_gib"] == plain["weights_gib"]
    assert 1.7 < edit["activations_gib"] / plain["activations_gib"] < 2.0


@pytest.mark.slow
def test_data_path_benchmark_tiny_mode_shows_one_copy_per_distinct_entry():
    """benchmarks/step.py --tiny: every scenario runs the script's lookup; a batch of 4 rows sharing one prompt moves
    one embedding after (16 x 32 bf16 = 1 kB, + 4 latents of 256 B), four before."""
    proc = launch(["--tiny"], script=BENCHMARKS / "step.py", check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in proc.stdout.splitlines()
            if line.startswith(("memory ", "disk "))}
    assert len(rows) == 8
    for cache in ("memory", "disk"):
        assert rows[(cache, "4", "shared")][2:4] == ["0.005", "0.002"]
        assert rows[(cache, "4", "distinct")][2:4] == ["0.005", "0.005"]
        assert rows[(cache, "1", "shared")][2:4] == ["0.001", "0.001"]


@pytest.mark.slow
def test_compiled_run_resumes_an_eager_checkpoint_with_checkpointing_and_validation(tiny_model, images, tmp_path):
    """The whole script with --compile and --gradient_checkpointing, resuming at step 2 from a checkpoint an eager
    run wrote, with validation (its no-grad graphs) on: the same LoRA as the eager run's 4 steps (rtol 1e-4: inductor
    reorders float32 sums), so compiled blocks change neither parameter names nor the resumed state."""
    from safetensors.torch import load_file

    common = ["--max_train_steps", "4", "--checkpointing_steps", "2", "--gradient_checkpointing", "--validation_prompt",
              "a dog", "--num_validation_images", "1"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    launch(base_args(tiny_model, images, eager, *common))
    compiled.mkdir()
    shutil.copytree(eager / "checkpoint-2", compiled / "checkpoint-2")
    proc = launch(base_args(tiny_model, images, compiled, *common, "--compile", "--resume_from_checkpoint", "latest"))
    assert "at step 2" in proc.stderr and "--compile: 2 blocks compile" in proc.stderr and (compiled / "validation" / "final-0.png").is_file()
    reference, ours = (load_file(str(out / "pytorch_lora_weights.safetensors")) for out in (eager, compiled))
    assert ours.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-6)
    assert not torch.equal(ours[name], load_file(str(eager / "checkpoint-2" / "pytorch_lora_weights.safetensors"))[name])
