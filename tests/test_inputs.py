"""Hostile inputs and failure safety: what is handled, what is refused (exit 2, one message), what survives."""

import json
import os
import time

import numpy as np
import pytest
import torch
from PIL import Image
from accelerate import PartialState

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch

LORA = "pytorch_lora_weights.safetensors"


# ---------------------------------------------------------------------------------------------------- handled


def _quadrants(w=40, h=20):
    """Red left half, blue right half: orientation mistakes are visible."""
    array = np.zeros((h, w, 3), np.uint8)
    array[:, : w // 2] = (255, 0, 0)
    array[:, w // 2:] = (0, 0, 255)
    return array


def make_exif_rotated(folder):
    image = Image.fromarray(_quadrants())
    exif = image.getexif()
    exif[0x0112] = 6  # displayed rotated 90 degrees clockwise
    image.save(folder / "rotated.jpg", exif=exif, quality=95)
    return lambda rgb: rgb.shape == (40, 20, 3) and rgb[5, 10, 0] > 200 and rgb[35, 10, 2] > 200  # red on top


def make_grayscale(folder):
    Image.new("L", (32, 32), 200).save(folder / "grey.png")
    return lambda rgb: (rgb == 200).all()


def make_palette(folder):
    image = Image.new("P", (32, 32), 1)
    image.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    image.save(folder / "palette.png")
    return lambda rgb: (rgb == (10, 200, 30)).all()


def make_16bit(folder):
    array = np.full((32, 32), 65535, np.uint16)
    array[:, 16:] = 32896  # mid grey in 16 bits
    Image.fromarray(array).save(folder / "deep.png")  # a 16-bit greyscale PNG
    return lambda rgb: (rgb[:, :16] == 255).all() and (abs(rgb[:, 16:].astype(int) - 128) <= 1).all()


def make_cmyk(folder):
    Image.new("CMYK", (32, 32), (255, 0, 0, 0)).save(folder / "print.jpg")  # pure cyan ink
    return lambda rgb: rgb[..., 0].max() < 30 and rgb[..., 1:].min() > 220


def make_rgba(folder):
    image = Image.new("RGBA", (32, 32), (0, 0, 0, 0))  # transparent black...
    image.paste((250, 10, 10, 255), (0, 0, 16, 32))
    image.save(folder / "cutout.png")
    return lambda rgb: (rgb[:, 16:] == T.NEUTRAL_GREY).all() and (rgb[:, :16] == (250, 10, 10)).all()  # ...on grey


def make_unicode_name(folder):
    Image.new("RGB", (32, 32), (1, 2, 3)).save(folder / "hünd 🐕 ß.png")
    (folder / "hünd 🐕 ß.txt").write_text("ein Hund am Strand", encoding="utf-8")
    return lambda rgb: (rgb == (1, 2, 3)).all()


def make_small(folder):
    Image.new("RGB", (8, 8), (9, 9, 9)).save(folder / "tiny.png")
    return lambda rgb: rgb.shape == (8, 8, 3)  # upscaled later, to the bucket


HANDLED = {f.__name__.removeprefix("make_"): f for f in (make_exif_rotated, make_grayscale, make_palette, make_16bit,
                                                          make_cmyk, make_rgba, make_unicode_name, make_small)}


@pytest.mark.parametrize("kind", HANDLED)
def test_handled_input_is_loaded_as_the_user_sees_it(kind, tmp_path):
    check = HANDLED[kind](tmp_path)
    (record,) = T.scan_image_folder(tmp_path)
    rgb = np.asarray(record.load())
    assert record.load().mode == "RGB" and record.size == (rgb.shape[1], rgb.shape[0])
    assert check(rgb), rgb[::8, ::8]


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".webp", ".tif"])
def test_record_size_is_the_size_of_the_loaded_pixels_in_every_orientation(suffix, tmp_path):
    """A TIFF reports its displayed size at open and turns its pixels in load(); the other formats leave both to
    exif_transpose: either way the bucket is chosen by the size the pixels have (a TIFF's was transposed)."""
    for orientation in range(1, 9):
        image = Image.fromarray(_quadrants(40, 24))
        exif = image.getexif()
        exif[0x0112] = orientation
        image.save(tmp_path / f"o{orientation}{suffix}", exif=exif)
    records = T.scan_image_folder(tmp_path)
    assert [(r.name, r.size) for r in records] == [(r.name, r.load().size) for r in records]
    assert [r.size for r in records] == [(40, 24)] * 4 + [(24, 40)] * 4


