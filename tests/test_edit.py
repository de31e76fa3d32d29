"""Edit (image-to-image) training: condition images paired with their targets (folders and `datasets` columns),
cropped, flipped and cached with them, packed into the step exactly as the FLUX.2 pipelines pack references, and
validated in edit mode; the refusals; whole runs of both families with resume, several processes, --from_manifest
and the memory options. The learning test is tests/test_edit_learning.py."""

import json
import random
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch, step_generator, step_loss
from tests.tiny_flux2 import KLEIN_TEXT_ENCODER_OUT_LAYERS, MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS

LORA = "pytorch_lora_weights.safetensors"
SIZES = [(96, 64), (64, 96), (80, 80), (112, 64), (64, 64), (72, 120)]  # (w, h): crops in both directions


def _picture(w, h, seed):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    f = rng.uniform(0.05, 0.4, 3)
    image = np.stack([127 + 100 * np.sin(f[c] * xx + (c + 1) * 0.13 * yy) for c in range(3)], -1)
    return Image.fromarray(np.clip(image + rng.normal(0, 10, image.shape), 0, 255).astype(np.uint8), "RGB")


def swap_channels(image):
    r, g, b = image.split()
    return Image.merge("RGB", (b, r, g))


@pytest.fixture
def pairs(tmp_path):
    """Targets (five captioned, mixed formats) and same-stem conditions: each condition is its target inverted, saved
    as PNG whatever the target's format."""
    targets, conds = tmp_path / "targets", tmp_path / "conds"
    targets.mkdir()
    conds.mkdir()
    for i, (w, h) in enumerate(SIZES):
        image = _picture(w, h, i)
        image.save(targets / f"p{i}.{'jpg' if i == 1 else 'png'}", quality=98)
        ImageOps.invert(image).save(conds / f"p{i}.png")
        if i:
            (targets / f"p{i}.txt").write_text(f"relight scene {i}")
    return targets, conds


def edit_args(model, targets, conds, out, *extra, layers=TEXT_ENCODER_OUT_LAYERS):
    """base_args for an edit run at 64 px (the pipelines take conditions of 64 px a side or more)."""
    return base_args(model, targets, out, "--cond_data_dir", conds, "--resolution", "64", *extra, layers=layers)


# ---------------------------------------------------------------------------------------------------------------
# Pairing and cropping


def test_pairing_by_stem_refuses_every_unpaired_image_at_once(tmp_path):
    targets = [T.ImageRecord(name=n, size=(64, 64)) for n in ("a.png", "b.jpg", "c.png")]
    conds = [T.ImageRecord(name=n, size=(64, 64)) for n in ("a.webp", "c.png", "d.png")]
    with pytest.raises(T.UsageError) as refused:
        T.pair_conditions(targets, "T", [("C", conds)])
    message = str(refused.value)
    assert "2 image(s) without a partner" in message
    assert "T/b.jpg: no condition image b.* in C" in message and "C/d.png: no target image d.* in T" in message
    ambiguous = conds[:2] + [T.ImageRecord(name="a.png", size=(64, 64))]
    with pytest.raises(T.UsageError, match=r"a.webp, a.png are the same stem's condition"):
        T.pair_conditions(targets[:1] + targets[2:], "T", [("C", ambiguous)])
    paired = T.pair_conditions(targets[:1] + targets[2:], "T", [("C", conds[:2])])
    assert [(r.name, [c.name for c in r.conditions]) for r in paired] == [("a.png", ["a.webp"]), ("c.png", ["c.png"])]


def test_several_folders_give_each_target_its_references_in_their_order():
    """One folder per reference: target x.* gets x.* of each, in the folders' order; a target missing one of its
    references is refused, every one of them listed with the folder it is missing from."""
    targets = [T.ImageRecord(name=n, size=(64, 64)) for n in ("a.png", "b.jpg", "c.png")]
    first = [T.ImageRecord(name=n, size=(64, 64), caption="1") for n in ("a.png", "b.png", "c.png")]
    second = [T.ImageRecord(name=n, size=(64, 64), caption="2") for n in ("c.webp", "a.jpg", "b.png")]
    paired = T.pair_conditions(targets, "T", [("P", first), ("G", second)])
    assert [[(c.name, c.caption) for c in r.conditions] for r in paired] == [
        [("a.png", "1"), ("a.jpg", "2")], [("b.png", "1"), ("b.png", "2")], [("c.png", "1"), ("c.webp", "2")]]
    with pytest.raises(T.UsageError) as refused:
        T.pair_conditions(targets, "T", [("P", first[1:]), ("G", second[:1]), ("H", first)])
    lines = str(refused.value).splitlines()[1:]
    assert sorted(line.strip() for line in lines) == [
        "T/a.png: no condition image a.* in G", "T/a.png: no condition image a.* in P",
        "T/b.jpg: no condition image b.* in G"]


