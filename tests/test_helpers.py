"""CPU unit tests of the pure helpers: buckets, transforms, dataset, sampler, collate, caches, loss, state."""

import itertools
import json
import random
import shutil

import pytest
import torch
from PIL import Image

import train_dreambooth_lora_flux2 as T
from train_dreambooth_lora_flux2 import (BucketBatchSampler, DreamBoothDataset, ImageRecord, SampleCache, UsageError,
                                         collate)
from tests.conftest import step_loss


# ---------------------------------------------------------------------------------------------------- buckets


def test_parse_buckets_accepts_multiples_of_16_and_dedups():
    assert T.parse_buckets(" 32,48; 48,32 ;32,48;") == [(32, 48), (48, 32)]


@pytest.mark.parametrize("text", ["32,40", "0,32", "32x32", "", "32"])
def test_parse_buckets_refuses_bad_input(text):
    with pytest.raises(UsageError, match="aspect_ratio_buckets"):
        T.parse_buckets(text)


def test_bucket_ladder_sides_are_multiples_of_16_near_the_pixel_budget():
    ladder = T.bucket_ladder(1024)
    assert (1024, 1024) in ladder and len(ladder) == len(set(ladder)) > 5
    for h, w in ladder:
        assert h % 16 == 0 and w % 16 == 0
        assert 0.85 < h * w / 1024**2 < 1.15
    assert any(h > w for h, w in ladder) and any(w > h for h, w in ladder)


def test_nearest_bucket_matches_aspect_ratio():
    buckets = [(32, 32), (32, 48), (48, 32)]  # (h, w)
    assert T.nearest_bucket(40, 64, buckets) == 1  # landscape
    assert T.nearest_bucket(64, 40, buckets) == 2  # portrait
    assert T.nearest_bucket(50, 50, buckets) == 0


# ---------------------------------------------------------------------------------------------------- transforms


def test_draw_crop_covers_bucket_and_center_crops():
    (rh, rw), top, left = T.draw_crop((64, 40), (32, 32), center_crop=True, rng=random.Random(0))
    assert (rh, rw) == (32, 51)  # aspect kept: 64x40 scaled by 0.8 -> 51x32, covering the 32x32 bucket
    assert (top, left) == (0, 9)


def test_draw_crop_random_crops_vary_but_are_seeded():
    lefts = {T.draw_crop((100, 40), (32, 32), False, random.Random(s))[2] for s in range(50)}
    assert len(lefts) > 5 and all(0 <= x <= 80 - 32 for x in lefts)
    assert T.draw_crop((100, 40), (32, 32), False, random.Random(7)) == T.draw_crop((100, 40), (32, 32), False, random.Random(7))


def test_image_to_tensor_crops_flips_and_scales():
    image = Image.new("RGB", (4, 2))
    image.putpixel((0, 0), (255, 0, 0))
    x = T.image_to_tensor(image, ((2, 4), 0, 0, False), (2, 4))
    assert x.shape == (3, 2, 4) and x.min() >= -1 and x.max() <= 1
    assert x[:, 0, 0].tolist() == [1.0, -1.0, -1.0]
    flipped = T.image_to_tensor(image, ((2, 4), 0, 0, True), (2, 4))
    assert torch.equal(flipped, x.flip(-1))
    cropped = T.image_to_tensor(image, ((2, 4), 0, 1, False), (2, 2))
    assert torch.equal(cropped, x[:, :, 1:3])


# ---------------------------------------------------------------------------------------------------- folder scan


def test_scan_image_folder_sorted_captions_and_ignored_files(tmp_path):
    for name in ["b.png", "a.jpg", ".hidden.png", "c.png"]:
        Image.new("RGB", (20, 10)).save(tmp_path / name)
    (tmp_path / "a.txt").write_bytes("\ufeffa dog on a sofa \r\n".encode())  # BOM, CRLF, trailing space
    (tmp_path / "c.txt").write_text("  \n")  # empty caption falls back to the instance prompt
    (tmp_path / "readme.md").write_text("not an image")
    records = T.scan_image_folder(tmp_path)
    assert [r.name for r in records] == ["a.jpg", "b.png", "c.png"]
    assert [r.caption for r in records] == ["a dog on a sofa", None, None]
    assert records[0].size == (20, 10)