def test_scan_index_of_an_older_version_is_scanned_again(tmp_path):
    """Indexes written before the TIFF fix hold a turned TIFF's size transposed: an unversioned one is not trusted."""
    folder, cache = tmp_path / "images", T.DiskCache(tmp_path / "cache")
    folder.mkdir()
    image = Image.fromarray(_quadrants(40, 24))
    exif = image.getexif()
    exif[0x0112] = 6
    image.save(folder / "turned.tif", exif=exif)
    os.utime(folder / "turned.tif", (time.time() - 60,) * 2)  # not racy: indexed
    T.scan_folder(folder, cache, PartialState())
    (path,) = (tmp_path / "cache" / "scans").iterdir()
    document = json.loads(path.read_text())
    assert document.pop("version") == T.ScanIndex.VERSION and document["files"]["turned.tif"][2:4] == [24, 40]
    document["files"]["turned.tif"][2:4] = [40, 24]  # what the unversioned scan wrote
    path.write_text(json.dumps(document))
    (record,) = T.scan_folder(folder, cache, PartialState())
    assert record.size == record.load().size == (24, 40)


def test_dataset_rows_are_decoded_and_hashed_once_at_load_with_the_keys_of_before(tmp_path, monkeypatch):
    """A row's hash was its pixels' (content_hash decoded and hashed them at every cache lookup, 0.2 s for 12 MP);
    now made once at load, the same value, so the disk cache's entries keep their names."""
    pytest.importorskip("datasets")
    import hashlib
    import io

    import datasets

    turned = io.BytesIO()
    image = Image.fromarray(_quadrants(40, 24))
    exif = image.getexif()
    exif[0x0112] = 6
    image.save(turned, "JPEG", exif=exif)
    plain, square = Image.fromarray(_quadrants(40, 24)), Image.new("RGB", (16, 16), (7, 8, 9))
    datasets.Dataset.from_dict({"image": [plain, {"bytes": turned.getvalue(), "path": None}], "text": ["a", "b"],
                                "refs": [[square], [square, plain]]}).save_to_disk(str(tmp_path / "ds"))
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, cache_dir=None: {
        "train": datasets.load_from_disk(name)})
    records = T.load_hf_dataset(str(tmp_path / "ds"), None, "image", "text", None, "refs")
    images = [*records, *(c for r in records for c in r.conditions)]
    assert [r.size for r in images] == [r.load().size for r in images] == [(40, 24), (24, 40), (16, 16), (16, 16),
                                                                            (40, 24)]
    before = [hashlib.sha256(r.load().tobytes()).hexdigest() for r in images]  # what content_hash computed
    assert before[0] == hashlib.sha256(_quadrants(40, 24).tobytes()).hexdigest() == before[4]
    monkeypatch.setattr(T.ImageRecord, "load", lambda self: pytest.fail(f"{self.name} decoded again"))
    assert [r.content_hash() for r in images] == before


def test_small_images_are_upscaled_to_their_bucket_with_one_warning(tmp_path, caplog):
    from accelerate import Accelerator

    make_small(tmp_path)
    Image.new("RGB", (4, 4)).save(tmp_path / "tinier.png")
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir",
                         str(tmp_path), "--resolution", "32", "--train_batch_size", "1"])
    dataset, _, _ = T.build_data(args, T.scan_image_folder(tmp_path), [], 0, Accelerator(cpu=True))
    assert dataset[(0, 0)]["pixel_values"].shape == (1, 3, 32, 32)
    assert caplog.text.count("smaller than their bucket") == 1 and "tiny.png" in caplog.text


def test_empty_caption_falls_back_to_the_instance_prompt_with_a_warning(tmp_path):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text(" \r\n")
    with pytest.warns(UserWarning, match="empty caption"):
        (record,) = T.scan_image_folder(tmp_path)
    assert record.caption is None


def test_a_folder_of_every_handled_input_trains(tiny_model, tmp_path):
    folder = tmp_path / "hostile"
    folder.mkdir()
    for make in HANDLED.values():
        make(folder)
    (folder / ".DS_Store").write_bytes(b"\0\1")
    (folder / "Thumbs.db").write_bytes(b"\0\1")
    (folder / "notes.txt").write_text("a caption file without an image")
    (folder / "deep.txt").write_bytes("\ufeffa deep photo \r\n".encode())
    out = tmp_path / "out"
    launch(base_args(tiny_model, folder, out, "--max_train_steps", "2", "--random_flip"))
    assert (out / LORA).is_file()


