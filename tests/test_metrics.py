"""--validation_metrics and --keep_best (issue 37), on tiny random DINOv2 and CLIP models saved as Hub folders:
each score against a hand computation from the models' own outputs, what --keep_best may keep, and one tiny run
(validations at steps 2 and 4 and the final one) whose kept LoRA is the scored one and survives a resume. The proofs
that the scores mean something (the subject's likeness rises only when the LoRA learns; output preservation drifts
less than plain training) ride on the learning runs: tests/test_learning.py and tests/test_preservation.py."""

import argparse
import json
import re
import shutil
import types
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch
from tests.tiny_flux2 import make_images
from tests.tiny_metrics import build_tiny_clip, build_tiny_dino, build_tiny_dino_v1

LORA = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    root = tmp_path_factory.mktemp("scorers")
    return build_tiny_dino(root / "dino"), build_tiny_clip(root / "clip")


@pytest.fixture(scope="module")
def dino_v1(tmp_path_factory):
    """The DreamBooth paper's DINO (facebook/dino-vits16's kind), tiny and random."""
    return build_tiny_dino_v1(tmp_path_factory.mktemp("scorers") / "dino-v1")


def pictures(count, size=(40, 56), seed=0):
    """Fixed images: smooth random colour fields of an odd size, so resizing and cropping matter."""
    generator = torch.Generator().manual_seed(seed)
    fields = torch.nn.functional.interpolate(torch.rand(count, 3, 4, 4, generator=generator), size=size[::-1],
                                             mode="bilinear")
    return [Image.fromarray((f.permute(1, 2, 0).numpy() * 255).astype("uint8")) for f in fields]