def test_a_camera_folders_upper_case_captions_and_a_jfif_image_are_read(tmp_path):
    """IMG_0001.PNG with IMG_0001.TXT (cameras, Windows exports), a browser's .jfif (a JPEG); x.txt before x.TXT."""
    for name in ["IMG_0001.PNG", "IMG_0002.JPG", "photo.jfif"]:
        Image.new("RGB", (20, 10)).save(tmp_path / name, format="PNG" if name.endswith("PNG") else "JPEG")
    (tmp_path / "IMG_0001.TXT").write_text("a dog on a red sofa")
    (tmp_path / "IMG_0002.Txt").write_text("a dog at night")
    (tmp_path / "photo.TXT").write_text("upper")
    (tmp_path / "photo.txt").write_text("lower")
    records = T.scan_image_folder(tmp_path)
    assert [(r.name, r.caption) for r in records] == [
        ("IMG_0001.PNG", "a dog on a red sofa"), ("IMG_0002.JPG", "a dog at night"), ("photo.jfif", "lower")]


def test_scan_image_folder_lists_every_unreadable_file(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "junk.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(UsageError) as error:
        T.scan_image_folder(tmp_path)
    assert "empty.png" in str(error.value) and "junk.jpg" in str(error.value)


def test_oriented_size_applies_exif_rotation(tmp_path):
    image = Image.new("RGB", (40, 20))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    image.save(tmp_path / "r.jpg", exif=exif)
    with Image.open(tmp_path / "r.jpg") as im:
        assert T.oriented_size(im) == (20, 40)
    record = ImageRecord(name="r.jpg", size=(20, 40), path=str(tmp_path / "r.jpg"))
    assert record.load().size == (20, 40)


# ---------------------------------------------------------------------------------------------------- dataset


def _records(sizes, captions=None):
    captions = captions or [None] * len(sizes)
    return [ImageRecord(name=f"i{k}", size=s, caption=c, image=Image.new("RGB", s, (k * 40, 0, 0)))
            for k, (s, c) in enumerate(zip(sizes, captions))]


BUCKETS = [(32, 32), (32, 48), (48, 32)]


def test_dataset_items_carry_their_index_and_repeats_multiply_samples():
    ds = DreamBoothDataset(_records([(48, 32), (32, 48)]), "sks", BUCKETS, repeats=3, with_pixels=False)
    assert len(ds) == 6 and [ds[(0, i)]["index"] for i in range(6)] == list(range(6))
    assert ds.sample_buckets() == [(1, 0), (2, 0)] * 3


def test_every_class_image_is_paired_within_one_epoch():
    instances, classes = _records([(32, 32)] * 2), _records([(32, 32)] * 7)
    ds = DreamBoothDataset(instances, "sks", BUCKETS, repeats=1, classes=classes, with_pixels=False)
    assert len(ds) == 7  # at least one sample per class image
    class_ids = {ds.latent_key(s, 0)[1] for s in ds.class_slots(range(len(ds)))}
    assert class_ids == set(range(7))


def test_slots_and_prompt_keys_lay_out_instance_then_class():
    ds = DreamBoothDataset(_records([(32, 32)] * 2, ["cap a", None]), "sks", BUCKETS, repeats=2,
                           classes=_records([(32, 32)], ["a dog"]), with_pixels=False)
    assert ds.class_slots([3, 0]) == [7, 4]
    slots = [*range(len(ds)), *ds.class_slots(range(len(ds)))]
    assert [ds.prompt_key(s, 0) for s in slots] == ["cap a", "sks", "cap a", "sks"] + ["a dog"] * 4


def test_class_image_follows_its_instance_bucket():
    ds = DreamBoothDataset(_records([(48, 32)]), "sks", BUCKETS, classes=_records([(32, 32)], ["c"]))
    item = ds[(0, 0)]["pixel_values"]
    assert item.shape == (2, 3, 32, 48)


def test_fresh_augmentation_each_epoch_without_cache_and_reproducible():
    ds = DreamBoothDataset(_records([(90, 40)]), "sks", [(32, 32)], repeats=1, random_flip=True, seed=3)
    keys = [ds.latent_key(0, e) for e in range(12)]
    assert len({k[5] for k in keys}) > 3 and {k[6] for k in keys} == {True, False}  # crops (left) and flips per epoch
    assert keys == [ds.latent_key(0, e) for e in range(12)]  # ...but a pure function of (seed, epoch, slot)
    item = ds[(5, 0)]  # the epoch travels with the index
    assert item["epoch"] == 5 and torch.equal(item["pixel_values"][0], ds.pixels(keys[5]))


def test_cached_crops_are_fixed_but_flips_stay_live():
    ds = DreamBoothDataset(_records([(90, 40)] * 2), "sks", [(32, 32)], repeats=2, random_flip=True, seed=3,
                           fixed_crops=True, with_pixels=False)
    per_epoch = [[ds.latent_key(s, e) for s in range(4)] for e in range(12)]
    assert all(k[:6] == per_epoch[0][s][:6] for keys in per_epoch for s, k in enumerate(keys))  # crop fixed
    assert len({per_epoch[0][s][5] for s in range(4)}) > 1  # ...though drawn at random per slot
    assert all(len({keys[s][6] for keys in per_epoch}) == 2 for s in range(4))  # each slot flips both ways
    cached = ds.cached_latent_keys()
    assert {k for keys in per_epoch for k in keys} <= set(cached) and len(cached) == 8  # both orientations cached


def test_collate_keeps_order_and_groups_class_after_instance():
    examples = [{"index": i, "epoch": 3, "pixel_values": torch.full((2, 3, 2, 2), float(i))} for i in (4, 1, 9)]
    batch = collate(examples)
    assert batch["indices"] == [4, 1, 9] and batch["epoch"] == 3
    assert batch["pixel_values"][:, 0, 0, 0].tolist() == [4, 1, 9, 4, 1, 9]
    assert collate([{"index": 2, "epoch": 0}]) == {"indices": [2], "epoch": 0}


# ---------------------------------------------------------------------------------------------------- sampler


BUCKET_OF = [0] * 7 + [1] * 5 + [2] * 3  # 15 samples in three buckets


def _epoch(sampler, e):
    """The batches the sampler streams for epoch e, as plain index lists."""
    sampler.set_epoch(e)
    batches = list(itertools.islice(sampler, len(sampler)))
    assert all(epoch == e for b in batches for epoch, _ in b)
    return [[i for _, i in b] for b in batches]


def test_sampler_batches_hold_one_bucket_and_cover_everything_without_drop_last():
    sampler = BucketBatchSampler(BUCKET_OF, batch_size=2, seed=0, drop_last=False)
    batches = _epoch(sampler, 0)
    assert sorted(i for b in batches for i in b) == list(range(15))
    assert all(len({BUCKET_OF[i] for i in b}) == 1 for b in batches)
    assert len(batches) == len(sampler) == 4 + 3 + 2


def test_sampler_drop_last_and_exact_len_over_epochs():
    sampler = BucketBatchSampler(BUCKET_OF, batch_size=2, seed=0, drop_last=True)
    for e in range(5):
        batches = _epoch(sampler, e)
        assert len(batches) == len(sampler) == 3 + 2 + 1 and all(len(b) == 2 for b in batches)


def test_sampler_reshuffles_every_epoch_deterministically():
    a = BucketBatchSampler(BUCKET_OF, 2, seed=1)
    b = BucketBatchSampler(BUCKET_OF, 2, seed=1)
    epochs = [_epoch(a, e) for e in range(4)]
    assert all(epochs[i] != epochs[i + 1] for i in range(3))
    assert [_epoch(b, e) for e in (3, 0, 2, 1)] == [epochs[3], epochs[0], epochs[2], epochs[1]]  # pure in (seed, e)
    assert _epoch(BucketBatchSampler(BUCKET_OF, 2, seed=2), 0) != epochs[0]


def test_sampler_start_skips_batches_for_resume():
    sampler = BucketBatchSampler(BUCKET_OF, 2, seed=0)
    full = _epoch(sampler, 3)
    sampler.set_epoch(3, start=4)
    stream = list(itertools.islice(sampler, len(full) - 4 + 2))
    assert stream[:-2] == [[(3, i) for i in b] for b in full[4:]]  # the rest of epoch 3...
    assert stream[-2:] == [[(4, i) for i in b] for b in _epoch(sampler, 4)[:2]]  # ...then epoch 4 follows


def test_sampler_ranks_get_disjoint_batches_covering_the_epoch():
    single = BucketBatchSampler(BUCKET_OF, 2, seed=5, drop_last=False)
    ranks = [BucketBatchSampler(BUCKET_OF, 2, seed=5, drop_last=False, num_replicas=3, rank=r) for r in range(3)]
    per_rank = [_epoch(s, 1) for s in ranks]
    assert all(len(p) == len(ranks[0]) == 3 for p in per_rank)
    flat = [tuple(b) for p in per_rank for b in p]
    assert len(flat) == len(set(flat)) and set(flat) == {tuple(b) for b in _epoch(single, 1)}


def test_sampler_drops_a_different_remainder_every_epoch():
    """drop_last drops each bucket's remainder; shuffling inside buckets makes it a different one every epoch, so
    over a few epochs every sample is trained (without it, the same samples would never be seen)."""
    sampler = BucketBatchSampler(BUCKET_OF, 2, seed=0, drop_last=True)
    seen = [{i for b in _epoch(sampler, e) for i in b} for e in range(8)]
    assert all(len(s) == 12 for s in seen)  # 3 of 15 dropped per epoch: one per bucket of odd size
    assert set().union(*seen) == set(range(15))
    assert len({frozenset(set(range(15)) - s) for s in seen}) > 1


def test_sampler_gives_every_rank_the_same_number_of_batches():
    """9 batches over 2 ranks: the 9th is dropped, so both ranks step 4 times (unequal counts hang DDP)."""
    ranks = [BucketBatchSampler(BUCKET_OF, 2, seed=5, drop_last=False, num_replicas=2, rank=r) for r in range(2)]
    for e in range(4):
        per_rank = [s.epoch_batches(e) for s in ranks]  # what each rank's stream holds for epoch e
        assert [len(p) for p in per_rank] == [len(s) for s in ranks] == [4, 4]
        flat = [tuple(b) for p in per_rank for b in p]
        assert len(flat) == len(set(flat)) == 8


# ---------------------------------------------------------------------------------------------------- cache


def test_cache_shares_one_tensor_per_key_and_gathers_in_order():
    cache = SampleCache()
    keys = ["a", "b", "a", "c", "a"]
    assert cache.todo(keys + ["z", "a"]) == ["a", "b", "c", "z"]
    for k, v in zip("abc", (1.0, 2.0, 3.0)):
        cache.put(k, torch.full((1, 2), v))
    assert cache.todo(keys) == []
    unique, rows = cache.gather_unique([keys[i] for i in (4, 1, 3, 0)])
    assert unique[rows][:, 0].tolist() == [1.0, 2.0, 3.0, 1.0]
    assert len(cache.store) == 3  # five samples, three tensors
    unique, rows = cache.gather_unique(keys)  # what a step moves: each entry once, and the rows that expand it
    assert unique[:, 0].tolist() == [1.0, 2.0, 3.0] and rows.tolist() == [0, 1, 0, 2, 0]
    with pytest.raises(KeyError, match="precompute"):
        SampleCache().gather_unique(["x"])


def test_dataset_keys_share_repeats_and_captions():
    ds = DreamBoothDataset(_records([(32, 32)] * 3, ["same", "same", None]), "sks", BUCKETS, repeats=4,
                           center_crop=True, with_pixels=False, fixed_crops=True)
    assert len(set(ds.cached_latent_keys())) == 3  # 12 samples, one encode per image
    assert len({ds.prompt_key(s, 0) for s in range(len(ds))}) == 2  # 12 samples, two distinct texts


def test_disk_store_round_trip_atomic_and_damage_is_recomputed_or_stops_the_run(tmp_path, caplog, monkeypatch):
    from accelerate import PartialState

    PartialState()  # the store warns through accelerate's logger
    digest = lambda key: T.json_digest(key)  # noqa: E731
    store = T.DiskStore(tmp_path, digest, T.DiskCache(tmp_path))
    value = torch.randn(1, 3, 4)
    assert "k" not in store
    store["k"] = value
    assert "k" in store and torch.equal(store["k"], value)
    assert not list(tmp_path.rglob("*.tmp"))  # written via a temporary file, renamed into place

    hashed = []
    real_digest = T.tensor_digest
    monkeypatch.setattr(T, "tensor_digest", lambda t: hashed.append(1) or real_digest(t))
    fresh = T.DiskStore(tmp_path, digest, T.DiskCache(tmp_path))  # another run: a warm start
    assert "k" in fresh and not hashed  # the presence test reads the header, not the tensor bytes
    assert torch.equal(fresh["k"], value) and torch.equal(fresh["k"], value) and len(hashed) == 1  # checked once

    path = store.path("k")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip a bit of the tensor: the header is intact, the checksum is not
    path.write_bytes(bytes(data))
    rotten = T.DiskStore(tmp_path, digest, T.DiskCache(tmp_path))
    assert "k" in rotten
    with pytest.raises(T.TrainingStopped, match="checksum mismatch"):
        rotten["k"]
    assert not path.exists()  # deleted: the rerun recomputes it
    store2 = T.DiskStore(tmp_path, digest, T.DiskCache(tmp_path))
    store2["k"] = value
    path.write_bytes(path.read_bytes()[:-1])  # truncated by one byte
    assert "k" not in T.DiskStore(tmp_path, digest, T.DiskCache(tmp_path)) and not path.exists()
    assert "damaged" in caplog.text
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"not a safetensors file")
    assert "k" not in T.DiskStore(tmp_path, digest, T.DiskCache(tmp_path))
    for header in ({"__metadata__": "x", "value": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                   {"value": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}, ["value"]):
        text = json.dumps(header).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(4))
        assert "k" not in T.DiskStore(tmp_path, digest, T.DiskCache(tmp_path)) and not path.exists()  # foreign: warned, deleted, recomputed

    shared = T.DiskStore(tmp_path, digest, T.DiskCache(tmp_path))
    shared["k"] = value
    other = T.DiskStore(tmp_path, digest, T.DiskCache(tmp_path))  # another process of the run
    assert "k" in other
    path.unlink()  # the first process found it damaged and deleted it
    with pytest.raises(T.TrainingStopped, match="is gone: another process of this run found it damaged"):
        other["k"]