# ---------------------------------------------------------------------------------------------------- refused


def _truncated_png(folder):
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(folder / "cut.png")
    data = (folder / "cut.png").read_bytes()
    (folder / "cut.png").write_bytes(data[: len(data) // 2])


REFUSED = {
    "corrupt": (lambda f: (f / "junk.jpg").write_bytes(b"\xff\xd8 this is not a jpeg"), "junk.jpg"),
    "truncated": (_truncated_png, "cut.png"),
    "zero_bytes": (lambda f: (f / "empty.png").write_bytes(b""), "empty.png: empty file"),
    "not_utf8_caption": (lambda f: (Image.new("RGB", (8, 8)).save(f / "x.png"), (f / "x.txt").write_bytes(b"caf\xe9")),
                         "x.txt: caption is not UTF-8"),
}


@pytest.mark.parametrize("kind", REFUSED)
def test_bad_file_is_refused_with_its_name(kind, tmp_path):
    make, message = REFUSED[kind]
    Image.new("RGB", (8, 8)).save(tmp_path / "fine.png")
    make(tmp_path)
    with pytest.raises(T.UsageError) as error:
        T.scan_image_folder(tmp_path)
    assert message in str(error.value) and "fine.png" not in str(error.value)


def test_decompression_bomb_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # a 40x40 image is a "bomb" now; real limit ~89 Mpx
    Image.new("RGB", (40, 40)).save(tmp_path / "bomb.png")
    with pytest.raises(T.UsageError, match="bomb.png"):
        T.scan_image_folder(tmp_path)


@pytest.mark.slow
def test_every_bad_file_is_listed_in_one_message_exit_2(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    for make, _ in REFUSED.values():
        make(folder)
    proc = launch(base_args("nobody/no-such-model", folder, tmp_path / "out"), check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "cannot use 4 file(s)" in proc.stderr
    for _, message in REFUSED.values():
        assert message in proc.stderr


def _dataset_folder(folder, rows):
    """A folder `datasets` reads as images plus metadata.jsonl; rows: (file name, bytes or None to leave it good)."""
    folder.mkdir()
    for k, (file_name, data) in enumerate(rows):
        Image.new("RGB", (24, 16), (40 * k, 0, 0)).save(folder / file_name)
        if data is not None:
            (folder / file_name).write_bytes(data((folder / file_name).read_bytes()))
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps({"file_name": n, "text": f"dog {n}"}) for n, _ in rows))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bad_rows", "text_column"])
def test_bad_dataset_rows_or_column_exit_2_naming_them(case, tmp_path):
    pytest.importorskip("datasets")
    folder = _dataset_folder(tmp_path / "ds", [("a.png", None), ("b.png", lambda data: data[: len(data) // 2]),
                                               ("c.png", lambda data: b"junk"), ("d.png", None)])
    args = [*base_args("nobody/no-such-model", folder, tmp_path / "out"), "--caption_column", "text"]
    args[args.index("--instance_data_dir")] = "--dataset_name"
    if case == "text_column":
        args += ["--image_column", "text"]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1"}
    proc = launch(args, env=env, check=False, timeout=300)  # HF_HOME is read at import: a fresh interpreter
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if case == "text_column":
        assert "--image_column 'text': row 0 holds str, not images" in proc.stderr
    else:  # both, in one message, each by its row and file
        assert "cannot use 2 row(s)" in proc.stderr and "a.png" not in proc.stderr and "d.png" not in proc.stderr
        assert f"row 1 ({folder / 'b.png'}): image file is truncated" in proc.stderr
        assert f"row 2 ({folder / 'c.png'}): cannot identify image file" in proc.stderr


@pytest.mark.parametrize("case, message", [
    ("missing", "FileNotFoundError: Couldn't find any data file"), ("empty", "EmptyDatasetError"),
    ("offline", "ConnectionError: Couldn't reach 'nobody/no-such-dataset'"),
    ("no_train", "no train split (splits: test)"),
    ("bad_config", "(config nope): ValueError: BuilderConfig 'nope' not found")])
def test_unusable_dataset_name_is_one_message_naming_the_flag(case, message, tmp_path):
    pytest.importorskip("datasets")
    name, config = tmp_path / "ds", "nope" if case == "bad_config" else None
    if case in ("empty", "no_train", "bad_config"):
        (name / "test").mkdir(parents=True)
    if case in ("no_train", "bad_config"):
        Image.new("RGB", (24, 16)).save(name / "test" / "a.png")
    name = "nobody/no-such-dataset" if case == "offline" else str(name)  # conftest: HF_HUB_OFFLINE
    with pytest.raises(T.UsageError) as error:
        T.load_hf_dataset(name, config, "image", None, str(tmp_path / "hf"))
    assert str(error.value).startswith(f"--dataset_name {name}") and message in str(error.value), error.value


def _masked_folder(folder):
    """Four 64x40 images: a mask at half scale, one a pixel off, one corrupt, one of the transposed shape."""
    folder.mkdir()
    for stem, mask in (("half", (32, 20)), ("rounded", (32, 21)), ("corrupt", None), ("turned", (40, 64))):
        Image.new("RGB", (64, 40)).save(folder / f"{stem}.png")
        if mask is None:
            (folder / f"{stem}_mask.png").write_bytes(b"\x89PNG not a mask")
        else:
            Image.new("L", mask, 255).save(folder / f"{stem}_mask.png")
    return folder


def test_masks_are_checked_by_the_scan_only_for_masked_loss(tmp_path, monkeypatch):
    folder = _masked_folder(tmp_path / "images")
    real, decoded = T.inspect_image, []
    monkeypatch.setattr(T, "inspect_image", lambda path: decoded.append(path.name) or real(path))
    assert [r.mask_path is not None for r in T.scan_image_folder(folder)] == [True] * 4
    assert "corrupt_mask.png" not in decoded  # without --masked_loss no mask is read: the scan costs what it did
    with pytest.raises(T.UsageError) as error:
        T.scan_image_folder(folder, with_masks=True)
    message = str(error.value)
    assert "cannot use 2 file(s)" in message and f"{folder / 'corrupt_mask.png'}: cannot identify image file" in message
    assert f"{folder / 'turned_mask.png'}: the mask is 40x64, its image turned.png 64x40 (as displayed)" in message
    assert "half" not in message and "rounded" not in message  # another scale, a pixel of rounding: no stretch
    (folder / "corrupt_mask.png").unlink()
    (folder / "turned_mask.png").unlink()
    assert len(T.scan_image_folder(folder, with_masks=True)) == 4


@pytest.mark.slow
def test_a_bad_mask_exits_2_before_any_model_loads(tmp_path):
    folder = _masked_folder(tmp_path / "images")
    proc = launch([*base_args("nobody/no-such-model", folder, tmp_path / "out"), "--masked_loss"], check=False,
                  timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "corrupt_mask.png" in proc.stderr and "the mask is 40x64, its image turned.png 64x40" in proc.stderr


@pytest.mark.parametrize("folder_state", ["missing", "empty", "only_text"])
def test_missing_or_empty_folder_is_refused(folder_state, tmp_path):
    folder = tmp_path / "images"
    if folder_state != "missing":
        folder.mkdir()
    if folder_state == "only_text":
        (folder / "a.txt").write_text("caption without image")
    with pytest.raises(T.UsageError, match="expected an existing, readable folder" if folder_state == "missing" else
                       "no images found"):
        args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir",
                             str(folder)])
        T.load_instance_images(args, T.MemoryCache(), PartialState())


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["--lora_layers", "to_q,attn.nonexistent_proj"], "--lora_layers attn.nonexistent_proj: no linear layer"),
    (["--lora_layers", "to_out"], "--lora_layers to_out: also names transformer_blocks.0.attn.to_out (ModuleList)"),
    pytest.param(["--mixed_precision", "fp16"], "--mixed_precision fp16 needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without CUDA")),
    ("finished_output", "already holds a finished LoRA"),
])
def test_bad_flag_for_this_model_or_machine_exits_2(extra, message, tiny_model, images, tmp_path):
    out = tmp_path / "out"
    if extra == "finished_output":
        out.mkdir()
        (out / LORA).write_bytes(b"from an earlier run")
        extra = []
    proc = launch(base_args(tiny_model, images, out, *extra), check=False, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    if "lora_layers" in message:
        assert "attn.to_q" in proc.stderr  # valid names are listed
        assert "loading the text encoder" not in proc.stderr


@pytest.mark.parametrize("case", ["copy into no folder", "copy named diffusers.py", "--keep without --write_copy",
                                  "a key twice in --config", "--timestep_shift 1e40", "--hub_model_id 'my lora'"])
def test_round_six_bad_inputs_exit_2_with_one_line_and_leave_nothing(case, tmp_path):
    """Issue 59, as a new user met them: exit 1 or a copy that cannot run, a folder dropped without a word, a NaN at
    step 1 with files left, a model card no Hub accepts. Each: exit 2, one `error:` line naming the flag or file, no
    traceback, before any model loads (the model does not exist), nothing written."""
    out, config = tmp_path / "out", tmp_path / "run.yaml"
    config.write_text(f"datasets:\n- folder: {tmp_path}\n  folder: {tmp_path}\n")  # the second entry's dash forgotten
    train = base_args("nobody/no-such-model", tmp_path, out)
    argv, said = {
        "copy into no folder": (["--write_copy", tmp_path / "nope" / "sub" / "c.py"], f"--write_copy {tmp_path}/nope"
                                                                                       f"/sub/c.py: no folder"),
        "copy named diffusers.py": (["--write_copy", tmp_path / "diffusers.py"], f"--write_copy {tmp_path}/diffusers.py: "
                                                                               "run as a script, it would be imported "
                                                                               "in place of the library diffusers"),
        "--keep without --write_copy": ([*train, "--keep", "ema"], "--keep has no effect without --write_copy FILE"),
        "a key twice in --config": ([*train, "--config", config],
                                    f"--config {config}: line 3: 'folder' is given twice in one mapping"),
        "--timestep_shift 1e40": ([*train, "--timestep_shift", "1e40"], "--timestep_shift 1e40: expected"),
        "--hub_model_id 'my lora'": ([*train, "--hub_model_id", "my lora"], "--hub_model_id my lora: expected a Hub "
                                                                           "repository id"),
    }[case]
    proc = launch([str(a) for a in argv], check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {said}") and "Traceback" not in proc.stderr, (
        proc.stderr[-3000:])
    assert len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


# ---------------------------------------------------------------------------------------------------- failures


@pytest.mark.slow
def test_non_finite_loss_stops_keeps_the_last_checkpoint_and_writes_no_lora(tiny_model, images, tmp_path):
    out = tmp_path / "out"
    # run directly: under `accelerate launch` the launcher adds its own traceback for any non-zero exit
    proc = launch(base_args(tiny_model, images, out, "--learning_rate", "1e30", "--max_grad_norm", "1e30",
                            "--max_train_steps", "10", "--checkpointing_steps", "1"), check=False, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "NaN or infinite at step 2" in proc.stderr and "checkpoint-1" in proc.stderr
    # advice a resume accepts (another --learning_rate is refused by it); the fp16 hint only for an fp16 run
    assert "resume from it with a lower --max_grad_norm, or start over (--overwrite_output_dir) with a lower " \
           "--learning_rate" in proc.stderr and "--mixed_precision" not in proc.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"] and not (out / LORA).exists()


def test_the_non_finite_loss_message_names_the_flags_of_the_run_that_can_cause_it(tmp_path):
    """An extreme --timestep_shift or sigma_sqrt's unbounded weights make a NaN loss as a high rate does: the message
    names each of those flags with the run's value (fp16 only where the run is fp16)."""
    def message(*flags, fp16=False):
        args = T.parse_args(["--pretrained_model_name_or_path", "m", "--output_dir", str(tmp_path), *flags])
        return T.non_finite_loss(args, fp16, 3, [4, 5])
    plain = message()
    assert plain.startswith("the loss became NaN or infinite at step 3 (samples [4, 5]); stopped before applying")
    assert ("Flags that can cause it: --learning_rate 0.0001, --max_grad_norm 1, --timestep_shift none, "
            "--weighting_scheme none. Last good checkpoint: none: resume from it") in plain
    assert "--mixed_precision" not in plain
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / T.TRAINER_STATE_NAME).write_text("{}")
    risky = message("--timestep_shift", "1e30", "--weighting_scheme", "sigma_sqrt", fp16=True)
    assert ("--timestep_shift 1e+30, --weighting_scheme sigma_sqrt, --mixed_precision fp16 (bf16 has the range). "
            f"Last good checkpoint: {tmp_path / 'checkpoint-2'}: resume") in risky


def test_out_of_memory_in_the_final_validation_says_so_and_still_writes_the_card(tiny_model, images, tmp_path,
                                                                                 monkeypatch):
    """The training flags would not help there; the LoRA is saved already, and the model card is written."""
    import functools

    from diffusers import Flux2Pipeline

    call = Flux2Pipeline.__call__

    @functools.wraps(call)  # the script reads the pipeline's defaults from its signature
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(Flux2Pipeline, "__call__", oom)
    out = tmp_path / "out"
    with pytest.raises(T.TrainingStopped) as stopped:
        T.main(base_args(tiny_model, images, out, "--max_train_steps", "2", "--validation_prompt", "a dog",
                         "--num_validation_images", "1"))
    assert str(stopped.value).startswith("out of GPU memory making the validation images of step 2") and \
        "--offload" in str(stopped.value) and "--gradient_checkpointing" not in str(stopped.value)
    assert (out / LORA).is_file() and "DreamBooth LoRA" in (out / "README.md").read_text()


def test_out_of_memory_names_the_flags_that_help(tiny_model, images, tmp_path, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(T, "training_step", oom)
    with pytest.raises(T.TrainingStopped) as stopped:
        T.main(base_args(tiny_model, images, tmp_path / "out", "--max_train_steps", "2"))
    for flag in ("--gradient_checkpointing", "--cache_latents", "--resolution", "--train_batch_size", "--use_8bit_adam"):
        assert flag in str(stopped.value)
    assert not (tmp_path / "out" / LORA).exists()


def test_disk_full_while_checkpointing_keeps_earlier_checkpoints(checkpoint_run, tmp_path, monkeypatch):
    accelerator, run = checkpoint_run
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir", ".",
                         "--output_dir", str(tmp_path)])
    T.save_checkpoint(args, accelerator, run, 2)
    real_write = T.write_state

    def full_disk(folder, name, state, run_id=None):
        if name == "training":
            raise OSError(28, "No space left on device")
        real_write(folder, name, state, run_id)

    monkeypatch.setattr(T, "write_state", full_disk)
    with pytest.raises(T.TrainingStopped, match="No space left on device.*checkpoint-2"):
        T.save_checkpoint(args, accelerator, run, 4)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]
    assert T.list_checkpoints(tmp_path) == [tmp_path / "checkpoint-2"]
    assert T.load_checkpoint(tmp_path / "checkpoint-2", accelerator, run) == 2