@pytest.mark.slow
def test_each_score_is_the_hand_computed_one(scorers):
    """subject: the mean over every (generated, reference) pair of the cosine of DINOv2's CLS token (after its last
    layer norm) on 224 px centre crops with ImageNet's mean and std; prompt: the mean cosine of each image's CLIP
    embedding with its prompt's; drift: 1 minus the mean paired cosine of DINOv2 features."""
    from transformers import AutoImageProcessor, AutoModel, AutoProcessor, CLIPModel

    dino_dir, clip_dir = scorers
    models = T.MetricModels(dino_dir, clip_dir)
    generated, references, base = pictures(3), pictures(2, seed=1), pictures(3, seed=2)
    processor, dino = AutoImageProcessor.from_pretrained(dino_dir), AutoModel.from_pretrained(dino_dir)
    pixels = processor(images=generated + references + base, return_tensors="pt")["pixel_values"]
    assert pixels.shape == (8, 3, 224, 224)
    with torch.no_grad():
        cls = dino(pixel_values=pixels).last_hidden_state[:, 0]
    cos = torch.nn.functional.cosine_similarity
    by_hand = sum(cos(cls[g], cls[3 + r], dim=0) for g in range(3) for r in range(2)) / 6
    features = models.dino_features(generated, "cpu")
    assert T.subject_score(features, models.dino_features(references, "cpu")) == pytest.approx(by_hand.item(), abs=1e-5)
    drift = 1 - sum(cos(cls[g], cls[5 + g], dim=0) for g in range(3)) / 3
    assert 1 - T.paired_score(features, models.dino_features(base, "cpu")) == pytest.approx(drift.item(), abs=1e-5)
    prompts = ["a photo of sks dog", "a red square", "two cats on a sofa"]
    clip_processor, clip = AutoProcessor.from_pretrained(clip_dir), CLIPModel.from_pretrained(clip_dir)
    inputs = clip_processor(text=prompts, images=generated, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = clip(**inputs)
    by_hand = sum(cos(out.image_embeds[i], out.text_embeds[i], dim=0) for i in range(3)) / 3
    assert T.paired_score(*models.clip_embeddings(generated, prompts, "cpu")) == pytest.approx(by_hand.item(), abs=1e-5)
    assert len({round(T.paired_score(*models.clip_embeddings([generated[0]], [p], "cpu")), 6) for p in prompts}) == 3


@pytest.mark.slow
def test_dino_v1_scores_as_the_dreambooth_paper_does(dino_v1):
    """--metrics_dino_model facebook/dino-vits16 (a ViTModel): the subject score is the mean over every (generated,
    reference) pair of the cosine of the last hidden state's CLS token on the model's processor's 224 px images, not of
    its pooler (random when loaded: DINO trained none); loading it draws nothing from training's random numbers."""
    from transformers import AutoImageProcessor, ViTModel

    state = torch.get_rng_state()
    models = T.MetricModels(dino_v1)
    assert torch.equal(torch.get_rng_state(), state)
    generated, references = pictures(3), pictures(2, seed=1)
    processor, vit = AutoImageProcessor.from_pretrained(dino_v1), ViTModel.from_pretrained(dino_v1,
                                                                                             add_pooling_layer=False)
    pixels = processor(images=generated + references, return_tensors="pt")["pixel_values"]
    assert pixels.shape == (5, 3, 224, 224)
    with torch.no_grad():
        cls = vit(pixel_values=pixels).last_hidden_state[:, 0]
    cos = torch.nn.functional.cosine_similarity
    by_hand = sum(cos(cls[g], cls[3 + r], dim=0) for g in range(3) for r in range(2)) / 6
    score = T.subject_score(models.dino_features(generated, "cpu"), models.dino_features(references, "cpu"))
    assert score == pytest.approx(by_hand.item(), abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("trigger", [None, "ohwx"])
def test_the_subject_score_reads_only_the_images_whose_prompt_names_the_subject(scorers, tmp_path, trigger):
    """subject: the rows whose prompt holds --trigger_word, or else the instance prompt's word that the drift prompts
    lack (sks); a prompt naming neither (a red square) and the drift prompts' rows are left out of it."""
    (tmp_path / "drift.txt").write_text("a photo of dog\n")
    args = argparse.Namespace(validation_metrics="all", metrics_drift_prompts=tmp_path / "drift.txt",
                              instance_prompt=f"a photo of {trigger or 'sks'} dog", metrics_reference_dir=None,
                              trigger_word=trigger, class_prompt=None)
    option = T.ValidationMetrics(args)
    option.models = T.MetricModels(*scorers)
    option.references = option.models.dino_features(pictures(2, seed=1), "cpu")
    images, base = pictures(4), pictures(4, seed=2)
    rows = [(f"{trigger or 'sks'} dog in a bucket", 0), ("a red square", 1), ("a photo of dog", 2),
            (f"a {trigger or 'sks'} dog on a beach", 3)]
    scores = option._scores(types.SimpleNamespace(device="cpu"), rows, dict(enumerate(images)), dict(enumerate(base)))
    features = option.models.dino_features
    assert scores["subject"] == pytest.approx(T.subject_score(features([images[0], images[3]], "cpu"),
                                                              option.references), abs=1e-6)
    wrong = T.subject_score(features(images[:2] + images[3:], "cpu"), option.references)
    assert abs(scores["subject"] - wrong) > 1e-4  # the red square would have moved it
    assert scores["drift"] == pytest.approx(1 - T.paired_score(features([images[2]], "cpu"),
                                                               features([base[2]], "cpu")), abs=1e-6)


def test_keep_best_chooses_by_its_criterion_and_keeps_only_what_may_still_win():
    history = [{"step": 0, "tag": "base", "subject": 0.99, "prompt": 0.99, "drift": 0.0},  # never kept
               {"step": 2, "tag": "a", "subject": 0.50, "prompt": 0.30, "drift": 0.10},
               {"step": 4, "tag": "b", "subject": 0.70, "prompt": 0.20, "drift": 0.30},
               {"step": 6, "tag": "c", "subject": 0.60, "prompt": 0.30, "drift": 0.40},
               {"step": 8, "tag": "d", "subject": 0.65, "prompt": 0.25, "drift": 0.20}]
    assert T.best_entry(history, "subject")["step"] == 4
    assert T.best_entry(history, "prompt")["step"] == 2  # the earliest of equals
    assert T.best_entry(history, "balanced")["step"] == 8  # drift at most the last one's (0.20)
    assert T.best_entry(history, "balanced", max_drift=0.35)["step"] == 4
    assert T.best_entry(history, "balanced", max_drift=0.05) is None
    assert T.may_be_kept(history, "subject") == {4}
    # the final drift decides later: keep every validation no other beats in both scores (6 loses to 4)
    assert T.may_be_kept(history, "balanced") == {2, 4, 8}
    assert T.may_be_kept(history, "balanced", max_drift=0.15) == {2}


def test_validations_without_the_scores_keep_best_compares_take_no_part(tmp_path):
    """A validation none of whose prompts names the subject has no subject score: --keep_best subject or balanced
    passes it over (it crashed with KeyError 'subject' mid-training), and with none scored the log says why."""
    history = [{"step": 0, "tag": "base", "prompt": 0.9, "drift": 0.0},
               {"step": 2, "tag": "a", "prompt": 0.3, "drift": 0.1},
               {"step": 4, "tag": "b", "subject": 0.6, "prompt": 0.2, "drift": 0.3},
               {"step": 6, "tag": "c", "prompt": 0.4, "drift": 0.2}]
    assert T.best_entry(history, "subject")["step"] == 4 and T.may_be_kept(history, "subject") == {4}
    assert T.best_entry(history, "balanced")["step"] == 4  # the latest compared validation's drift is the limit
    assert T.may_be_kept(history, "balanced") == {4} and T.best_entry(history, "balanced", max_drift=0.2) is None
    unscored = [e for e in history if "subject" not in e]
    assert T.best_entry(unscored, "subject") is None and T.may_be_kept(unscored, "balanced") == set()
    args = argparse.Namespace(keep_best="balanced", max_drift=None, output_dir=str(tmp_path))
    option = T.ValidationMetrics(args)
    option.history = unscored
    assert option._keep(None, tmp_path / "validation", unscored[-1]) == (
        "; no validation has a subject and drift score yet (subject: no prompt names the subject), no best LoRA")


@pytest.mark.parametrize("flags, named", [
    (["--trigger_word", "sks", "--validation_prompt", "a photo of a dog"], False),
    (["--trigger_word", "sks", "--validation_prompt", "a photo of [trigger] dog"], True),
    (["--validation_prompt", "a photo of a dog"], False),  # sks, the instance prompt's word the drift prompt lacks
    (["--validation_prompt", "a photo of a dog", "--validation_prompts_file", "PROMPTS"], True),
    (["--validation_prompt", "a photo of a dog", "--final_validation_prompt", "a photo of sks dog"], False),  # ignored
    (["--final_validation_prompt", "a photo of sks dog"], True),
])
def test_keep_best_by_subject_without_a_prompt_naming_the_subject_is_refused(tmp_path, flags, named):
    """Known before anything loads: no validation prompt names the subject, so no validation has a subject score."""
    make_images(str(tmp_path / "images"))
    (tmp_path / "drift.txt").write_text("a photo of dog\n")
    (tmp_path / "prompts.txt").write_text("sks dog on a beach\n")
    flags = [str(tmp_path / "prompts.txt") if f == "PROMPTS" else f for f in flags]
    for keep in ("subject", "balanced"):
        args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", str(tmp_path / "images"),
                             "--instance_prompt", "a photo of sks dog", "--validation_metrics", "dino,drift",
                             "--metrics_drift_prompts", str(tmp_path / "drift.txt"), "--keep_best", keep, *flags])
        if named:
            T.validate_args(args)
        else:
            with pytest.raises(T.UsageError, match=f"--keep_best {keep} compares subject scores, and no validation "
                                                   "prompt names the subject"):
                T.validate_args(args)