def test_draw_latents_mode_and_posterior_sample():
    mean, std = torch.randn(2, 4, 3, 3), torch.rand(2, 4, 3, 3) * 0.5 + 0.1
    assert torch.equal(T.draw_latents(mean, torch.Generator().manual_seed(0)), mean)
    params = torch.stack([mean, std], 1)
    a = T.draw_latents(params, torch.Generator().manual_seed(0))
    b = T.draw_latents(params, torch.Generator().manual_seed(1))
    assert not torch.equal(a, b) and torch.equal(a, T.draw_latents(params, torch.Generator().manual_seed(0)))
    draws = torch.stack([T.draw_latents(params, torch.Generator().manual_seed(s)) for s in range(2000)])
    assert (draws.mean(0) - mean).abs().max() < 0.05
    torch.testing.assert_close(draws.std(0), std, rtol=0.1, atol=0.01)


def test_cache_lives_on_cpu():
    cache = SampleCache()
    cache.put("a", torch.ones(1, 2, requires_grad=True) * 2)
    assert cache["a"].device.type == "cpu" and not cache["a"].requires_grad


# ---------------------------------------------------------------------------------------------------- loss


def test_flow_matching_loss_values_per_sample_and_the_step_weighs_the_class_rows():
    pred = torch.zeros(3, 2, 1)
    target = torch.tensor([[[1.0], [1.0]], [[2.0], [0.0]], [[3.0], [3.0]]])
    weighting = torch.tensor([1.0, 1.0, 2.0])
    assert T.flow_matching_loss(pred, target, weighting).tolist() == [1.0, 2.0, 18.0]  # weighted MSE per sample
    from diffusers import Flux2Pipeline

    latents = torch.randn(3, 4, 2, 2)

    class Offset(torch.nn.Module):  # at sigma 1 the input is the noise: predicts the target plus 1, 2, 3 by row
        def forward(self, hidden_states, **kwargs):
            return (hidden_states - Flux2Pipeline._pack_latents(latents) + torch.tensor([1.0, 2.0, 3.0]).view(-1, 1, 1),)

    # rows 0, 1: instance rows of a batch of 2, row 2 a class row: mean(1, 4) + 0.5 * 9
    loss = step_loss(Offset(), latents, torch.zeros(3, 2, 8), torch.ones(1), num_instance=2, prior_loss_weight=0.5)
    assert loss.item() == pytest.approx(2.5 + 4.5)
    assert step_loss(Offset(), latents, torch.zeros(3, 2, 8), torch.ones(1)).item() == pytest.approx((1 + 4 + 9) / 3)


