"""Host-side work of the training loop's data path per step, before and after the overlapped data path.

Each step the loop looks up its batch's cached inputs (prompt embeddings, latents) and moves them to the GPU.
Before: every row of the batch was looked up and concatenated on the CPU (a batch of B rows sharing one prompt
copied that [dev] embedding B times), then copied from pageable memory after the step's host-device sync, while
the GPU waited. After: each distinct entry is read once (Caches -> gather_inputs), pinned and copied on a side
stream while the previous step computes (Prefetcher), and expanded on the GPU.

This measures, on the CPU and with the script's own functions, the host milliseconds per step of the lookup and
gather (in-memory cache and the default disk cache, whose entries are read from disk at every lookup), at FLUX.2
[dev] sizes: prompt embeddings [1, 512, 15360] bf16 (15.7 MB), 1024 px latents [1, 128, 64, 64] bf16 (1 MB), and
the bytes that then cross to the GPU. The share of a GPU step is computed against --gpu_step_s (seconds per step
measured by benchmarks/gpu_step.py; see the README). Before, that host time and the copy add to every step; after,
they are hidden while they stay below the GPU's step time.

On a CUDA machine it also times the copy to the GPU: before from pageable memory, after from pinned memory with
non_blocking (what the Prefetcher issues on its side stream).

    .venv/bin/python benchmarks/step.py
    .venv/bin/python benchmarks/step.py --tiny     # tiny shapes, one epoch: a smoke test (CI)
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_dreambooth_lora_flux2 as T  # noqa: E402

EMBED = (1, 512, 15360)  # FLUX.2 [dev]
LATENT = (1, 128, 64, 64)  # 1024 px
TINY_EMBED, TINY_LATENT = (1, 16, 32), (1, 8, 4, 4)


def stores(kind, folder):
    if kind == "memory":
        return {}, {}
    owner = T.DiskCache(folder)
    return (T.DiskStore(Path(folder, "prompts"), lambda k: T.json_digest("p", k), owner),
            T.DiskStore(Path(folder, "latents"), lambda k: T.json_digest("l", list(k)), owner))


def copy_ms(tensors, pinned):
    """Milliseconds to copy `tensors` to the GPU (None without one)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    tic = time.perf_counter()
    for t in tensors:
        t.to("cuda", non_blocking=pinned)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - tic)


def scenario(batch, distinct_prompts, kind, folder, repeats, embed=EMBED, latent=LATENT):
    """-> (ms before, ms after, MB moved before, MB moved after, copy ms before, copy ms after), medians over
    `repeats` epochs of steps."""
    images = [T.ImageRecord(name=f"i{k}", size=(1024, 1024), caption=f"caption {k}" if distinct_prompts else None)
              for k in range(8)]
    dataset = T.DreamBoothDataset(images, "a photo of sks dog", [(1024, 1024)], seed=0, center_crop=True,
                                  with_pixels=False, fixed_crops=True)
    prompt_store, latent_store = stores(kind, folder)
    caches = T.Caches(T.SampleCache(prompt_store), T.SampleCache(latent_store))
    g = torch.Generator().manual_seed(0)
    for s in range(len(dataset)):
        if dataset.prompt_key(s, 0) not in caches.prompts.store:
            caches.prompts.put(dataset.prompt_key(s, 0), torch.randn(embed, generator=g).bfloat16())
    for key in dataset.cached_latent_keys():
        caches.latents.put(key, torch.randn(latent, generator=g).bfloat16())
    sampler = T.BucketBatchSampler(dataset.sample_buckets(), batch, seed=0)
    before, after, moved_before, moved_after, copy_before, copy_after = [], [], 0, 0, [], []
    for step, indices in enumerate(sampler.epoch_batches(0) * repeats):
        batch_ = {"indices": indices, "epoch": 0}
        slots = indices
        tic = time.perf_counter()  # the old path: every row looked up and concatenated
        embeds = torch.cat([caches.prompts[dataset.prompt_key(s, 0)] for s in slots])
        latents = torch.cat([caches.latents[dataset.latent_key(s, 0)] for s in slots])
        before.append(time.perf_counter() - tic)
        moved_before = embeds.nbytes + latents.nbytes
        tic = time.perf_counter()  # the new path (the pinned copy is made on CUDA machines only)
        inputs = T.gather_inputs(batch_, dataset, caches, 0.0, random.Random(step))
        if torch.cuda.is_available():
            inputs = T.each_tensor(inputs, lambda t: t.pin_memory())
        after.append(time.perf_counter() - tic)
        moved_after = inputs.embeds.nbytes + inputs.images.nbytes
        copy_before.append(copy_ms([embeds, latents], pinned=False))
        copy_after.append(copy_ms([inputs.embeds, inputs.images], pinned=True))
    median = lambda ms: statistics.median(ms) if ms[0] is not None else None  # noqa: E731
    return (1000 * statistics.median(before), 1000 * statistics.median(after), moved_before / 1e6, moved_after / 1e6,
            median(copy_before), median(copy_after))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu_step_s", default=None, help="GPU seconds per step to compare with, 'label=s,label=s'")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help=f"embeddings {TINY_EMBED}, latents {TINY_LATENT}, one epoch")
    args = p.parse_args(argv)
    embed, latent = (TINY_EMBED, TINY_LATENT) if args.tiny else (EMBED, LATENT)
    args.repeats = 1 if args.tiny else args.repeats
    steps = dict(item.split("=") for item in args.gpu_step_s.split(",")) if args.gpu_step_s else {}
    print(f"host work per step, {'tiny' if args.tiny else '[dev]'} embeddings {embed} and latents {latent} in bf16, median of "
          f"{args.repeats} epochs ({'with' if torch.cuda.is_available() else 'no'} CUDA: pinning and copies "
          f"{'measured' if torch.cuda.is_available() else 'not measured'})")
    head = (f"{'cache':7} {'batch':>5} {'prompts':9} {'before ms':>10} {'after ms':>9} {'MB before':>10} {'MB after':>9}"
            f" {'copy ms before':>15} {'copy ms after':>14}")
    head += "".join(f" {'share @ ' + k:>16}" for k in steps)
    print(head + "\n" + "-" * len(head))
    with tempfile.TemporaryDirectory() as folder:
        for kind in ("memory", "disk"):
            for batch in (1, 4):
                for distinct in (False, True):
                    b, a, mb, ma, cb, ca = scenario(batch, distinct, kind, Path(folder, f"{batch}{distinct}"),
                                                    args.repeats, embed, latent)
                    row = f"{kind:7} {batch:5} {'distinct' if distinct else 'shared':9} {b:10.1f} {a:9.1f} {mb:10.3f} {ma:9.3f}"
                    row += f" {cb:15.2f} {ca:14.2f}" if cb is not None else f" {'-':>15} {'-':>14}"
                    row += "".join(f" {f'{100 * b / 1000 / float(s):.2f}% -> hidden':>16}" for s in steps.values())
                    print(row, flush=True)
    print("\nbefore: host ms and the copy of 'MB before' come on top of every GPU step (after its sync).\n"
          "after: 'MB after' is copied from pinned memory on a side stream; both overlap the previous GPU step.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