# ---------------------------------------------------------------------------------------------------- security


def test_hub_token_never_reaches_logs_trackers_or_outputs(tiny_model, images, tmp_path):
    token = "hf_NeverWriteThisToken123"
    out = tmp_path / "out"
    proc = launch(base_args(tiny_model, images, out, "--max_train_steps", "2", "--checkpointing_steps", "1",
                            "--hub_token", token, "--report_to", "tensorboard", "--validation_prompt", "a dog",
                            "--num_validation_images", "1"))
    assert token not in proc.stdout + proc.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any("events.out.tfevents" in p.name for p in files)  # the tracker config was written...
    assert not [p for p in files if token.encode() in p.read_bytes()]  # ...without the token
    checkpoint_files = {p.suffix for p in out.glob("checkpoint-*/*")}
    assert checkpoint_files == {".safetensors", ".json", ".yaml"}  # nothing to unpickle (.yaml: the resolved flags)
    json.loads((out / "checkpoint-2" / T.TRAINER_STATE_NAME).read_text())


def test_checkpoint_limit_never_deletes_the_one_just_written(checkpoint_run, tmp_path):
    accelerator, run = checkpoint_run
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir", ".",
                         "--output_dir", str(tmp_path), "--checkpoints_total_limit", "1"])
    (tmp_path / "checkpoint-9.partial").mkdir()  # a run killed while writing
    for step in (2, 4, 6):
        T.save_checkpoint(args, accelerator, run, step)
        assert T.list_checkpoints(tmp_path) == [tmp_path / f"checkpoint-{step}"]


def test_concurrent_writers_of_one_cache_entry_leave_a_valid_entry(tmp_path):
    import threading

    from accelerate import PartialState

    PartialState()
    value = torch.randn(64, 64)
    stores = [T.DiskStore(tmp_path, lambda key: T.json_digest(key), T.DiskCache(tmp_path)) for _ in range(4)]

    def write(store):
        for _ in range(20):
            store["shared"] = value

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = T.DiskStore(tmp_path, lambda key: T.json_digest(key), T.DiskCache(tmp_path))
    assert "shared" in fresh and torch.equal(fresh["shared"], value) and not list(tmp_path.rglob("*.tmp"))