@pytest.fixture(scope="module")
def kept(tiny_model, scorers, dino_v1, tmp_path_factory):
    """One run of two processes scoring every validation (DINO v1: DINOv2 runs end to end in test_learning.py and
    test_preservation.py) and keeping the best LoRA by subject (checkpoints where it validates), and the same run
    resumed from its checkpoint-2 in a copy of its folder (history: steps 0 to 4)."""
    root = tmp_path_factory.mktemp("kept")
    make_images(str(root / "images"))
    (root / "drift.txt").write_text("a photo of dog\n")
    dino, clip = dino_v1, scorers[1]
    flags = ["--max_train_steps", "6", "--checkpointing_steps", "2", "--validation_steps", "2", "--validation_prompt",
             "a photo of sks dog", "--num_validation_images", "2", "--validation_metrics", "all",
             "--metrics_drift_prompts", root / "drift.txt", "--metrics_dino_model", dino, "--metrics_clip_model", clip,
             "--keep_best", "subject", "--learning_rate", "2e-2", "--lora_dropout", "0.1"]
    straight = launch(base_args(tiny_model, root / "images", root / "straight", *flags), num_processes=2)
    later = {"checkpoint-4", "checkpoint-6", LORA, "best", "README.md"}  # what the run wrote after checkpoint 2
    shutil.copytree(root / "straight", root / "resumed",
                    ignore=lambda folder, names: later & set(names) if folder == str(root / "straight") else [])
    scored = root / "resumed" / "validation" / "scored"  # as it was after validation 2, the only one then
    shutil.rmtree(scored)
    (scored / "step-2").mkdir(parents=True)
    shutil.copy(root / "straight" / "checkpoint-2" / LORA, scored / "step-2")
    resumed = launch(base_args(tiny_model, root / "images", root / "resumed", *flags, "--resume_from_checkpoint",
                               "latest"), num_processes=2)
    return root, straight, resumed