def test_sample_sigmas_seeded_and_from_the_table():
    table = torch.linspace(1.0, 0.001, 1000)
    draw = lambda scheme, s: T.sample_sigmas(table, 64, scheme, 0.0, 1.0, 1.29, torch.Generator().manual_seed(s))  # noqa: E731
    for scheme in ("none", "logit_normal", "mode"):
        a = draw(scheme, 0)
        assert torch.equal(a, draw(scheme, 0)) and not torch.equal(a, draw(scheme, 1))
        assert all(bool((table == v).any()) for v in a)


def test_seed_for_is_stable_and_distinct():
    assert T.seed_for("a", 1, 2) == T.seed_for("a", 1, 2) != T.seed_for("a", 2, 1)
    assert 0 <= T.seed_for("x") < 2**63


# ---------------------------------------------------------------------------------------------------- state


def test_flatten_state_round_trips_an_optimizer_state():
    param = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([param], lr=0.1, betas=(0.8, 0.9))
    param.grad = torch.randn(3, 2)
    opt.step()
    tensors = {}
    skeleton = T.flatten_state(opt.state_dict(), tensors)
    import json

    restored = T.unflatten_state(json.loads(json.dumps(skeleton)), tensors)
    other = torch.optim.AdamW([torch.nn.Parameter(param.detach().clone())], lr=0.5)
    other.load_state_dict(restored)
    assert other.param_groups[0]["lr"] == 0.1 and list(other.param_groups[0]["betas"]) == [0.8, 0.9]
    assert torch.equal(other.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(TypeError):
        T.flatten_state({"x": object()}, {})


# ---------------------------------------------------------------------------------------------------- flags


def _args(*extra):
    return T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", *extra])


@pytest.mark.parametrize("extra, message", [
    ([], "exactly one of --instance_data_dir"),
    (["--with_prior_preservation", "--class_data_dir", "c"], "--class_prompt"),
    (["--with_prior_preservation", "--class_prompt", "c"], "--class_data_dir"),
    # generated class images would land among the subject's, and train as the subject in every later run
    (["--with_prior_preservation", "--class_prompt", "c", "--class_data_dir", "{images}/."],
     "--class_data_dir is --instance_data_dir"),
    (["--do_fp8_training", "--bnb_quantization_config_path", "{config}"], "exclude each other"),
    (["--push_to_hub", "--hub_token", "hf_x", "--report_to", "tensorboard,wandb"], "could leak the token"),
])
def test_flags_that_do_not_go_together_are_named(extra, message, tmp_path):
    """Each flag on its own is tested in test_flags.py; these are combinations."""
    (tmp_path / "bnb.json").write_text('{"load_in_4bit": true}')
    extra = [a.format(config=tmp_path / "bnb.json", images=tmp_path) for a in extra]
    if extra:
        extra = ["--instance_data_dir", str(tmp_path), *extra]
    with pytest.raises(UsageError, match=message):
        T.validate_args(_args(*extra))


def test_tracker_config_never_holds_the_hub_token():
    config = T.tracker_config(_args("--instance_data_dir", ".", "--hub_token", "hf_secret", "--text_encoder_out_layers", "1", "2"))
    assert "hf_secret" not in str(config) and config["text_encoder_out_layers"] == "[1, 2]"


def test_an_atomic_text_write_that_fails_leaves_the_old_file_whole(tmp_path):
    """validation/metrics.jsonl and the progress sheet's record are rewritten whole at each validation: a write that
    fails halfway (here: text that cannot be encoded; in a run, a kill or a full disk) keeps the old text."""
    path = tmp_path / "metrics.jsonl"
    T.write_text_atomic(path, '{"step": 0}\n')
    with pytest.raises(UnicodeEncodeError):
        T.write_text_atomic(path, '{"step": 0}\n{"step": 2, "tag": "\udc80"}\n')
    assert path.read_text() == '{"step": 0}\n' and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_a_folder_copy_that_fails_halfway_leaves_the_old_folder_whole(tmp_path, monkeypatch):
    """--keep_best copies the best LoRA into best/ at each validation that changes it: a copy that fails halfway (here:
    the second file; in a run, a kill or a full disk) keeps the previous best/ whole, and leaves nothing beside it."""
    best, source = tmp_path / "best", tmp_path / "step-4"
    best.mkdir()
    (best / "a.safetensors").write_text("old a")
    (best / "b.safetensors").write_text("old b")
    source.mkdir()
    (source / "a.safetensors").write_text("new a")
    (source / "b.safetensors").write_text("new b")
    copy, copied = shutil.copyfile, []

    def copy_once(src, dst, **kw):
        if copied:
            raise OSError(28, "No space left on device")
        copied.append(src)
        return copy(src, dst, **kw)

    monkeypatch.setattr(shutil, "copyfile", copy_once)
    with pytest.raises(shutil.Error):
        T.copy_folder(source, best)
    assert {p.name: p.read_text() for p in best.iterdir()} == {"a.safetensors": "old a", "b.safetensors": "old b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step-4"]
    monkeypatch.setattr(shutil, "copyfile", copy)
    T.copy_folder(source, best)
    assert {p.name: p.read_text() for p in best.iterdir()} == {"a.safetensors": "new a", "b.safetensors": "new b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step-4"]


@pytest.mark.parametrize("change", ["image", "caption", "condition"])
def test_processes_that_see_another_caption_or_condition_are_refused(change, monkeypatch):
    """Machines with a folder each: a caption or a condition image that differs on one machine used to pass the check
    and then train each machine's own sample (or crash on a cache key nobody encoded)."""
    from types import SimpleNamespace
    cond = ImageRecord("c.png", (8, 8), sha256="c" * 64)
    records = [ImageRecord("a.png", (8, 8), caption="a photo of sks dog", sha256="a" * 64, conditions=(cond,))]
    other = {"image": dict(sha256="b" * 64), "caption": dict(caption="a photo of sks cat"),
             "condition": dict(conditions=(ImageRecord("c.png", (8, 8), sha256="d" * 64),))}[change]
    elsewhere = [ImageRecord(**{**vars(records[0]), **other})]
    accelerator, seen = SimpleNamespace(num_processes=2), []
    monkeypatch.setattr(T, "gather_object", lambda mine: seen.append(mine[0]) or [mine[0], mine[0]])
    T.check_same_images(accelerator, records, [])  # the same on both: passes
    T.check_same_images(accelerator, elsewhere, [])
    monkeypatch.setattr(T, "gather_object", lambda mine: [seen[0], mine[0]])
    with pytest.raises(UsageError, match="the processes see different images or captions"):
        T.check_same_images(accelerator, elsewhere, [])


def test_sharing_entries_gathers_a_bounded_number_per_round_whatever_the_process_count(monkeypatch):
    """Every process receives every round's entries: at 16 per process, 64 GPUs would each hold 1,024 [dev] prompt
    embeddings (16 GB) at once. The round is bounded over all processes instead."""
    from types import SimpleNamespace
    for world in (2, 8, 64):
        cache, rounds = SampleCache(), []
        keys = [f"prompt {i}" for i in range(200)]
        for k in keys[0::world]:
            cache.put(k, torch.zeros(1))
        accelerator = SimpleNamespace(num_processes=world, process_index=0, wait_for_everyone=lambda: None)

        def gather(mine, world=world):
            if mine and isinstance(mine[0], int):  # the count of unseen entries
                return mine * world
            rounds.append(len(mine) * world)  # what every process receives in this round
            return mine

        monkeypatch.setattr(T, "gather_object", gather)
        T.share_entries(cache, keys, accelerator)
        assert rounds and max(rounds) <= max(T.SHARE_PER_ROUND, world), (world, max(rounds))


def test_a_refusal_of_one_machines_images_is_every_processs(monkeypatch):
    """A machine with its own folder that refuses (a missing condition partner, no images) used to exit 2 alone while
    the others died in their next collective with a connection error, never seeing why."""
    from types import SimpleNamespace
    accelerator = SimpleNamespace(num_processes=2)

    def refuse():
        raise UsageError("--cond_data_dir: 1 image(s) without a partner")

    monkeypatch.setattr(T, "gather_object", lambda mine: [None, "--cond_data_dir: 1 image(s) without a partner"])
    with pytest.raises(UsageError, match=r"^process 1: --cond_data_dir: 1 image\(s\) without a partner$"):
        T.agreed_refusal(accelerator, lambda: ["records"])  # this process found its images; process 1 did not
    monkeypatch.setattr(T, "gather_object", lambda mine: mine * 2)  # every process found the same problem
    with pytest.raises(UsageError, match=r"^--cond_data_dir: 1 image\(s\) without a partner$"):
        T.agreed_refusal(accelerator, refuse)
    assert T.agreed_refusal(accelerator, lambda: ["records"]) == ["records"]