def test_a_condition_follows_its_targets_crop():
    rng = random.Random(0)
    for size, bucket in [((96, 64), (64, 64)), ((64, 96), (48, 64)), ((80, 80), (64, 48))]:
        for _ in range(5):
            crop = T.draw_crop(size, bucket, False, rng)
            assert T.follow_crop(crop, size, bucket) == crop  # same size: the same pixels, token for token
            double = T.follow_crop(crop, (2 * size[0], 2 * size[1]), bucket)
            assert double == crop  # covering the bucket needs the same resize whatever the source size
    # another aspect: the same relative place along the cropped side, centred along a side that was not cropped
    assert T.follow_crop(((64, 96), 0, 32), (128, 64), (64, 64)) == ((64, 128), 0, 64)
    assert T.follow_crop(((64, 96), 0, 0), (64, 128), (64, 64)) == ((128, 64), 32, 0)


@pytest.mark.parametrize("bucket", [(64, 96), (1024, 1024), (912, 1152), (1152, 912), (1536, 1536), (1024, 2048)])
def test_conditions_are_used_at_the_size_the_pipelines_give_references(bucket):
    """Up to 1024^2 pixels a condition fills its target's bucket; above, it is what Flux2Pipeline makes of a
    reference that large (resized to 1024^2 pixels, sides floored to 16), so inference sees the training size."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    h, w = bucket
    resized = Flux2ImageProcessor._resize_to_target_area(Image.new("RGB", (w, h)), 1024 * 1024) if h * w > 1024**2 \
        else Image.new("RGB", (w, h))
    assert T.reference_size(bucket) == (resized.height // 16 * 16, resized.width // 16 * 16)
    dataset = T.DreamBoothDataset(_records(1)[:1], "x", [bucket], seed=0, with_pixels=False, fixed_crops=True)
    (cond,) = dataset.condition_keys(dataset.latent_key(0, 0))
    assert cond[2] == T.reference_size(bucket) and dataset.pixels(cond).shape[1:] == T.reference_size(bucket)
    condition, edited = T.fit_to_bucket(_picture(w, h, 0), [bucket])
    assert edited == bucket and (condition.height, condition.width) == T.reference_size(bucket)


def test_base_validation_images_are_redone_when_the_condition_changes(tmp_path):
    """validation/base.json holds the conditions' hashes: the same pixels keep the base images, others (or none,
    text-to-image validation; more; another order) remake them."""
    args = SimpleNamespace(num_validation_images=1, pretrained_model_name_or_path="m", revision=None, variant=None,
                           resolution=32, validation_inference_steps=2, validation_guidance_scale=4.0, guidance_scale=3.5,
                           transformer_file=None)
    run = SimpleNamespace(data=SimpleNamespace(seed=0), weight_dtype=torch.float32)
    plain = SimpleNamespace(distributed_type=None)  # no FSDP
    model = SimpleNamespace(config={"_name_or_path": "m"})
    made = lambda condition: T.base_record(args, run, [T.ValidationSpec("p")], [1.0], model, 2, condition)  # noqa: E731
    one, other = _picture(64, 64, 1), _picture(64, 64, 2)
    Image.new("RGB", (8, 8)).save(tmp_path / "base-0.png")
    T.record_base_images(tmp_path, made([one]), [one])
    assert not T.base_images_missing(plain, tmp_path, made([one.copy()]))
    for changed in ([other], None, [one, other], [other, one]):  # another reference, none, one more, another order
        assert T.base_images_missing(plain, tmp_path, made(changed))


def _condition_keys(dataset):
    return {k for k in dataset.cached_latent_keys() if k[0] == "cond"}


def _records(references):
    """In-memory targets of SIZES, each with `references` conditions: its inversion, then its channels rotated."""
    records = []
    for i, (w, h) in enumerate(SIZES):
        image = _picture(w, h, i)
        conds = (ImageOps.invert(image), swap_channels(image))[:references]
        records.append(T.ImageRecord(name=f"p{i}", size=(w, h), image=image, conditions=tuple(
            T.ImageRecord(name=f"p{i}.cond{j}", size=c.size, image=c) for j, c in enumerate(conds))))
    return records


@pytest.mark.parametrize("cached", [False, True], ids=["pixels", "cache"])
def test_each_condition_travels_with_its_target_over_reshuffled_epochs(cached):
    """Random crops and flips, three buckets, repeats, two references per row, four epochs: row i of every batch is
    sample i's target and its conditions, in reference order. A condition here is its target inverted (and then
    with channels rotated), so its pixels must be minus the target's (and the target's channels rotated), crop
    and flip included, whether the pixels come through the DataLoader or through the sample-indexed cache."""
    dataset = T.DreamBoothDataset(_records(2), "relight", [(64, 64), (48, 80), (80, 48)], repeats=2, seed=3,
                                  random_flip=True, with_pixels=not cached, fixed_crops=cached)
    sampler = T.BucketBatchSampler(dataset.sample_buckets(), 2, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=T.collate)
    caches = T.Caches(T.SampleCache())
    for text in {t for s in range(len(dataset)) for t in dataset.prompt_keys(s)}:
        caches.prompts.put(text, torch.zeros(1, 2, 2))
    if cached:  # the "latents" of this cache are the crops' pixels: what the VAE would have been given
        caches = T.Caches(caches.prompts, T.SampleCache())
        for key in dataset.cached_latent_keys():
            caches.latents.put(key, dataset.pixels(key)[None])
        assert len(_condition_keys(dataset)) == 6 * 2 * 2  # images x references x orientations, shared by the repeats
    seen, flips = set(), set()
    for step, batch in zip(range(4 * len(sampler)), loader):
        inputs = T.gather_inputs(batch, dataset, caches, 0.0, random.Random(step))
        assert inputs.references == 2
        rows = inputs.images[inputs.image_rows]
        b = len(batch["indices"])
        target, inverted, rotated = rows[:b], rows[b:2 * b], rows[2 * b:]
        assert target.shape == inverted.shape == rotated.shape
        torch.testing.assert_close(inverted, -target, atol=2 / 127.5, rtol=0)
        torch.testing.assert_close(rotated, target[:, [2, 0, 1]], atol=2 / 127.5, rtol=0)
        seen |= {(batch["epoch"], i) for i in batch["indices"]}
        flips |= {dataset.latent_key(i, batch["epoch"])[-1] for i in batch["indices"]}
    assert {e for e, _ in seen} == {0, 1, 2, 3} and flips == {False, True}


def test_references_are_batched_by_count_and_the_step_gets_them_reference_by_reference():
    records = _records(2)
    records[1] = T.ImageRecord(name="one", size=(64, 64), image=_picture(64, 64, 9),
                               conditions=records[1].conditions[:1])
    dataset = T.DreamBoothDataset(records, "relight", [(64, 64)], seed=0, with_pixels=False, fixed_crops=True)
    assert dataset.sample_buckets() == [(0, 2), (0, 1), (0, 2), (0, 2), (0, 2), (0, 2)]
    sampler = T.BucketBatchSampler(dataset.sample_buckets(), 2, seed=0)
    assert all(len({dataset.sample_buckets()[i] for i in b}) == 1 for e in range(5) for b in sampler.epoch_batches(e))
    assert len(sampler) == 2  # the one row with a single reference has no partner: never in a batch of two
    caches = T.Caches(T.SampleCache(), T.SampleCache())
    caches.prompts.put("relight", torch.zeros(1, 2, 2))
    for key in dataset.cached_latent_keys():  # a latent that names its source image
        caches.latents.put(key, torch.full((1, 4, 2, 2), float(hash(dataset.record(key[0], key[1]).name) % 1000)))
    batch = {"indices": [3, 0], "epoch": 0}
    inputs = T.gather_inputs(batch, dataset, caches, 0.0, random.Random(0))
    assert inputs.references == 2
    rows = inputs.images[inputs.image_rows]  # the targets, then reference 0 of every row, then reference 1
    names = lambda t: [int(v) for v in t[:, 0, 0, 0].tolist()]  # noqa: E731
    code = lambda name: hash(name) % 1000  # noqa: E731
    assert names(rows[:2]) == [code("p3"), code("p0")]
    assert [names(rows[2:4]), names(rows[4:])] == [[code("p3.cond0"), code("p0.cond0")],
                                                   [code("p3.cond1"), code("p0.cond1")]]


# ---------------------------------------------------------------------------------------------------------------
# The step: what the transformer is given


def _capture(transformer):
    calls = []
    transformer.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    return calls


@pytest.mark.parametrize("family", ["dev", "klein"])
def test_the_edit_step_feeds_the_transformer_what_the_pipeline_feeds_it(family, tiny_model, tiny_klein):
    """Two condition images and a 64x64 target at sigma 1 (training gives the references the target's size), the
    pipeline given the same noise: hidden states (target tokens, then each reference's tokens in order), image ids
    (int64, reference r at time 10 + 10 r), text ids, timestep and guidance are equal, tensor for tensor."""
    import diffusers

    model, layers = (tiny_model, TEXT_ENCODER_OUT_LAYERS) if family == "dev" else (tiny_klein, KLEIN_TEXT_ENCODER_OUT_LAYERS)
    pipeline_class = diffusers.Flux2Pipeline if family == "dev" else diffusers.Flux2KleinPipeline
    pipe = pipeline_class.from_pretrained(model, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    conditions = [_picture(64, 64, 1), _picture(64, 64, 2)]
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    with torch.no_grad():
        cond_latents = [T.encode_images(pipe.vae, T.image_to_tensor(c, ((c.height, c.width), 0, 0, False),
                                                                       (c.height, c.width))[None], mean, std)
                        for c in conditions]
    embeds = torch.randn(1, MAX_SEQUENCE_LENGTH, 16 * len(layers), generator=torch.Generator().manual_seed(0))
    latents = torch.zeros(1, cond_latents[0].shape[1], 16, 16)  # a 64x64 target: at sigma 1 only its shape counts
    guidance = 3.5 if family == "dev" else None
    calls = _capture(pipe.transformer)
    with torch.no_grad():
        step_loss(pipe.transformer, latents, embeds, torch.tensor([1.0]), seed=7, guidance=guidance,
                  references=cond_latents)
        noise = torch.randn(latents.shape, generator=step_generator(7))  # the step's first draw
        pipe(image=conditions, prompt_embeds=embeds, height=64, width=64, num_inference_steps=1, latents=noise,
             guidance_scale=3.5 if family == "dev" else 1.0, output_type="latent")
    assert len(calls) == 2  # ours, then the pipeline's one step (no CFG pass)
    mine, theirs = calls
    assert theirs["img_ids"].dtype == mine["img_ids"].dtype == torch.int64
    assert torch.equal(mine["img_ids"], theirs["img_ids"])
    n = 16 * 16
    assert mine["img_ids"][0, n:, 0].unique().tolist() == [10, 20]  # two references, after the target's tokens
    channels = cond_latents[0].shape[1]
    assert mine["hidden_states"].shape == theirs["hidden_states"].shape == (1, 3 * n, channels)
    torch.testing.assert_close(mine["hidden_states"], theirs["hidden_states"], rtol=1e-5, atol=1e-5)
    for name in ("encoder_hidden_states", "txt_ids", "timestep"):
        torch.testing.assert_close(mine[name], theirs[name].to(mine[name].dtype))
    assert (mine["guidance"] is None) == (theirs["guidance"] is None)
    if guidance is not None:
        torch.testing.assert_close(mine["guidance"], theirs["guidance"])


def test_the_loss_covers_the_target_tokens_only(tiny_model):
    """Changing what the transformer predicts for the reference tokens leaves the loss unchanged; changing a target
    token's prediction changes it."""
    from diffusers import Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel.from_pretrained(tiny_model, subfolder="transformer")
    latents, cond = torch.randn(2, 4, 4, 4), [torch.randn(2, 4, 4, 4)]
    embeds = torch.randn(2, MAX_SEQUENCE_LENGTH, 32)

    def loss(edit=None):
        handle = transformer.register_forward_hook(lambda m, a, out: (edit(out[0]),) if edit else None)
        try:
            with torch.no_grad():
                return step_loss(transformer, latents, embeds, torch.linspace(1, 0.01, 50), seed=1, references=cond)
        finally:
            handle.remove()

    plain = loss()
    assert torch.equal(plain, loss(lambda p: torch.cat([p[:, :16], p[:, 16:] + 5.0], dim=1)))
    assert not torch.equal(plain, loss(lambda p: torch.cat([p[:, :1] + 5.0, p[:, 1:]], dim=1)))


# ---------------------------------------------------------------------------------------------------------------
# Refusals (exit 2, before any model is loaded)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unpaired", "cond_dir_with_dataset", "column_with_folder", "prior", "small_validation",
                                  "bad_column", "uncaptioned", "text_column", "uncaptioned_folder", "identity",
                                  "missing_reference", "validation_count", "folder_twice"])