def history(folder):
    return [json.loads(line) for line in (folder / "validation" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_every_validation_is_scored_logged_plotted_and_tabled(kept):
    root, straight, _ = kept
    entries = history(root / "straight")
    assert [(e["step"], e["tag"]) for e in entries] == [(0, "base"), (2, "step-000002"), (4, "step-000004"),
                                                        (6, "final")]
    assert all({"subject", "prompt", "drift"} <= e.keys() for e in entries)
    assert entries[0]["drift"] == pytest.approx(0, abs=1e-6)  # the base against itself: 0 up to rounding
    assert entries[-1]["images"] == ["final-0.png", "final-1.png", "final-2.png", "final-3.png"]
    assert entries[-1]["drift"] > 0  # the class prompt's images moved
    for e in entries[1:]:  # once each, by the main process
        assert straight.stderr.count(f"[RANK 0] validation metrics, step {e['step']}: subject {e['subject']:.3f}, "
                                     f"prompt {e['prompt']:.3f}, drift {e['drift']:.3f}") == 1
    assert "[RANK 1] validation metrics" not in straight.stderr
    with Image.open(root / "straight" / "validation" / "metrics.png") as plot:
        assert plot.size == (480, 240) and len(plot.getcolors(10000)) > 4
    card = (root / "straight" / "README.md").read_text()
    assert "| step | subject | prompt | drift |" in card and f"| 6 | {entries[-1]['subject']:.3f} |" in card


@pytest.mark.slow
def test_keep_best_keeps_the_scored_lora_bit_for_bit_and_survives_a_resume(kept):
    root, straight, resumed = kept
    entries = history(root / "straight")
    best = max(entries[1:], key=lambda e: e["subject"])
    assert f"best (subject): step {best['step']}, in {root / 'straight' / 'best'}" in straight.stderr
    scored = (root / "straight" / (f"checkpoint-{best['step']}" if best["tag"] != "final" else "") / LORA)
    kept_lora, reference = load_file(str(root / "straight" / "best" / LORA)), load_file(str(scored))
    assert kept_lora.keys() == reference.keys() and all(torch.equal(kept_lora[k], reference[k]) for k in kept_lora)
    assert sorted(p.name for p in (root / "straight" / "validation" / "scored").iterdir()) == [f"step-{best['step']}"]
    # the resumed run continues the same history and keeps the same LoRA
    assert history(root / "resumed") == entries
    again = load_file(str(root / "resumed" / "best" / LORA))
    assert all(torch.equal(again[k], kept_lora[k]) for k in kept_lora)
    assert "validation metrics, the base model" not in resumed.stderr  # its scores came with the history


@pytest.fixture(scope="module")
def places(tiny_model, scorers, tmp_path_factory):
    """What the refusals below point the flags at: images to train on, an empty folder, a folder whose only image is
    not one, a blank prompts file, the tiny model's transformer (a diffusers folder) and the two scoring models."""
    root = tmp_path_factory.mktemp("places")
    make_images(str(root / "images"))
    for folder in ("empty", "broken"):
        (root / folder).mkdir()
    (root / "broken" / "photo.png").write_text("not an image")
    (root / "blank.txt").write_text("\n  \n")
    (root / "drift.txt").write_text("a photo of dog\n")
    return {"IMAGES": root / "images", "EMPTY": root / "empty", "BROKEN": root / "broken", "BLANK": root / "blank.txt",
            "DRIFT": root / "drift.txt", "TRANSFORMER": Path(tiny_model, "transformer"), "DINO": scorers[0],
            "CLIP": scorers[1]}


SCORE = ["--validation_prompt", "a photo of sks dog", "--metrics_dino_model", "{DINO}", "--validation_metrics"]


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--validation_metrics", "dino,size"], "--validation_metrics dino,size: expected none, all, or some of"),
    (["--validation_metrics", "dino"], "--validation_metrics dino needs validation images"),  # as the user wrote it
    ([*SCORE, "drift"], "--validation_metrics drift: drift needs prompts without the subject"),
    ([*SCORE, "clip", "--keep_best", "subject"],
     "--validation_metrics clip lacks the scores --keep_best subject compares"),
    (["--keep_best", "subject"], "--keep_best has no effect without --validation_metrics"),
    # issue 52, items 4-6: read and checked before anything is written
    ([*SCORE, "dino", "--metrics_reference_dir", "{EMPTY}"],
     "--metrics_reference_dir {EMPTY}: expected a readable folder of images"),
    ([*SCORE, "dino", "--metrics_reference_dir", "{BROKEN}"], "--metrics_reference_dir {BROKEN}: cannot use 1 file(s)"),
    ([*SCORE, "dino", "--metrics_drift_prompts", "{BLANK}"], "--metrics_drift_prompts {BLANK}: no prompt in it"),
    ([*SCORE, "dino,drift", "--metrics_drift_prompts", "{BLANK}"], "--metrics_drift_prompts {BLANK}: no prompt in it"),
    ([*SCORE, "dino,drift", "--metrics_drift_prompts", "{DRIFT}", "--keep_best", "balanced", "--max_drift", "5"],
     "--max_drift 5: expected a number in [0, 2]"),
    ([*SCORE, "dino", "--metrics_dino_model", "{EMPTY}"],
     "--metrics_dino_model {EMPTY} holds no config.json; expected a DINOv2 or DINO ViT model"),
    ([*SCORE, "dino", "--metrics_dino_model", "{TRANSFORMER}"],
     "--metrics_dino_model {TRANSFORMER} holds Flux2Transformer2DModel; expected a DINOv2"),
    ([*SCORE, "all", "--metrics_clip_model", "{DINO}", "--metrics_drift_prompts", "{DRIFT}", "--metrics_dino_model",
      "{CLIP}"], "--metrics_dino_model {CLIP} holds a clip model; expected a DINOv2 or DINO ViT model"),
    ([*SCORE, "clip", "--metrics_clip_model", "{DINO}"],
     "--metrics_clip_model {DINO} holds a dinov2 model; expected a CLIP model"),
])
def test_bad_metric_flags_are_refused_before_anything_is_written(places, tiny_model, tmp_path, flags, message):
    """Exit 2 with one message naming the flag (and what the folder holds), before any model loads and before the
    output folder gets a file: a CLIP model given as the DINO one trained the whole run and died in the final scores."""
    flags, message = [f.format(**places) for f in flags], message.format(**places)
    proc = launch(base_args(tiny_model, places["IMAGES"], tmp_path / "out", *flags), check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "loading" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_max_drift_0_keeps_only_a_validation_that_did_not_drift(tmp_path):
    """--max_drift 0 is a limit, not "none" (the final drift's): balanced keeps a validation of drift 0, or none and
    says so."""
    (tmp_path / "drift.txt").write_text("a photo of dog\n")
    T.validate_args(T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", ".",
                                  "--instance_prompt", "a photo of sks dog", "--validation_prompt", "sks dog",
                                  "--validation_metrics", "dino,drift", "--metrics_drift_prompts",
                                  str(tmp_path / "drift.txt"), "--keep_best", "balanced", "--max_drift", "0"]))
    history = [{"step": 0, "tag": "base", "subject": 0.9, "drift": 0.0},  # never kept
               {"step": 2, "tag": "a", "subject": 0.5, "drift": 0.0},
               {"step": 4, "tag": "b", "subject": 0.7, "drift": 0.2},
               {"step": 6, "tag": "c", "subject": 0.6, "drift": 0.3}]
    assert T.best_entry(history, "balanced", 0.0)["step"] == 2 and T.may_be_kept(history, "balanced", 0.0) == {2}
    drifted = [e for e in history if e["step"] != 2]
    assert T.best_entry(drifted, "balanced", 0.0) is None and T.may_be_kept(drifted, "balanced", 0.0) == set()
    option = T.ValidationMetrics(argparse.Namespace(keep_best="balanced", max_drift=0.0, output_dir=str(tmp_path)))
    option.history = drifted
    assert option._keep(None, tmp_path / "validation", drifted[-1]) == ("; no validation within --max_drift 0.0, no "
                                                                        "best LoRA")


