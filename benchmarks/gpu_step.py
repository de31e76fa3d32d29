"""Seconds per training step, peak GPU memory and model FLOP utilisation of this trainer's own step on real-shaped
FLUX.2 transformers (random weights built directly on the GPU: nothing is downloaded).

Each row builds the transformer of FLUX.2 [klein] 4B, [klein] 9B or [dev] from its config (shapes in
../shared/GPU.md), prepares it with the script's own `prepare_transformer` from the same flags a user passes
(--compile, --attention_backend, --gradient_checkpointing, --do_fp8_training, --blocks_to_swap, --rank), fills the
script's caches with real-shaped cached inputs ([B, 512, joint_attention_dim] prompt embeddings, [B, 128, H/16, W/16]
latents), and times the script's loop body: Prefetcher -> gather_inputs -> training_step (forward, backward, update), with the
per-step host-device sync of the real loop. Median seconds per step after warm-up (compilation and autotuning stay
out), peak allocated GPU memory per row, and MFU = (2 x forward FLOPs, 3 x with gradient checkpointing) / time /
the card's measured bf16 matmul rate (forward = 2 x block parameters x tokens + attention).

    python benchmarks/gpu_step.py                         # the default grid (see --help); on CUDA only
    python benchmarks/gpu_step.py --memory                # the memory table: 1024 px, batch 1, rank 16
    python benchmarks/gpu_step.py --tiny                  # the same code on a tiny model on the CPU (CI smoke test)
    python benchmarks/gpu_step.py --memory --references 0,1   # edit training: one condition image per row

--preservation 0,1 adds --output_preservation rows: the base model's forward of the batch without gradients, then
the batch and its preservation rows trained together (twice the rows); MFU counts all three.
--memory also prints the text encoder's peak while prompts are encoded, per --text_encoder_quantization.

--references R: edit (image-to-image) training, each row with R condition images of the target's size whose tokens
follow the target's (the script's own dataset, caches and step), so the sequence holds (1 + R) x the image tokens.

The memory table puts each row's measured peak next to an estimate made without a GPU (`estimate`: exact weight and
LoRA bytes of the model the script prepares, activations from one forward pass on the meta device) and says which
of 24, 48 and 80 GB cards the row fits, from the measurement where there is one. Its validation column is the whole
run's other peak (the trained transformer resident while the pipeline samples and the VAE decodes, estimated the same
way); the fit takes the larger (benchmarks/gpu_check.sh measures whole runs). Without a GPU (and without --tiny)
it says so and exits 0; with --memory it then prints the estimated table. Rows that run out of memory are reported as OOM; rows are
skipped once --budget_s is spent. Results also go to --out (JSON lines) as they come.
"""

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import random
import statistics
import sys
import time
import unittest.mock
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shapes  # noqa: E402 - the owner of the real FLUX.2 shapes
import train_dreambooth_lora_flux2 as T  # noqa: E402

MODELS = dict(real_shapes.TRANSFORMERS,  # and a tiny one for --tiny, this benchmark's own
              tiny=dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=256,
                        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True))
