"""The wires between the stages: every value one stage hands to another reaches the training step.

The pieces (dataset keys, caches, loss, sigmas) are unit-tested elsewhere; here the real stages run in-process on
the tiny model (prepare_data, precompute, setup_training, train), every loss the loop logs is recorded, and each is
recomputed from first principles: the batch's samples (from the run's sample log), their latents, loss masks and
prompts looked up by key, caption dropout, instance and class rows with the prior weight, the references of an edit
row, the noise and sigma draws. A wire cut anywhere (a mask dropped, rows mixed up, a weight or the references not
passed on) changes a loss, so these tests fail where the unit tests cannot see it."""

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args
from tests.tiny_flux2 import make_images

SEED, PRIOR_WEIGHT, DROPOUT, SHIFT = 0, 0.7, 0.5, 3.0


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _folders(root):
    """Captioned mixed-aspect images, two with mask files and one with an alpha channel; three class images."""
    images = root / "images"
    make_images(str(images))
    for path in [*sorted(images.glob("img_0[0-2].*")), *sorted(images.glob("img_04.*"))]:
        if path.suffix == ".txt":
            continue
        with Image.open(path) as im:
            mask = Image.new("L", im.size, 0)
            mask.paste(255, (0, 0, im.width // 2, im.height))
        mask.save(images / f"{path.stem}_mask.png")
    rgba = np.array(Image.open(images / "img_03.png").convert("RGBA"))
    rgba[:, : rgba.shape[1] // 3, 3] = 0
    Image.fromarray(rgba).save(images / "img_03.png")
    classes = root / "class"
    classes.mkdir()
    for k in range(3):
        Image.new("RGB", (40, 36), (60 * k, 90, 200 - 40 * k)).save(classes / f"c{k}.png")
    return images, classes


def _edit_folders(root):
    targets, conds = root / "targets", root / "conds"
    targets.mkdir()
    conds.mkdir()
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(48, 40), (40, 48), (44, 44), (56, 40)]):
        image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        image.save(targets / f"p{i}.png")
        ImageOps.invert(image).save(conds / f"p{i}.png")
        (targets / f"p{i}.txt").write_text(f"relight scene {i}")
    return targets, conds


def _train(args, accelerator, monkeypatch):
    """The stages of main(), in-process, recording the loss of every optimizer step -> (run, {step: loss})."""
    losses = {}
    real_log_step = T.log_step

    def log_step(args, accelerator, run, bar, global_step, loss, *rest):
        losses[global_step] = loss.item()
        return real_log_step(args, accelerator, run, bar, global_step, loss, *rest)

    monkeypatch.setattr(T, "log_step", log_step)
    cache = T.open_cache(args)
    data = T.prepare_data(args, accelerator, cache)
    caches, vae, latent_stats = T.precompute(args, accelerator, data, torch.float32, cache)
    run = T.setup_training(args, accelerator, data, caches, vae, latent_stats, torch.float32)
    T.train(args, accelerator, run, 0)
    return run, losses


def _samples(args):
    with open(f"{args.output_dir}/{args.logging_dir}/samples-0.jsonl") as f:
        return [json.loads(line) for line in f]


def _reference_loss(run, args, micro, epoch, indices, vae=None):
    """The loss of micro-step `micro`, from the definitions: rows are the batch's instance samples, then their class
    samples; each row's latent, mask and prompt are looked up by the row's key; noise and sigmas are drawn in the
    step's order from its seeded generator."""
    from diffusers import Flux2Pipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    dataset, caches = run.data.dataset, run.caches
    n = dataset.num_samples
    slots = list(indices) + ([n + i for i in indices] if dataset.classes else [])
    keys = [dataset.latent_key(s, epoch) for s in slots]
    rng = random.Random(T.seed_for("caption-dropout", SEED, micro, 0))
    texts = [dataset.prompt_key(s, epoch) for s in slots]
    texts = ["" if r < len(indices) and rng.random() < args.caption_dropout else t for r, t in enumerate(texts)]
    embeds = torch.cat([caches.prompts[t] for t in texts])
    if vae is None:
        latents = torch.cat([caches.latents[k] for k in keys]).float()
        refs = [torch.cat([caches.latents[dataset.condition_keys(k)[r]] for k in keys]).float()
                for r in range(len(dataset.condition_keys(keys[0])))]
    else:
        with torch.no_grad():
            latents = T.encode_images(vae, torch.stack([dataset.pixels(k) for k in keys]), *run.latent_stats).float()
        refs = []
    masks = None
    if args.masked_loss:
        masks = torch.cat([T.reduce_mask(T.key_mask(dataset, k)[None], latents.shape[-2:]) for k in keys])
        assert 0 < masks[: len(indices)].mean() < 1  # masked pixels: a dropped mask would change the loss
    generator = torch.Generator().manual_seed(T.seed_for("step", SEED, micro, 0))
    noise = torch.randn(latents.shape, generator=generator)
    u = compute_density_for_timestep_sampling(args.weighting_scheme, len(slots), args.logit_mean, args.logit_std,
                                              args.mode_scale, generator=generator)
    sigma = run.sigmas[(u * len(run.sigmas)).long().clamp(0, len(run.sigmas) - 1)]
    sigma = T.shift_sigmas(sigma, SHIFT)
    s = sigma.view(-1, 1, 1, 1)
    tokens = Flux2Pipeline._pack_latents((1 - s) * latents + s * noise)
    ids = Flux2Pipeline._prepare_latent_ids(latents)
    if refs:
        tokens = torch.cat([tokens, *(Flux2Pipeline._pack_latents(r) for r in refs)], dim=1)
        ids = torch.cat([ids, Flux2Pipeline._prepare_image_ids([r[:1] for r in refs]).repeat(len(slots), 1, 1)], dim=1)
    with torch.no_grad():
        pred = run.transformer(hidden_states=tokens, timestep=sigma, guidance=torch.full((len(slots),), args.guidance_scale),
                               encoder_hidden_states=embeds, txt_ids=Flux2Pipeline._prepare_text_ids(embeds),
                               img_ids=ids, return_dict=False)[0][:, : latents.shape[-2] * latents.shape[-1]]
    err = compute_loss_weighting_for_sd3(args.weighting_scheme, sigma).view(-1, 1, 1) * (
        pred - Flux2Pipeline._pack_latents(noise - latents)) ** 2
    if masks is None:
        per_row = err.flatten(1).mean(1)
    else:
        m = Flux2Pipeline._pack_latents(masks)
        per_row = (err * m).flatten(1).sum(1) / (m.flatten(1).sum(1) * err.shape[-1])
    loss = per_row[: len(indices)].mean()
    return loss + PRIOR_WEIGHT * per_row[len(indices):].mean() if dataset.classes else loss


# A learning rate this small leaves the weights unchanged in float32, so one model recomputes every step.
STEADY = ("--learning_rate", "1e-30", "--lora_dropout", "0", "--max_sequence_length", "64")


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_every_step_gets_its_rows_masks_prompts_and_prior_weight(cached, tiny_model, tmp_path, accelerator, monkeypatch):
    images, classes = _folders(tmp_path)
    args = T.parse_args(base_args(
        tiny_model, images, tmp_path / "out", *STEADY, "--train_batch_size", "2", "--max_train_steps", "4",
        "--random_flip", "--masked_loss", "--caption_dropout", str(DROPOUT), "--with_prior_preservation",
        "--class_prompt", "a photo of a dog", "--class_data_dir", classes, "--num_class_images", "3",
        "--prior_loss_weight", str(PRIOR_WEIGHT), "--weighting_scheme", "cosmap", "--timestep_shift", str(SHIFT),
        "--precompute_cache_dir", "none", "--dataloader_num_workers", "0", *(["--cache_latents"] if cached else [])))
    run, losses = _train(args, accelerator, monkeypatch)
    samples = _samples(args)
    assert len(samples) == len(losses) == 4 and {s["epoch"] for s in samples} == {0, 1}
    dropped = 0
    for step, sample in enumerate(samples, start=1):
        expected = _reference_loss(run, args, sample["micro_step"], sample["epoch"], sample["indices"],
                                   vae=None if cached else run.vae)
        assert losses[step] == pytest.approx(expected.item(), rel=1e-4), step
        rng = random.Random(T.seed_for("caption-dropout", SEED, sample["micro_step"], 0))
        dropped += sum(rng.random() < DROPOUT for _ in sample["indices"])
    assert 0 < dropped < 8  # some rows trained on the empty prompt, not all


def test_every_edit_step_gets_its_references(tiny_model, tmp_path, accelerator, monkeypatch):
    targets, conds = _edit_folders(tmp_path)
    args = T.parse_args(base_args(
        tiny_model, targets, tmp_path / "out", *STEADY, "--cond_data_dir", conds, "--train_batch_size", "2",
        "--max_train_steps", "3", "--random_flip", "--cache_latents", "--timestep_shift", str(SHIFT),
        "--precompute_cache_dir", "none"))
    run, losses = _train(args, accelerator, monkeypatch)
    for step, sample in enumerate(_samples(args), start=1):
        expected = _reference_loss(run, args, sample["micro_step"], sample["epoch"], sample["indices"])
        assert losses[step] == pytest.approx(expected.item(), rel=1e-4), step