def test_a_manifest_run_scoring_the_subject_needs_reference_photos(tmp_path):
    """--from_manifest trains without the instance images, so the subject score has nothing to compare with: refused
    before anything loads (it crashed at the first validation, hours in), unless --metrics_reference_dir gives some."""
    manifest = tmp_path / "dataset_manifest.json"
    manifest.write_text("{}")
    flags = ["--pretrained_model_name_or_path", "m", "--from_manifest", str(manifest), "--cache_latents",
             "--validation_prompt", "a photo of sks dog", "--validation_metrics", "dino"]
    with pytest.raises(T.UsageError, match="--validation_metrics dino: no instance images to compare with: give "
                                           "--metrics_reference_dir"):
        T.validate_args(T.parse_args(flags))
    make_images(str(tmp_path / "photos"))
    T.validate_args(T.parse_args([*flags, "--metrics_reference_dir", str(tmp_path / "photos")]))


@pytest.mark.slow
def test_reference_photos_are_read_as_training_reads_images(scorers, tmp_path):
    """--metrics_reference_dir is scanned as an image folder (hidden files skipped, EXIF orientation applied), and its
    features computed when the scoring models load."""
    photos = tmp_path / "photos"
    photos.mkdir()
    upright = pictures(1, size=(40, 56))[0]
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated by 90 degrees
    upright.transpose(Image.Transpose.ROTATE_90).save(photos / "phone.jpg", exif=exif, quality=100)
    (photos / "._phone.jpg").write_bytes(b"macOS resource fork, not an image")
    args = argparse.Namespace(validation_metrics="dino", metrics_reference_dir=str(photos),
                              metrics_dino_model=scorers[0], metrics_clip_model=scorers[1], metrics_drift_prompts=None,
                              instance_prompt="a photo of sks dog", class_prompt=None)
    option = T.ValidationMetrics(args)
    option.setup(types.SimpleNamespace(data=None))
    with Image.open(photos / "phone.jpg") as stored:
        shown = ImageOps.exif_transpose(stored).convert("RGB")
    assert shown.size == (40, 56) and option.references.shape[0] == 1  # the resource fork is not a photo
    assert torch.equal(option.references, option.models.dino_features([shown], "cpu"))