TEXT_TOKENS = {"tiny": 16}  # real models: 512
PATCH = 16  # pixels per latent token side: 8x VAE, 2x2 patchify


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="klein4b,klein9b,dev")
    p.add_argument("--modes", default="eager,compile", help="eager and/or compile (--compile)")
    p.add_argument("--attention", default="native,_native_flash,_native_efficient,flex")
    p.add_argument("--gc", default="on,off", help="gradient checkpointing")
    p.add_argument("--resolutions", default="512,1024")
    p.add_argument("--batch", default="1,4")
    p.add_argument("--precision", default="bf16,fp8", help="bf16, fp8 (--do_fp8_training), nf4 (bitsandbytes 4-bit)")
    p.add_argument("--swap", default="0", help="--blocks_to_swap: numbers, 'half' or 'max'")
    p.add_argument("--references", default="0", help="condition images per row (edit training); 0: text-to-image")
    p.add_argument("--preservation", default="0", help="0 and/or 1: --output_preservation (a forward without "
                   "gradients, then twice the rows trained)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora_layers", default="default", help="the script's --lora_layers")
    p.add_argument("--baseline", action="store_true", help="add the diffusers example's step as the first row of each "
                   "model: eager, native attention, foreach AdamW, inputs copied synchronously (no prefetch)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per row (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, autotune)")
    p.add_argument("--budget_s", type=float, default=float("inf"), help="start no row after this many seconds")
    p.add_argument("--out", default=None, help="JSON lines, one per row")
    p.add_argument("--memory", action="store_true", help="the memory grid: 1024 px, batch 1, rank 16, eager, native, "
                   "bf16/fp8/nf4 x gradient checkpointing x --blocks_to_swap 0/half/max")
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU: a smoke test of this script")
    args = p.parse_args(argv)
    if args.memory:  # the memory grid where the flags were not given
        grid = dict(modes="eager", attention="native", batch="1", resolutions="64" if args.tiny else "1024",
                    precision="bf16,fp8,nf4", swap="0,half,max")
        for flag, value in grid.items():
            if getattr(args, flag) == p.get_default(flag):
                setattr(args, flag, value)
    if args.tiny:  # tiny defaults where the grid was not given
        for flag, value in (("models", "tiny"), ("resolutions", "32,64"), ("batch", "1,2")):
            if getattr(args, flag) == p.get_default(flag):
                setattr(args, flag, value)
        args.attention = ",".join(a for a in args.attention.split(",") if a in ("native", "_native_math")) or "native"
        args.precision = "bf16"  # fp8 and NF4 need CUDA; swapping runs on the CPU (copies without a side stream)
        args.steps, args.warmup = min(args.steps, 3), 1
    return args


def rows(args):
    """The grid, model by model (each model's rows together, its baseline first)."""
    split = lambda text: [t.strip() for t in text.split(",") if t.strip()]  # noqa: E731
    for model in split(args.models):
        if args.baseline:
            yield dict(model=model, mode="eager", attention="native", gc="on", resolution=int(split(args.resolutions)[-1]),
                       batch=int(split(args.batch)[0]), precision="bf16", swap="0", references=0, baseline=True)
        for mode, attention, gc_, res, batch, precision, swap, refs, keep in itertools.product(
                split(args.modes), split(args.attention), split(args.gc), split(args.resolutions), split(args.batch),
                split(args.precision), split(args.swap), split(args.references), split(args.preservation)):
            if (swap != "0" and gc_ == "off" or swap_count(swap, MODELS[model]) > num_blocks(MODELS[model])
                    or keep == "1" and mode == "compile"):
                continue  # the script refuses swapping without gradient checkpointing, more blocks than exist,
                # and output preservation with --compile
            yield dict(model=model, mode=mode, attention=attention, gc=gc_, resolution=int(res), batch=int(batch),
                       precision=precision, swap=swap, references=int(refs), baseline=False,
                       **({"preservation": 1} if keep == "1" else {}))


def num_blocks(config):
    return config["num_layers"] + config["num_single_layers"]


