"""Training-quality features: caption dropout, EMA of the LoRA, masked loss, step-based validation."""

import random

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch
from tests.tiny_flux2 import make_images

LORA, RAW = "pytorch_lora_weights.safetensors", "pytorch_lora_weights_raw.safetensors"


# ---------------------------------------------------------------------------------------------------- caption dropout


def test_caption_dropout_replaces_instance_prompts_only_and_is_seeded():
    keys = ["cap a", "cap b", "cap c"]
    assert T.drop_captions(keys, 0.0, random.Random(0)) == keys
    assert T.drop_captions(keys, 1.0, random.Random(0)) == ["", "", ""]
    draws = [T.drop_captions(keys, 0.5, random.Random(T.seed_for("caption-dropout", 0, m, 0))) for m in range(400)]
    assert 0.4 < sum(d.count("") for d in draws) / 1200 < 0.6
    assert draws == [T.drop_captions(keys, 0.5, random.Random(T.seed_for("caption-dropout", 0, m, 0))) for m in range(400)]
    assert T.drop_captions(keys, [1.0, 0.0, 1.0], random.Random(0)) == ["", "cap b", ""]  # a probability per text
    # the step's rows: class rows (after the instance rows) are never dropped
    ds = T.DreamBoothDataset([T.ImageRecord(name=n, size=(32, 32), caption=f"cap {n}") for n in "ab"], "sks",
                             [(32, 32)], classes=[T.ImageRecord(name="c", size=(32, 32), caption="class")],
                             with_pixels=False)
    prompts = T.SampleCache()
    for text in ("cap a", "cap b", "class", ""):
        prompts.put(text, torch.full((1, 1, 1), float(len(text))))
    caches = T.Caches(prompts, T.SampleCache())
    for key in ds.cached_latent_keys():
        caches.latents.put(key, torch.zeros(1, 4, 2, 2))
    inputs = T.gather_inputs({"indices": [0, 1], "epoch": 0}, ds, caches, 1.0, random.Random(0))
    assert inputs.embeds[inputs.embed_rows].flatten().tolist() == [0.0, 0.0, 5.0, 5.0]


# ---------------------------------------------------------------------------------------------------- EMA


def _params():
    return {"a.lora_A.weight": torch.nn.Parameter(torch.zeros(2, 3)), "a.lora_B.weight": torch.nn.Parameter(torch.ones(3))}


def test_ema_with_decay_zero_is_the_raw_weights_and_warmup_follows_the_formula():
    params = _params()
    ema0, ema = T.LoraEMA(params, 0.0), T.LoraEMA(params, 0.9)
    expected = None
    for step in range(1, 8):
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn_like(p))
        ema0.update(params)
        ema.update(params)
        decay = 0.0 if step == 1 else min(0.9, (1 + step) / (10 + step))
        expected = {n: p.detach().clone() if expected is None else decay * expected[n] + (1 - decay) * p.detach()
                    for n, p in params.items()}
        assert all(torch.equal(ema0.shadow[n], p.detach()) for n, p in params.items())
        assert all(torch.allclose(ema.shadow[n], expected[n], atol=1e-6) for n in params)


def test_ema_applied_swaps_in_the_average_and_restores_the_raw_weights():
    params = _params()
    ema = T.LoraEMA(params, 0.5)
    ema.shadow = {n: torch.full_like(p, 7.0) for n, p in params.items()}
    raw = {n: p.detach().clone() for n, p in params.items()}
    with ema.applied(params):
        assert all((p == 7.0).all() for p in params.values())
    assert all(torch.equal(p, raw[n]) for n, p in params.items())
    restored = T.LoraEMA(params, 0.5)
    restored.load_state_dict(ema.state_dict())
    assert restored.step == ema.step and all(torch.equal(restored.shadow[n], ema.shadow[n]) for n in params)