def test_the_history_restarts_when_the_base_images_are_remade(tmp_path, monkeypatch):
    """Base images remade for another prompt, seed or model (validation/base.json changed): the step-0 entry and the
    scores measured against the old ones no longer describe this run's curves, so the history starts again."""
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", ".", "--instance_prompt",
                         "a photo of sks dog", "--validation_prompt", "a photo of sks dog", "--validation_metrics",
                         "dino"])
    option = T.ValidationMetrics(args)
    monkeypatch.setattr(T, "logger", types.SimpleNamespace(info=lambda *a, **k: None))
    monkeypatch.setattr(option, "_scores", lambda accelerator, rows, images, base: {"subject": 0.5})
    accelerator, spec = types.SimpleNamespace(log=lambda *a, **k: None), T.ValidationSpec("a photo of sks dog")
    Image.new("RGB", (16, 16)).save(tmp_path / "base-0.png")
    history = lambda: [(e["step"], e["tag"]) for e in map(json.loads,  # noqa: E731
                                                          (tmp_path / "metrics.jsonl").read_text().splitlines())]
    T.write_json_atomic(tmp_path / "base.json", {"specs": ["a photo of sks dog"], "seed": 1})
    for step in (1, 2):
        option.validated(accelerator, tmp_path, f"step-{step}", step, [spec], [1.0], [Image.new("RGB", (16, 16))])
    assert history() == [(0, "base"), (1, "step-1"), (2, "step-2")]  # the same base images: scored once
    T.write_json_atomic(tmp_path / "base.json", {"specs": ["a photo of sks dog"], "seed": 2})
    option.validated(accelerator, tmp_path, "step-3", 3, [spec], [1.0], [Image.new("RGB", (16, 16))])
    assert history() == [(0, "base"), (3, "step-3")]