def swap_count(swap, config):
    """--blocks_to_swap for a row's swap: a number, 'half' or 'max' (all blocks but one)."""
    return {"half": num_blocks(config) // 2, "max": num_blocks(config) - 1}.get(swap) or int(swap)


def script_args(row, config, rank, lora_layers="default"):
    """The flags a user would pass for this row, parsed by the script itself."""
    swap = swap_count(row["swap"], config)
    flags = ["--pretrained_model_name_or_path", "random", "--instance_prompt", "x", "--rank", str(rank),
             "--lora_layers", lora_layers,
             "--lora_alpha", str(rank), "--attention_backend", row["attention"], "--resolution", str(row["resolution"])]
    flags += ["--compile"] * (row["mode"] == "compile") + ["--gradient_checkpointing"] * (row["gc"] == "on")
    flags += ["--do_fp8_training"] * (row["precision"] == "fp8")
    if swap:
        flags += ["--blocks_to_swap", str(swap)]
    args = T.parse_args(flags)
    args.bnb_quantization_config_path = "nf4" if row["precision"] == "nf4" else None  # quantised here, not loaded
    return args


GIB = T.GIB
CARDS = (24, 48, 80)  # GB of the cards the README plans for
NF4_BYTES = T.QUANT_BYTES["nf4"]


def text_encoder_gib(model, quantization, activations_gib=1.0):
    """Peak GPU memory while prompts are encoded, GiB, by the script's estimate (its memory plan's) from the real
    text encoder's config (real_shapes.py) on the meta device."""
    params, kept = text_encoder_size(model)
    gpu, _ = T.text_encoder_peak(params, kept, None if quantization == "none" else quantization)
    return (gpu - T.TEXT_ACTIVATIONS) / GIB + activations_gib


@functools.cache
def text_encoder_size(model):
    """-> (parameters, those quantisation leaves alone) of a model's real text encoder (real_shapes.py)."""
    spec = real_shapes.TINY["dev"] if model == "tiny" else real_shapes.SPECS[model]
    family = SimpleNamespace(text_encoder=spec.text_encoder)
    args = SimpleNamespace(pretrained_model_name_or_path="real", revision=None, cache_dir=None)
    with unittest.mock.patch.object(T, "read_model_json", lambda *_: spec.text_config().to_dict()):
        return T.text_encoder_size(args, family)


def text_encoder_table(models):
    lines = ["Text encoder while prompts are encoded (precompute; freed before training), estimated",
             "| model | --text_encoder_quantization | GiB | fits |", "|---|---|---|---|"]
    for model in models:
        for mode in ("none", "int8", "nf4"):
            gib = text_encoder_gib(model, mode)
            lines.append(f"| {model} | {mode} | {gib:.1f} | {', '.join(f'{gb} GB' for gb in fits(gib)) or 'none'} |")
    return "\n".join(lines)


def estimate(row, config, rank, text_tokens, lora_layers="default"):
    """Peak GPU memory of a row, estimated without a GPU by the script's own estimate (T.MemoryEstimate, what
    --memory_plan auto plans with), GiB: weights, LoRA, activations, the training peak (estimate_gib), validation's
    and the whole run's (run_gib), and the pinned host memory of the swapped blocks."""
    from diffusers import AutoencoderKLFlux2

    transformer = meta_model(row, config, rank, lora_layers)
    with torch.device("meta"):
        vae = AutoencoderKLFlux2() if config["in_channels"] == 128 else None  # the real VAE; tiny rows: none
    memory = T.MemoryEstimate(transformer, vae, row["batch"], image_tokens_of(row), text_tokens,
                              row["resolution"] // (PATCH // 2))
    peak = memory.peak(row["gc"] == "on", swap_count(row["swap"], config), "nf4" if row["precision"] == "nf4" else None)
    return dict(host_gib=peak["host"] / GIB, weights_gib=peak["weights"] / GIB, lora_gib=peak["lora"] / GIB,
                activations_gib=peak["activations"] / GIB, estimate_gib=peak["training"] / GIB,
                validation_gib=peak["validation"] / GIB, run_gib=peak["peak"] / GIB)


def meta_model(row, config, rank, lora_layers):
    """The row's transformer as the script prepares it (LoRA on --lora_layers), on the meta device: shapes only.
    Neither quantised nor converted to fp8: the estimate counts NF4, and fp8 training keeps bf16 weights."""
    from accelerate.utils import DistributedType

    args = script_args(dict(row, swap="0", mode="eager", gc="off"), config, rank, lora_layers)
    args.bnb_quantization_config_path, args.do_fp8_training = None, False
    meta = SimpleNamespace(device=torch.device("meta"), distributed_type=DistributedType.NO, is_main_process=True,
                           state=SimpleNamespace(fsdp_plugin=None))
    with torch.device("meta"):
        return T.prepare_transformer(args, meta, build_transformer(config, "meta", torch.bfloat16, nf4=False))


def fits(peak_gib):
    """The cards a peak fits (T.fits_card: peak x 1.1 + 1.5 GiB within it; an "N GB" card holds about N GiB)."""
    return [gb for gb in CARDS if T.fits_card(peak_gib * GIB, gb * GIB)]


def build_transformer(config, device, dtype, nf4):
    """Random real-shaped transformer made directly on the device, in `dtype` (no float32 copy, no download); nf4:
    every linear layer quantised as the script loads it."""
    transformer = real_shapes.build_transformer(config, "meta" if nf4 else device, dtype)
    if nf4:
        quantize_nf4(transformer, dtype, torch.device(device))
    return transformer


def quantize_nf4(transformer, compute_dtype, device):
    """Every linear layer -> bitsandbytes NF4, as diffusers' BitsAndBytesConfig (load_in_4bit, no skipped modules)
    converts them when the script loads with --bnb_quantization_config_path. Built from the meta device one layer at a
    time: each random bf16 weight is made and quantised on the GPU, then moved to `device` (the CPU for swapped rows).
    Quantising [dev]'s 32 B weights on the CPU took longer than the whole GPU call (H200, 2026-11-26). (Before
    2026-11-26 the blocks' layers only: the H200 NF4 rows of that day.)"""
    import bitsandbytes as bnb

    where = torch.device("cuda") if torch.cuda.is_available() else device
    for name, module in [(n, m) for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]:
        quantized = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                      compute_dtype=compute_dtype, quant_type="nf4", device="meta")
        weight = torch.empty(module.out_features, module.in_features, device=where, dtype=compute_dtype)
        quantized.weight = bnb.nn.Params4bit(weight.normal_(std=0.02), requires_grad=False, quant_type="nf4").to(
            where).to(device)
        if module.bias is not None:
            quantized.bias = torch.nn.Parameter(torch.zeros(module.out_features, device=device, dtype=compute_dtype),
                                                requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(transformer.get_submodule(parent) if parent else transformer, child, quantized)
    for module in transformer.modules():  # what is left: the RMSNorm scales
        for key, param in module.named_parameters(recurse=False):
            if param.is_meta:
                setattr(module, key, torch.nn.Parameter(torch.ones_like(param, device=device)))


def image_tokens_of(row):
    """Image tokens in a row's sequence: the target's, and as many again per condition image (edit training)."""
    return (row["resolution"] // PATCH) ** 2 * (1 + row.get("references", 0))


def forward_flops(config, batch, image_tokens, text_tokens):
    """2 x the block parameters a token passes x tokens, + attention. Each block holds 13 inner^2 weights per stream
    (attention 4, SwiGLU MLP 9; the single-stream block's fused 9 + 4): a double-stream block has two streams, but
    image tokens pass only the image stream's and text tokens only the text stream's."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    block_params = 13 * inner * inner * num_blocks(config)  # per token
    tokens = image_tokens + text_tokens
    attention = 4 * tokens * tokens * inner * num_blocks(config)
    return batch * (2 * block_params * tokens + attention)


def matmul_rate(device):
    """The card's bf16 matmul rate, FLOP/s (8192^3, random data)."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (start.elapsed_time(end) / 1000)


def cached_inputs(row, config, text_tokens, dtype, seed=0):
    """The script's dataset, sampler, loader and caches, filled with real-shaped random entries: what precompute
    leaves behind for one distinct prompt and 8 distinct images of one bucket."""
    side = row["resolution"]
    conditions = lambda i: tuple(T.ImageRecord(name=f"cond{i}-{r}.png", size=(side, side))  # noqa: E731
                                 for r in range(row.get("references", 0)))
    images = [T.ImageRecord(name=f"img{i}.png", size=(side, side), conditions=conditions(i))
              for i in range(max(8, row["batch"]))]
    dataset = T.DreamBoothDataset(images, "x", [(side, side)], seed=seed, center_crop=True, with_pixels=False,
                                  fixed_crops=True)
    g = torch.Generator().manual_seed(seed)
    latents = T.SampleCache()
    for key in dataset.cached_latent_keys():
        latents.put(key, torch.randn(1, config["in_channels"], side // PATCH, side // PATCH, generator=g).to(dtype))
    prompts = T.SampleCache()
    for text in ("x", "x class"):  # the instance prompt and its --output_preservation prompt
        prompts.put(text, torch.randn(1, text_tokens, config["joint_attention_dim"], generator=g).to(dtype))
    sampler = T.BucketBatchSampler(dataset.sample_buckets(), row["batch"], seed)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=T.collate)
    return T.Data(None, None, seed, dataset, sampler, loader), T.Caches(prompts, latents)


def time_row(row, bench, accelerator, rate):
    config = MODELS[row["model"]]
    dtype = torch.bfloat16
    args = script_args(row, config, bench.rank, bench.lora_layers)
    device = accelerator.device
    text_tokens = TEXT_TOKENS.get(row["model"], 512)
    # swapped rows start on the CPU, as the script loads them: the whole model never sits on the GPU
    transformer = build_transformer(config, "cpu" if args.blocks_to_swap else device, dtype, row["precision"] == "nf4")
    transformer = T.prepare_transformer(args, accelerator, transformer)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = T.setup_optimizer(args, params, accelerator)
    if row["baseline"] and device.type == "cuda":  # the example's optimizer: foreach, not fused
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.adam_weight_decay)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    if device.type == "cuda":  # the training peak: the resident weights on, not building or quantising them
        torch.cuda.reset_peak_memory_stats()
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    data, caches = cached_inputs(row, config, text_tokens, dtype)
    named = {n: p for n, p in accelerator.unwrap_model(transformer).named_parameters() if p.requires_grad}
    args.output_preservation_weight = 1.0  # --output_preservation's share of the step (its rows: `preserve` below)
    run = T.Run(data=dataclasses.replace(data, hooks=T.Hooks(args)), caches=caches, weight_dtype=dtype, vae=None,
                latent_stats=None, transformer=transformer, optimizer=optimizer,
                lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), noise_scheduler=scheduler,
                sigmas=scheduler.sigmas.float(), named_params=named,
                guidance=3.5 if config["guidance_embeds"] else None, shift_steps=50)
    prefetch = not row["baseline"]
    preserve = (lambda texts: [t + " class" for t in texts]) if row.get("preservation") else None
    prefetcher = T.Prefetcher(data.loader, 0, lambda m, batch: T.gather_inputs(
        batch, data.dataset, caches, 0.0, random.Random(m), preserve), device)
    if not prefetch:
        prefetcher.stream = None  # synchronous copies from pageable memory, as the example does
    transformer.train()
    times, stop = [], T.StopRequest("")
    for micro, batch, inputs in prefetcher:
        if device.type == "cuda":
            torch.cuda.synchronize()
        tic = time.perf_counter()
        # forward, backward, the loop's per-step host-device sync (the stop and NaN agreement) and the update
        loss, *_ = T.training_step(args, accelerator, run, micro, batch, inputs,
                                  prefetcher.prefetch if prefetch else (lambda: None), stop)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
        if len(times) == bench.warmup + bench.steps:
            break
    seconds = statistics.median(times[bench.warmup:])
    rows_trained = row["batch"] * (2 if row.get("preservation") else 1)  # preservation: twice the rows trained
    flops = forward_flops(config, rows_trained, image_tokens_of(row), text_tokens) * (3 if row["gc"] == "on" else 2)
    if row.get("preservation"):  # and the base model's forward of the batch, without gradients
        flops += forward_flops(config, row["batch"], image_tokens_of(row), text_tokens)
    result = dict(row, s_per_step=seconds, warmup_s=sum(times[:bench.warmup]),
                  peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                  mfu=flops / seconds / rate if rate else None, loss=loss.item())
    return result


def cleanup(accelerator):
    accelerator.free_memory()  # prepare() keeps references to every model and optimizer
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe(row):
    swap = f" swap {row['swap']}" if row["swap"] != "0" else ""
    swap += f" edit x{row['references']}" if row.get("references") else ""
    swap += " +preservation" if row.get("preservation") else ""
    name = "example-like baseline" if row["baseline"] else f"{row['mode']} {row['attention']}"
    return (f"{row['model']:8} {name:26} gc {row['gc']:3} {row['resolution']:4}px b{row['batch']} "
            f"{row['precision']:4}{swap}")


def main(argv=None):
    bench = parse(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not bench.tiny:
        print("no CUDA GPU here: nothing measured (run with --tiny for the CPU smoke test)")
        if bench.memory:
            from accelerate import PartialState

            PartialState(cpu=True)  # the script's logger needs it
            print("\n" + table([dict(row, **estimate(row, MODELS[row["model"]], bench.rank,
                                                     TEXT_TOKENS.get(row["model"], 512), bench.lora_layers)) for row in rows(bench)],
                                "estimated, not measured (no GPU)", memory=True))
            print("\n" + text_encoder_table(dict.fromkeys(r["model"] for r in rows(bench))))
        return 0
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=not cuda)
    rate = matmul_rate(accelerator.device)
    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{device_name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
          + (f", bf16 matmul {rate / 1e12:.0f} TFLOP/s" if rate else ""), flush=True)
    out = open(bench.out, "a") if bench.out else None
    results, start = [], time.perf_counter()
    for row in rows(bench):
        if time.perf_counter() - start > bench.budget_s:
            print(f"skipped (budget): {describe(row)}", flush=True)
            continue
        try:
            result = time_row(row, bench, accelerator, rate)
        except torch.OutOfMemoryError:
            result = dict(row, error="OOM", peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        except Exception as e:  # noqa: BLE001 - a row that cannot run is reported, the others go on
            result = dict(row, error=f"{type(e).__name__}: {str(e)[:300]}")
        cleanup(accelerator)
        if bench.memory:
            result.update(estimate(row, MODELS[row["model"]], bench.rank, TEXT_TOKENS.get(row["model"], 512),
                                   bench.lora_layers))
        results.append(result)
        print(line(result), flush=True)
        if out:
            out.write(json.dumps(dict(result, device=device_name, date=time.strftime("%Y-%m-%d"))) + "\n")
            out.flush()
    print("\n" + table(results, device_name, bench.memory))
    if bench.memory:
        print("\n" + text_encoder_table(dict.fromkeys(r["model"] for r in results)))
    return 1 if bench.tiny and any("error" in r for r in results) else 0  # the CI smoke test fails on any error


def line(r):
    if "error" in r:
        peak = f" (peak {r['peak_gib']:.1f} GiB)" if r.get("peak_gib") else ""
        return f"{describe(r)}  {r['error']}{peak}"
    peak = f"{r['peak_gib']:6.1f} GiB" if r["peak_gib"] is not None else "     - GiB"
    mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] else "    -"
    estimated = f"  estimate {r['estimate_gib']:.1f} GiB" if "estimate_gib" in r else ""
    return f"{describe(r)}  {r['s_per_step']:8.3f} s/it  {peak}  MFU {mfu}  (warm-up {r['warmup_s']:.0f} s){estimated}"


def table(results, device_name, memory=False):
    if memory:
        return memory_table(results, device_name)
    head = "| model | step | attention | grad ckpt | px | batch | precision | swap | refs | s/it | peak GiB | MFU |"
    lines = [f"{device_name}, {time.strftime('%Y-%m-%d')}", head, "|" + "---|" * 12]
    for r in results:
        step = "example-like" if r["baseline"] else r["mode"]
        cells = [r["model"], step + " +preservation" * bool(r.get("preservation")), r["attention"], r["gc"],
                 r["resolution"], r["batch"], r["precision"], r["swap"], r.get("references", 0)]
        if "error" in r:
            cells += [r["error"], f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-", "-"]
        else:
            cells += [f"{r['s_per_step']:.3f}", f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-",
                      f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def memory_table(results, device_name):
    """The memory grid: measured peak (where a GPU ran the row) next to the estimate, and the cards the row fits,
    from the measured peak where there is one (marked m), else from the estimate (marked e)."""
    head = ("| model | precision | grad ckpt | swap | s/it | peak GiB | estimate GiB (weights + LoRA + activations) "
            "| validation GiB | pinned host GiB | fits |")
    lines = [f"{device_name}, {time.strftime('%Y-%m-%d')}, 1024 px unless noted", head, "|" + "---|" * 10]
    for r in results:
        measured = r.get("peak_gib") if "error" not in r else None
        speed = r["error"] if "error" in r else f"{r['s_per_step']:.3f}" if "s_per_step" in r else "-"
        estimated = (f"{r['estimate_gib']:.1f} ({r['weights_gib']:.1f} + {r['lora_gib']:.1f} + "
                     f"{r['activations_gib']:.1f})")
        if r.get("error") == "OOM":
            cards = "none (OOM)" if torch.cuda.is_available() else "-"
        else:
            # the step measured, the run's validation estimated (the whole script's peak: gpu_check.sh)
            peak = max(measured, r["validation_gib"]) if measured is not None else r["run_gib"]
            cards = ", ".join(f"{gb} GB" for gb in fits(peak))
            cards = f"{cards or 'none'} ({'m' if measured is not None else 'e'})"
        swap = r["swap"] if r["swap"] == "0" else f"{r['swap']} ({swap_count(r['swap'], MODELS[r['model']])})"
        model = r["model"] + ("" if r["resolution"] == 1024 else f" {r['resolution']} px")
        model += f" edit ({r['references']} ref)" if r.get("references") else ""
        cells = [model, r["precision"], r["gc"], swap, speed, f"{measured:.1f}" if measured is not None else "-",
                 estimated, f"{r['validation_gib']:.1f}", f"{r['host_gib']:.1f}", cards]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