def test_ema_lora_matches_a_reference_ema_of_the_checkpointed_raw_weights(tiny_model, images, tmp_path):
    out = tmp_path / "out"
    launch(base_args(tiny_model, images, out, "--max_train_steps", "5", "--checkpointing_steps", "1", "--use_ema",
                     "--ema_decay", "0.8", "--validation_prompt", "a dog", "--validation_steps", "2",
                     "--num_validation_images", "1"))
    # alpha = rank (scale 1): the checkpoints' training states hold the raw weights (their portable files the EMA)
    raws = [{f"transformer.{k}": v for k, v in T.read_state(out / f"checkpoint-{s}", "training")["lora"].items()}
            for s in range(1, 6)]
    reference = dict(raws[0])
    for step, raw in enumerate(raws[1:], start=2):
        decay = min(0.8, (1 + step) / (10 + step))
        reference = {k: decay * reference[k] + (1 - decay) * raw[k] for k in raw}
    final, final_raw = load_file(str(out / LORA)), load_file(str(out / RAW))
    assert final.keys() == reference.keys()
    assert all(torch.allclose(final[k], reference[k], rtol=1e-5, atol=1e-7) for k in final)
    assert all(torch.equal(final_raw[k], raws[-1][k]) for k in final_raw)
    assert any(not torch.equal(final[k], final_raw[k]) for k in final)
    # the file a user picks from the progress sheet holds the weights its column shows: the average
    last = load_file(str(out / "checkpoint-5" / LORA))
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in final)
    names = sorted(p.name for p in (out / "validation").iterdir())
    assert names == ["base-0.png", "base.json", "final-0.png", "progress-0.json", "progress-0.png", "step-000002-0.png",
                     "step-000004-0.png"]  # tagged with the step


# ---------------------------------------------------------------------------------------------------- masked loss


def test_masked_loss_gives_no_gradient_outside_the_mask():
    pred = torch.randn(2, 6, 4, requires_grad=True)
    target = torch.randn(2, 6, 4)
    mask = torch.tensor([[1, 1, 0, 0, 0.5, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)[..., None]
    loss = T.masked_loss(pred, target, torch.ones(2), mask).mean()
    loss.backward()
    assert (pred.grad[0, [2, 3, 5]] == 0).all() and (pred.grad[0, [0, 1, 4]] != 0).all()
    assert (pred.grad[1] != 0).all()  # a row with a mask of ones is unmasked
    unmasked = T.flow_matching_loss(pred, target, torch.ones(2))
    assert torch.allclose(T.masked_loss(pred, target, torch.ones(2), torch.ones(2, 6, 1)), unmasked)


def test_masked_loss_is_the_mean_over_the_mask_whatever_its_area():
    """A sample's masked loss is its error averaged over the mask (weights included), so a small mask does not
    shrink the loss: the same per-token error gives the same loss under a mask of 1 token or of 5."""
    target = torch.zeros(3, 6, 4)
    pred = torch.full((3, 6, 4), 2.0)  # squared error 4 everywhere
    pred[0, 5] = 10.0  # a token outside the first mask: must not count
    mask = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [0.5, 0.5, 0, 0, 0, 0]], dtype=torch.float32)[..., None]
    loss = T.masked_loss(pred, target, torch.ones(3), mask)
    torch.testing.assert_close(loss, torch.full((3,), 4.0))
    # hand-computed for unequal errors: sum(mask * err) / (sum(mask) * channels), then the mean over samples
    pred = torch.arange(3 * 6 * 4, dtype=torch.float32).view(3, 6, 4) / 50
    err = pred ** 2
    expected = torch.stack([(err[i] * mask[i]).sum() / (mask[i].sum() * 4) for i in range(3)])
    weighting = torch.tensor([1.0, 2.0, 0.5])
    torch.testing.assert_close(T.masked_loss(pred, target, weighting, mask), weighting * expected)


def test_reduce_mask_is_the_share_of_pixels_per_token():
    mask = torch.zeros(1, 1, 8, 8)
    mask[..., :, :4] = 1
    mask[..., :2, 4:6] = 1
    reduced = T.reduce_mask(mask, (2, 2))
    assert reduced.shape == (1, 1, 2, 2) and reduced[0, 0].tolist() == [[1.0, 0.25], [1.0, 0.0]]