@pytest.mark.slow
def test_a_scoring_model_that_cannot_be_found_is_refused_before_any_model_loads(tiny_model, scorers, dino_v1,
                                                                                 tmp_path):
    """A typo, or a Hub id an offline machine has not cached, failed with a traceback after precompute (the scoring
    models load at setup): the pre-flight check reads their configs."""
    dino, clip = scorers
    make_images(str(tmp_path / "images"))
    base = ["--pretrained_model_name_or_path", str(tiny_model), "--instance_data_dir", str(tmp_path / "images"),
            "--instance_prompt", "a photo of sks dog", "--validation_prompt", "a photo of sks dog",
            "--text_encoder_out_layers", "1", "2", "--validation_metrics", "all", "--class_prompt", "a photo of dog"]
    for good in (dino, dino_v1):  # DINOv2 and v1 (the paper's) both pass
        T.check_model_fit(T.parse_args([*base, "--metrics_dino_model", str(good), "--metrics_clip_model", str(clip)]))
    for which, missing in (("dino", "someone/no-such-dinov2"), ("clip", "someone/no-such-clip")):
        other = ["--metrics_clip_model", str(clip)] if which == "dino" else ["--metrics_dino_model", str(dino)]
        args = T.parse_args([*base, f"--metrics_{which}_model", missing, *other])
        with pytest.raises(T.UsageError, match=f"--metrics_{which}_model {missing}: cannot read its config"):
            T.check_model_fit(args)


OTHERS_READ = ["trigger_words", "class_images", "manifest", "validation_extras"]