def test_edit_refusals_exit_2_with_one_message(case, tiny_model, pairs, tmp_path):
    targets, conds = pairs
    out = tmp_path / "out"
    args = edit_args(tiny_model, targets, conds, out, "--max_train_steps", "1")
    expected = {
        "unpaired": "p2.png: no condition image p2.* in",
        "cond_dir_with_dataset": "--cond_data_dir pairs with --instance_data_dir",
        "column_with_folder": "--cond_image_column is a column of --dataset_name",
        "prior": "--with_prior_preservation does not combine with edit training",
        "small_validation": "take condition images of at least 64 px a side",
        "bad_column": "--cond_image_column 'nope' is not a column of",
        "uncaptioned": "--caption_column instruction: 1 row(s) have no caption",
        "text_column": "--cond_image_column 'file_name': row 0 holds str, not images",
        "uncaptioned_folder": "1 image(s) have no .txt caption (p0.png); give --instance_prompt for them",
        "identity": "the condition images are the targets",
        "missing_reference": "--cond_data_dir: 2 image(s) without a partner",
        "validation_count": "--validation_image: 1 image(s) for 2 --cond_data_dir folder(s)",
        "folder_twice": "--cond_data_dir names a folder twice",
    }[case]
    if case == "unpaired":
        (targets / "p2.png").rename(tmp_path / "p2.png")
        shutil.copy(tmp_path / "p2.png", targets / "p2.png")
        (conds / "p2.png").unlink()
        (conds / "extra.png").write_bytes((conds / "p3.png").read_bytes())
    elif case == "cond_dir_with_dataset":
        args[args.index("--instance_data_dir")] = "--dataset_name"
    elif case == "column_with_folder":
        args += ["--cond_image_column", "source"]
        args = args[:args.index("--cond_data_dir")] + args[args.index("--cond_data_dir") + 2:]
    elif case == "prior":
        args += ["--with_prior_preservation", "--class_prompt", "a scene", "--class_data_dir", tmp_path / "class"]
    elif case == "small_validation":
        args += ["--resolution", "32", "--validation_prompt", "relight", "--validation_image", conds / "p0.png"]
    elif case == "identity":
        args[args.index("--cond_data_dir") + 1] = str(targets) + "/"
    elif case == "folder_twice":
        args.insert(args.index("--cond_data_dir") + 2, str(conds) + "/")
    elif case in ("missing_reference", "validation_count"):  # a second reference folder: p2 and p4 lack theirs
        shutil.copytree(conds, tmp_path / "second")
        args.insert(args.index("--cond_data_dir") + 2, tmp_path / "second")
        if case == "missing_reference":
            (tmp_path / "second" / "p2.png").unlink()
            (tmp_path / "second" / "p4.png").unlink()
        else:
            args += ["--validation_prompt", "relight", "--validation_image", conds / "p0.png"]
    elif case == "uncaptioned_folder":  # every other target has its .txt caption
        del args[args.index("--instance_prompt"):args.index("--instance_prompt") + 2]
    elif case in ("bad_column", "uncaptioned", "text_column"):
        pytest.importorskip("datasets")
        folder = _hf_folder(tmp_path / "hf", references=1, blank_instruction=case == "uncaptioned",
                            names=case == "text_column")
        args = edit_args(tiny_model, folder, conds, out, "--max_train_steps", "1", "--image_column", "output",
                         "--caption_column", "instruction",
                         "--cond_image_column", "nope" if case == "bad_column" else "file_name")
        args[args.index("--instance_data_dir")] = "--dataset_name"
        args = args[:args.index("--cond_data_dir")] + args[args.index("--cond_data_dir") + 2:]
        del args[args.index("--instance_prompt"):args.index("--instance_prompt") + 2]
    proc = launch(args, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in proc.stderr, proc.stderr[-3000:]
    if case == "unpaired":  # both directions, in one message
        assert "extra.png: no target image extra.* in" in proc.stderr
    if case == "missing_reference":  # each target missing a reference, with the folder it is missing from
        assert all(f"p{i}.png: no condition image p{i}.* in {tmp_path / 'second'}" in proc.stderr for i in (2, 4))
    assert "loading the" not in proc.stderr and not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# Whole runs


def _edit_output(pipeline_class, model, lora_dir, condition, layers):
    pipe = pipeline_class.from_pretrained(model, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    if lora_dir is not None:
        pipe.load_lora_weights(str(lora_dir))
    embeds = torch.randn(1, MAX_SEQUENCE_LENGTH, 16 * len(layers), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return pipe(image=condition if isinstance(condition, list) else [condition], prompt_embeds=embeds, height=64,
                    width=64, num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images


def _same_lora(a, b):
    a, b = load_file(str(Path(a) / LORA)), load_file(str(Path(b) / LORA))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_dev_edit_run_caches_resumes_validates_and_its_lora_edits(tiny_model, pairs, tmp_path):
    """[dev], cached latents on the disk cache, two buckets, flips, accumulation: a run with a checkpoint, its resume
    (bit-equal LoRA), edit-mode validation (the base model's image is Flux2Pipeline's edit of the bucketed condition;
    the condition first in the progress sheet), a model card for image-to-image, and a LoRA that changes
    Flux2Pipeline's edit output."""
    import diffusers
    from transformers import AutoTokenizer

    targets, conds = pairs
    common = ["--cache_latents", "--random_flip", "--max_train_steps", "4", "--checkpointing_steps", "2",
              "--gradient_accumulation_steps", "2", "--validation_prompt", "relight scene 1", "--validation_image",
              conds / "p0.png", "--validation_steps", "2", "--num_validation_images", "1",
              "--aspect_ratio_buckets", "64,64;64,96",
              "--precompute_cache_dir", tmp_path / "cache"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = launch(edit_args(tiny_model, targets, conds, straight, *common))
    assert "encoded 24 of 24 missing images" in proc.stderr  # 6 targets + 6 conditions, both orientations
    assert "edit training: 6 condition images for 6 targets, 1 per target" in proc.stderr
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    proc = launch(edit_args(tiny_model, targets, conds, resumed, *common, "--resume_from_checkpoint", "latest"))
    assert "reused 30 entries" in proc.stderr  # 24 latents and 6 prompts, nothing encoded again
    assert _same_lora(straight, resumed)
    validation = straight / "validation"
    assert {"condition.png", "base-0.png", "step-000002-0.png", "final-0.png", "progress-0.png"} <= {
        p.name for p in validation.iterdir()}
    condition = Image.open(validation / "condition.png")
    assert condition.size == (96, 64)  # fitted into its bucket, as training conditions are
    # the base model's validation image is diffusers' own edit of the condition, pixel for pixel
    pipe = diffusers.Flux2Pipeline.from_pretrained(tiny_model, tokenizer=None)
    pipe.tokenizer = AutoTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt("relight scene 1", device="cpu", max_sequence_length=MAX_SEQUENCE_LENGTH,
                                       text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS)
        edited = pipe(image=[condition], prompt_embeds=embeds, height=64, width=96, num_inference_steps=2,
                      generator=torch.Generator().manual_seed(
                          T.seed_for(T.seed_for("validation", 0), 0))).images[0]  # image 0's own noise
    assert np.abs(np.asarray(edited, int) - np.asarray(Image.open(validation / "base-0.png"), int)).max() <= 1
    sheet = Image.open(validation / "progress-0.png")
    assert sheet.width >= 4 * 96  # condition, base, step 2, step 4 (final)
    first_column = np.asarray(sheet.convert("RGB"))[22:22 + 64, 4:4 + 96]  # under the caption
    assert np.abs(first_column.astype(int) - np.asarray(condition).astype(int)).mean() < 1  # the condition, first
    card = (straight / "README.md").read_text()
    assert "- image-to-image" in card and "pipe(image=condition" in card
    before = _edit_output(diffusers.Flux2Pipeline, tiny_model, None, condition, TEXT_ENCODER_OUT_LAYERS)
    after = _edit_output(diffusers.Flux2Pipeline, tiny_model, straight, condition, TEXT_ENCODER_OUT_LAYERS)
    assert not torch.equal(before, after)


@pytest.mark.slow
def test_two_reference_folders_train_and_validate_in_their_order(tiny_model, pairs, tmp_path):
    """--cond_data_dir with two folders (each target's inversion, then its channels rotated) and two
    --validation_image files: every target trains with both references, cached and recorded in the folders' order;
    validation saves them in that order, each fitted into the first's bucket; the model card loads a list; the LoRA
    changes Flux2Pipeline's edit of the two."""
    import diffusers

    targets, conds = pairs
    rotated = tmp_path / "rotated"
    rotated.mkdir()
    for i, (w, h) in enumerate(SIZES):  # the targets' pictures, as the fixture made them
        swap_channels(_picture(w, h, i)).save(rotated / f"p{i}.png")
    out = tmp_path / "out"
    args = edit_args(tiny_model, targets, conds, out, "--max_train_steps", "2", "--cache_latents",
                     "--validation_prompt", "relight scene 1", "--num_validation_images", "1",
                     "--validation_image", conds / "p0.png", rotated / "p0.png",
                     "--aspect_ratio_buckets", "64,64;64,96")
    args.insert(args.index(str(conds)) + 1, str(rotated))
    proc = launch(args)
    assert "edit training: 12 condition images for 6 targets, 2 per target" in proc.stderr
    assert "encoded 18 of 18 missing images" in proc.stderr  # 6 targets, 6 + 6 references
    manifest = json.loads((out / T.MANIFEST_NAME).read_text())
    assert [[c["sha256"] for c in r["conditions"]] for r in manifest["instances"]] == [
        [T.file_digest(folder / f"{Path(r['name']).stem}.png") for folder in (conds, rotated)]
        for r in manifest["instances"]]
    validation = out / "validation"
    saved = [Image.open(validation / name) for name in ("condition.png", "condition-1.png")]
    for image, source in zip(saved, (conds, rotated)):  # fitted into the first's bucket, as training fits them
        fitted, _ = T.fit_to_bucket(Image.open(source / "p0.png"), [(64, 96)])
        assert np.array_equal(np.asarray(image), np.asarray(fitted))
    assert Image.open(validation / "progress-0.png").width >= 4 * 96  # two conditions, base, final
    card = (out / "README.md").read_text()
    assert 'condition = [load_image("photo.png"), load_image("ref-2.png")]' in card and "pipe(image=condition" in card
    before = _edit_output(diffusers.Flux2Pipeline, tiny_model, None, saved, TEXT_ENCODER_OUT_LAYERS)
    after = _edit_output(diffusers.Flux2Pipeline, tiny_model, out, saved, TEXT_ENCODER_OUT_LAYERS)
    assert not torch.equal(before, after)


def test_validation_gives_the_pipeline_its_images_in_order(tmp_path):
    """--validation_image a b: a fitted into its bucket (the edit's size), b into the same one, as training fits a
    target's references, and the pipeline called with image=[a, b] at that size."""
    a, b = _picture(96, 64, 1), _picture(64, 96, 2)  # another aspect: b is cropped to a's bucket
    a.save(tmp_path / "a.png")
    b.save(tmp_path / "b.png")
    args = SimpleNamespace(validation_image=[tmp_path / "a.png", tmp_path / "b.png"], resolution=64, resolutions=[64],
                           guidance_scale=1.0, validation_guidance_scale=4.0)
    dataset = SimpleNamespace(ladders=[[(64, 64), (64, 96)]], conditions=[])
    conditions, bucket = T.EditTraining(args).condition(dataset, True)
    assert bucket == (64, 96)
    for condition, image in zip(conditions, (a, b), strict=True):
        assert np.array_equal(np.asarray(condition), np.asarray(T.fit_to_bucket(image, [bucket])[0]))
    run = SimpleNamespace(data=SimpleNamespace(condition=(conditions, bucket), seed=0), weight_dtype=torch.float32,
                          caches=SimpleNamespace(prompts={"p": torch.zeros(1, 2, 2)}))
    call = T.pipeline_call(args, run, T.ValidationSpec("p"), "cpu", T.FAMILIES["Flux2Pipeline"], 2)
    assert [id(image) for image in call["image"]] == [id(c) for c in conditions] and (call["height"], call[
        "width"]) == (64, 96)


@pytest.mark.slow
def test_klein_edit_run_validates_and_its_lora_edits(tiny_klein, pairs, tmp_path):
    """[klein] base (CFG validation: the negative pass keeps the condition) and distilled: the run trains, validates
    in edit mode, and its LoRA changes Flux2KleinPipeline's edit output."""
    import diffusers

    targets, conds = pairs
    out = tmp_path / "out"
    launch(edit_args(tiny_klein, targets, conds, out, "--max_train_steps", "2", "--validation_prompt", "relight",
                     "--validation_image", conds / "p0.png", "--num_validation_images", "1",
                     layers=KLEIN_TEXT_ENCODER_OUT_LAYERS))
    assert (out / "validation" / "condition.png").is_file() and (out / "validation" / "final-0.png").is_file()
    condition = Image.open(out / "validation" / "condition.png")
    before = _edit_output(diffusers.Flux2KleinPipeline, tiny_klein, None, condition, KLEIN_TEXT_ENCODER_OUT_LAYERS)
    after = _edit_output(diffusers.Flux2KleinPipeline, tiny_klein, out, condition, KLEIN_TEXT_ENCODER_OUT_LAYERS)
    assert not torch.equal(before, after)


@pytest.mark.slow
def test_memory_options_and_cache_leave_an_edit_run_unchanged(tiny_model, pairs, tmp_path):
    """Uncached (the VAE encodes target and conditions with the batch), with --gradient_checkpointing and --offload:
    the same LoRA as the plain uncached run; with --center_crop, cached latents give the same LoRA as uncached. (The
    plain run validates without --validation_image, which it warns about.)"""
    targets, conds = pairs
    common = ["--max_train_steps", "3", "--train_batch_size", "2", "--center_crop", "--precompute_cache_dir", "none"]
    plain, lean, cached = tmp_path / "plain", tmp_path / "lean", tmp_path / "cached"
    proc = launch(edit_args(tiny_model, targets, conds, plain, *common, "--validation_prompt", "relight",
                            "--num_validation_images", "1"))
    assert "edit training validates without a condition image" in proc.stderr  # no --validation_image: said so
    launch(edit_args(tiny_model, targets, conds, lean, *common, "--gradient_checkpointing", "--offload"))
    launch(edit_args(tiny_model, targets, conds, cached, *common, "--cache_latents"))
    a, b, c = (load_file(str(p / LORA)) for p in (plain, lean, cached))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a[k], c[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_two_processes_train_an_edit_lora_and_agree(tiny_model, pairs, tmp_path):
    """Each process encodes half of the 12 latents (targets and conditions) into the disk cache; both end with the
    same LoRA."""
    targets, conds = pairs
    out = tmp_path / "out"
    proc = launch(edit_args(tiny_model, targets, conds, out, "--max_train_steps", "2", "--cache_latents",
                            "--precompute_cache_dir", tmp_path / "cache"), num_processes=2)
    for rank in (0, 1):
        assert f"[RANK {rank}] encoded 6 of 12 missing images" in proc.stderr
    fingerprints = re.findall(r"\[RANK \d\] LoRA fingerprint (\w+)", proc.stderr)
    assert len(fingerprints) == 2 and len(set(fingerprints)) == 1


@pytest.mark.slow
def test_from_manifest_trains_an_edit_lora_with_both_folders_deleted(tiny_model, pairs, tmp_path):
    """The manifest records each target's conditions; with the images gone, the same LoRA."""
    targets, conds = pairs
    cache = tmp_path / "cache"
    first, again = tmp_path / "first", tmp_path / "again"
    launch(edit_args(tiny_model, targets, conds, first, "--max_train_steps", "3", "--cache_latents", "--random_flip",
                     "--precompute_cache_dir", cache))
    manifest = json.loads((first / T.MANIFEST_NAME).read_text())
    assert [len(r["conditions"]) for r in manifest["instances"]] == [1] * 6
    assert sum(e["kind"] == "cond" for e in manifest["entries"]["latents"]) == 12
    shutil.rmtree(targets)
    shutil.rmtree(conds)
    args = ["--pretrained_model_name_or_path", tiny_model, "--from_manifest", first / T.MANIFEST_NAME,
            "--output_dir", again, "--cache_latents", "--precompute_cache_dir", cache, "--max_train_steps", "3",
            "--train_batch_size", "1", "--learning_rate", "1e-3", "--report_to", "none"]
    launch(args)
    assert _same_lora(first, again)


def _hf_folder(folder, references, blank_instruction=False, names=False):
    """A local `datasets` folder (parquet) with columns output (target), file_name (condition: one image, or a list
    of `references`; with `names`, file names as strings) and instruction (row 2's blank with blank_instruction)."""
    import datasets

    folder.mkdir(parents=True)
    targets = [_picture(64, 64, i) for i in range(4)]
    conds = [[ImageOps.invert(t), swap_channels(t)][:references] for t in targets]
    column = conds if references > 1 else [c[0] for c in conds]
    kind = datasets.Sequence(datasets.Image()) if references > 1 else datasets.Image()
    if names:
        column, kind = [f"cond-{i}.png" for i in range(4)], datasets.Value("string")
    features = datasets.Features({"output": datasets.Image(), "instruction": datasets.Value("string"),
                                  "file_name": kind})
    datasets.Dataset.from_dict({"output": targets, "file_name": column,
                                "instruction": [" " if blank_instruction and i == 2 else f"edit {i}" for i in range(4)]},
                               features=features
                               ).to_parquet(str(folder / "train.parquet"))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("references", [1, 2])
def test_dataset_columns_give_one_or_several_references(references, tiny_model, tmp_path):
    """--dataset_name with --cond_image_column (the relighting layout): an image per row, or a list of images per
    row (several references, in list order)."""
    pytest.importorskip("datasets")
    folder = _hf_folder(tmp_path / "hf", references)
    out = tmp_path / "out"
    args = base_args(tiny_model, folder, out, "--resolution", "64", "--max_train_steps", "2", "--cache_latents",
                     "--image_column", "output", "--cond_image_column", "file_name", "--caption_column", "instruction")
    args[args.index("--instance_data_dir")] = "--dataset_name"
    del args[args.index("--instance_prompt"):args.index("--instance_prompt") + 2]  # every row has its instruction
    proc = launch(args)
    assert f"encoded {4 * (1 + references)} of {4 * (1 + references)} missing images" in proc.stderr
    assert "(4 unique)" in proc.stderr  # the four instructions
    manifest = json.loads((out / T.MANIFEST_NAME).read_text())
    assert [[c["name"] for c in r["conditions"]] for r in manifest["instances"]][1] == [
        f"{folder}[1].file_name[{j}]" for j in range(references)]


def test_swapped_blocks_train_and_validate_an_edit_lora_like_resident_ones(tiny_model, pairs, tmp_path, monkeypatch):
    """--blocks_to_swap (its CUDA requirement lifted for the CPU) with the longer edit sequence: the same LoRA and
    edit-mode validation image as without swapping, bit for bit."""
    targets, conds = pairs
    monkeypatch.setattr(T.BlockSwapping, "check", lambda self: None)
    common = ["--max_train_steps", "2", "--gradient_checkpointing", "--cache_latents", "--precompute_cache_dir", "none",
              "--validation_prompt", "relight", "--validation_image", conds / "p0.png", "--num_validation_images", "1"]
    plain, swapped = tmp_path / "plain", tmp_path / "swapped"
    T.main(edit_args(tiny_model, targets, conds, plain, *common))
    T.main(edit_args(tiny_model, targets, conds, swapped, *common, "--blocks_to_swap", "2"))
    assert _same_lora(plain, swapped)
    expected = np.asarray(Image.open(plain / "validation" / "final-0.png"))
    assert (np.asarray(Image.open(swapped / "validation" / "final-0.png")) == expected).all()