def test_mask_files_and_alpha_become_masks_that_follow_crop_and_flip(tmp_path):
    image = np.zeros((32, 64, 3), np.uint8)
    image[:, :16] = 255
    Image.fromarray(image).save(tmp_path / "a.png")
    mask = np.zeros((32, 64), np.uint8)
    mask[:, :16] = 255  # the mask marks the white stripe
    Image.fromarray(mask).save(tmp_path / "a_mask.png")
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[:, :8, 3] = 255
    Image.fromarray(rgba, "RGBA").save(tmp_path / "b.png")
    Image.new("RGB", (32, 32)).save(tmp_path / "lonely_mask.png")  # no "lonely.png": an ordinary image
    records = T.scan_image_folder(tmp_path)
    assert [r.name for r in records] == ["a.png", "b.png", "lonely_mask.png"]
    assert records[0].mask_path.endswith("a_mask.png") and records[1].mask_path is None
    ds = T.DreamBoothDataset(records, "p", [(32, 32)], random_flip=True, seed=0)
    ds.with_masks = True
    for epoch in range(6):
        key = ds.latent_key(0, epoch)
        pixels, m = ds.pixels(key), T.key_mask(ds, key)
        assert m.shape == (1, 32, 32)
        white = pixels[0] > 0.5
        assert torch.equal(m[0] > 0.5, white)  # the mask went through the same crop and flip as its image
    key = ds.latent_key(1, 0)
    alpha = T.key_mask(ds, key)[0]  # b.png has no mask file: its opaque left quarter is the mask
    opaque = alpha[:, -8:] if key[-1] else alpha[:, :8]
    assert opaque.min() > 0.99 and alpha.sum() == pytest.approx(alpha.numel() / 4)
    assert (T.key_mask(ds, ds.latent_key(2, 0)) == 1).all()


def test_a_16_bit_mask_keeps_its_soft_weights(tmp_path):
    """Segmentation tools export 16-bit masks: 16384 of 65535 weighs 0.25 (Pillow's own conversion clips it to 1)."""
    Image.new("RGB", (32, 32)).save(tmp_path / "dog.png")
    mask = np.full((32, 32), 65535, np.uint16)
    mask[:, 16:] = 16384
    Image.fromarray(mask).save(tmp_path / "dog_mask.png")
    assert Image.open(tmp_path / "dog_mask.png").mode.startswith("I;16")
    ds = T.DreamBoothDataset(T.scan_image_folder(tmp_path, with_masks=True), "p", [(32, 32)], center_crop=True)
    ds.with_masks = True
    row = T.key_mask(ds, ds.latent_key(0, 0))[0, 0]
    assert row[:16].tolist() == [1.0] * 16 and row[16:] == pytest.approx([64 / 255] * 16)


@pytest.mark.slow
@pytest.mark.parametrize("cached", [False, True])
def test_masked_loss_trains_with_mask_files_and_alpha(cached, tiny_model, tmp_path):
    folder = tmp_path / "images"
    make_images(str(folder))
    mask = np.zeros((40, 64), np.uint8)
    mask[:, :20] = 255
    Image.fromarray(mask).save(folder / "img_00_mask.png")
    rgba = np.full((48, 48, 4), 200, np.uint8)
    rgba[:, 24:, 3] = 0
    Image.fromarray(rgba, "RGBA").save(folder / "img_05.png")
    out = tmp_path / "out"
    launch(base_args(tiny_model, folder, out, "--max_train_steps", "6", "--masked_loss",
                     "--caption_dropout", "0.5", *(["--cache_latents"] if cached else [])))
    assert (out / LORA).is_file()


@pytest.mark.parametrize("every_steps", [None, 3])
def test_validation_epochs_count_from_one_and_never_repeat_a_step_validation(every_steps, monkeypatch):
    """--validation_epochs 3 validates after epochs 3, 6, 9 (1-based; the example's 0-based test would also
    validate after the first), not after the last (the final images follow), and not when --validation_steps has
    just validated the same weights."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(T, "run_validation", lambda args, acc, run, tag, step: calls.append((tag, step)))
    args = SimpleNamespace(validation_prompt="a dog", num_validation_images=1, validation_epochs=3, max_train_steps=9,
                           validation_steps=every_steps, skip_final_inference=False, checkpointing_steps=100,
                           output_dir="unused")
    accelerator = SimpleNamespace(is_main_process=True)
    for epoch in range(9):  # one optimizer step per epoch
        step = epoch + 1
        if every_steps:
            T.after_optimizer_step(args, accelerator, None, step, 0)
        T.after_epoch(args, accelerator, None, step, epoch)
    expected = [("epoch-0003", 3), ("epoch-0006", 6)]
    if every_steps:
        expected = [("step-000003", 3), ("step-000006", 6)]
    assert calls == expected