def test_the_section_names_another_options_flag_only_on_a_line_marked_for_that_option():
    """A trimmed copy without an option has no message naming its flags: in this section, a string naming another
    option's flag sits on a line marked `# option: NAME` (deleted with that option)."""
    import io
    import tokenize

    from tests.test_parts import SOURCE, option_sections

    start, end = option_sections(SOURCE)["metrics"]
    lines = SOURCE.splitlines()[start:end]
    owner = {name: o.name for o in T.OPTIONS if o is not T.ValidationMetrics for names, _ in o.flags for name in names}
    named = []
    for token in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if token.type == tokenize.STRING:
            for k, text in enumerate(token.string.splitlines()):
                line = lines[token.start[0] - 1 + k]
                named += [(flag, line) for flag in re.findall(r"--\w+", text)
                          if flag in owner and not line.endswith(f"# option: {owner[flag]}")]
    assert named == []
    assert {o for o in OTHERS_READ if any(line.endswith(f"# option: {o}") for line in lines)} == set(OTHERS_READ) - {
        "manifest"}  # the manifest's runs have no instance images: refused without naming it


@pytest.mark.slow
@pytest.mark.parametrize("removed", OTHERS_READ)
def test_the_metrics_work_in_a_copy_without_an_option_they_read(removed, scorers, tmp_path):
    """The copy without the trigger words (or the class images, the manifest, the validation extras) keeps the
    metrics: no undefined name, the refusals name no flag it lacks, the drift prompts and the subject's rows are
    found, and the scores are computed."""
    from tests.test_parts import SOURCE, load, undefined_globals, without_options

    source = without_options(SOURCE, [removed])
    assert undefined_globals(source) == set()
    copy = load(source, "without_" + re.sub(r"\W", "_", removed))
    lacks = [name for o in T.OPTIONS if o.name == removed for names, _ in o.flags for name in names]
    make_images(str(tmp_path / "images"))
    (tmp_path / "drift.txt").write_text("a photo of dog\n")
    base = ["--pretrained_model_name_or_path", "m", "--instance_data_dir", str(tmp_path / "images"),
            "--instance_prompt", "a photo of sks dog"]
    with pytest.raises(copy.UsageError) as refused:  # the refusal that lists where drift prompts come from
        copy.validate_args(copy.parse_args([*base, "--validation_metrics", "drift", "--validation_prompt", "x"]))
    assert "drift needs prompts without the subject (--metrics_drift_prompts" in str(refused.value)
    assert not [name for name in lacks if name in str(refused.value)]
    args = copy.parse_args([*base, "--validation_metrics", "dino,clip,drift", "--metrics_drift_prompts",
                            str(tmp_path / "drift.txt"), "--validation_prompt", "sks dog in a bucket", "--keep_best",
                            "balanced"])
    copy.validate_args(args)
    option = copy.ValidationMetrics(args)
    option.models = copy.MetricModels(*scorers)
    option.references = option.models.dino_features(pictures(2, seed=1), "cpu")
    rows = [("sks dog in a bucket", 0), ("a red square", 1), ("a photo of dog", 2)]
    assert option.others == ["a photo of dog"] and [s.prompt for s in option.validation_specs()] == option.others
    scores = option._scores(types.SimpleNamespace(device="cpu"), rows, dict(enumerate(pictures(3))),
                            dict(enumerate(pictures(3, seed=2))))
    features = option.models.dino_features
    assert scores["subject"] == pytest.approx(T.subject_score(features(pictures(3)[:1], "cpu"), option.references))
    assert scores.keys() == {"subject", "prompt", "drift"} and 0 < scores["drift"] <= 2


def test_a_metrics_runs_config_yaml_repeats_it(tmp_path):
    """config.yaml records --validation_metrics as written (it recorded the score names, subject,drift, which --config
    then refused), and `none` turns the option off."""
    import yaml

    flags = ["--pretrained_model_name_or_path", "m", "--instance_data_dir", ".", "--instance_prompt",
             "a photo of sks dog", "--validation_prompt", "a photo of sks dog", "--validation_metrics", "dino,drift"]
    config = T.resolved_config(T.parse_args(flags), 0, types.SimpleNamespace(mixed_precision="no"))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    again = T.parse_args(["--config", str(tmp_path / "config.yaml")])
    assert again.validation_metrics == "dino,drift" and T.ValidationMetrics(again).names == ("subject", "drift")
    assert not T.ValidationMetrics.wanted(T.parse_args([*flags[:-1], "none"]))
