"""Several folders (--datasets, issue 53): each entry a folder (or a `datasets` source) with its own prompt for images
without a caption, repeats, trigger word and caption dropout; the one-folder flags give what an entry leaves out.

- The samples of an epoch go in passes (pass p: the images repeated more than p), so one --repeats for all keeps the
  one-folder order; each row shows its folder's prompt and drops its caption at its folder's rate; each folder's
  trigger word fills its own captions and prompt.
- Runs: two folders with repeats 2 and 1 show each image that many times an epoch, and the log and the model card list
  them; a run resumed from a checkpoint equals the straight one (the entries from a config file's datasets: list);
  --from_manifest replays a folders run from the cache alone.
- Bad entries (a missing folder, repeats 0, an unknown key, one image in two entries, ...) exit 2 naming the entry,
  before any model loads.
"""

import collections
import dataclasses
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import ROOT, base_args, launch
from tests.test_cache import _sourceless
from tests.tiny_flux2 import make_images

LORA = T.LORA_WEIGHTS_NAME


def _record(name, folder=None, caption=None):
    return T.ImageRecord(name=name, size=(40, 40), caption=caption, sha256=f"{name:0>64}", folder=folder)


def _two_folders(root):
    """make_images' six images split in two folders: A (img_00-02, img_02 without a caption), B (img_03-05)."""
    make_images(str(root / "all"))
    for name, numbers in (("A", (0, 1, 2)), ("B", (3, 4, 5))):
        (root / name).mkdir()
        for path in (root / "all").glob("img_*"):
            if int(path.stem[4:6]) in numbers:
                shutil.copy(path, root / name / path.name)
    return root / "A", root / "B"


def _args(model, out, entries, *extra):
    """A tiny run's flags with --datasets `entries` (a list: JSON on the command line; a path: a config file) in
    place of --instance_data_dir."""
    source = ["--config", str(entries)] if not isinstance(entries, list) else ["--datasets", json.dumps(entries)]
    args = base_args(model, "unused", out, *source, *extra)
    i = args.index("--instance_data_dir")
    return args[:i] + args[i + 2:]


def _sample_log(out):
    return [json.loads(line) for line in (out / "logs" / "samples-0.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------- the pure pieces


def test_samples_go_in_passes_and_one_repeats_for_all_keeps_the_one_folder_order():
    plain = [_record(n) for n in "abc"]
    for repeats, ladders in ((1, 1), (3, 1), (2, 3)):  # the order before folders: image i % I at ladder (i // I) % R
        assert T.sample_images(plain, repeats, ladders) == [(i % 3, i // 3 % ladders)
                                                             for i in range(3 * repeats * ladders)]
    twice, once = T.Folder("A", "p", 2, 0.0), T.Folder("B", "q", 1, 0.0)
    mixed = [_record("a", twice), _record("b", once), _record("c", twice)]
    # pass 0: every image at each ladder; pass 1: the images repeated twice
    assert T.sample_images(mixed, 1, 2) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                            (0, 0), (2, 0), (0, 1), (2, 1)]
    assert T.sample_images([_record(n, twice) for n in "abc"], 1, 2) == T.sample_images(plain, 2, 2)


def test_each_row_shows_its_folders_prompt_and_drops_its_caption_at_its_folders_rate():
    dogs, cats = T.Folder("dogs", "a photo of sks dog", 2, 1.0), T.Folder("cats", "a photo of a cat", 1, 0.0)
    records = [_record("d0", dogs), _record("d1", dogs, "a sks dog on grass"), _record("c0", cats)]
    ds = T.DreamBoothDataset(records, "the run's prompt", [(32, 32)], seed=0, with_pixels=False, fixed_crops=True)
    assert ds.num_samples == 5
    assert collections.Counter(records[ds.source(s)[1]].name for s in range(5)) == {"d0": 2, "d1": 2, "c0": 1}
    assert [ds.prompt_keys(s) for s in range(3)] == [["a photo of sks dog"], ["a sks dog on grass"],
                                                     ["a photo of a cat"]]
    codes = {"a photo of sks dog": 1.0, "a sks dog on grass": 2.0, "a photo of a cat": 3.0, "": 4.0}
    prompts, latents = T.SampleCache(), T.SampleCache()
    for text, code in codes.items():
        prompts.put(text, torch.full((1, 2, 2), code))
    for key in ds.cached_latent_keys():
        latents.put(key, torch.zeros(1, 4, 2, 2))
    # --caption_dropout 0.5 is each entry's default only: the dogs' rows (1.0) drop, the cat's (0.0) never does
    for seed in range(4):
        inputs = T.gather_inputs({"indices": [0, 2, 1], "epoch": 0}, ds, T.Caches(prompts, latents), 0.5,
                                 random.Random(seed))
        assert inputs.embeds[inputs.embed_rows][:, 0, 0].tolist() == [4.0, 3.0, 4.0]


def test_each_folder_fills_its_own_trigger_word_and_the_command_lines_fills_the_others(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    entries = [{"folder": str(tmp_path / "a"), "trigger_word": "ohwx", "prompt": "[trigger] in a hat"},
               {"folder": str(tmp_path / "b")}]
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--trigger_word", "sks", "--instance_prompt",
                         "a photo of [trigger]", "--datasets", json.dumps(entries)])
    own = T.Folder(str(tmp_path / "a"), "[trigger] in a hat", 1, 0.0, "ohwx")
    given = T.Folder(str(tmp_path / "b"), "a photo of [trigger]", 1, 0.0, "sks")
    records = [_record("a/x", own, "[trigger] on grass"), _record("a/y", own), _record("b/z", given, "a dog\nthe sks")]
    filled = T.Folders(args).images(records)
    assert [r.caption for r in filled] == ["ohwx on grass", None, "sks, a dog\nthe sks"]
    assert [r.folder.prompt for r in filled] == ["ohwx in a hat", "ohwx in a hat", "a photo of sks"]
    assert T.TriggerWords(args).images(records) == records  # --trigger_word leaves a folders run to the folders
    lacking = [_record("a/y", dataclasses.replace(own, prompt="a hat"))]
    with pytest.raises(T.UsageError, match=r"--datasets entry 1 \(.*a\) trigger_word ohwx: --datasets entry 1 .* "
                                           r"prompt 'a hat', the prompt of 1 image\(s\) without a caption"):
        T.Folders(args).images(lacking)


def test_an_entry_may_name_a_datasets_source_beside_a_folder(tmp_path, monkeypatch):
    from accelerate import Accelerator

    from tests.test_inputs import _dataset_folder

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    a, _ = _two_folders(tmp_path)
    rows = _dataset_folder(tmp_path / "rows", [("p.png", None), ("q.png", None)])
    entries = [{"folder": str(a)}, {"dataset": str(rows), "caption_column": "text", "repeats": 3}]
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "a dog", "--cache_dir",
                         str(tmp_path / "hf"), "--datasets", json.dumps(entries)])
    records = T.Folders(args).load_images(T.MemoryCache(), Accelerator(cpu=True))
    assert [(r.name, r.caption, r.folder.repeats, r.folder.prompt) for r in records] == [
        (f"{a}/img_00.png", "a photo of sks dog on a red sofa", 1, "a dog"),
        (f"{a}/img_01.jpg", "a photo of sks dog running across a green park", 1, "a dog"),
        (f"{a}/img_02.png", None, 1, "a dog"), (f"{rows}[0]", "dog p.png", 3, "a dog"),
        (f"{rows}[1]", "dog q.png", 3, "a dog")]


def test_a_config_files_datasets_list_is_the_flag_and_the_resolved_config_reads_back(tmp_path):
    (tmp_path / "a").mkdir()
    entries = [{"folder": str(tmp_path / "a"), "repeats": 3, "prompt": "a photo of sks dog", "caption_dropout": 0.2}]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"pretrained_model_name_or_path": "m", "datasets": entries}))
    args = T.parse_args(["--config", str(tmp_path / "run.yaml")])
    assert args.datasets == entries
    resolved = T.resolved_config(args, 0, type("Accelerator", (), {"mixed_precision": "no"}))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(resolved))
    assert T.parse_args(["--config", str(tmp_path / "config.yaml")]).datasets == entries


def test_the_readmes_several_folders_example_is_a_config_file_that_parses(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    example = re.search(r"\*\*Several folders\*\*.*?```yaml\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    for entry in yaml.safe_load(example)["datasets"]:
        Path(entry["folder"]).mkdir(parents=True)
    Path("run.yaml").write_text(example)
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--config", "run.yaml"])
    assert [e["folder"] for e in args.datasets] == ["dog/studio", "dog/outdoors", "dog/costumes"]


# ---------------------------------------------------------------------------------------------------- bad entries


@pytest.mark.parametrize("entry, message", [
    ({"folder": "MISSING"}, "--datasets entry 2 (MISSING): folder 'MISSING': expected an existing, readable folder"),
    ({"folder": "A", "repeats": 0}, "--datasets entry 2 (A): repeats 0: expected an integer >= 1"),
    ({"folder": "A", "repeat": 2}, "--datasets entry 2 (A): unknown key ['repeat'] (an entry holds folder, "),
    ({"folder": "A", "caption_dropout": 1.5}, "--datasets entry 2 (A): caption_dropout 1.5: expected a number in "
                                              "[0, 1]"),
    ({"prompt": "a dog"}, "--datasets entry 2 (no folder): name its folder (or dataset)"),
    ({"folder": "A", "prompt": ""}, "--datasets entry 2 (A): prompt '': expected text"),
    ({"folder": "A", "trigger_word": "sks "}, "--datasets entry 2 (A): trigger_word 'sks ': expected a word or words"),
])
def test_a_bad_entry_is_refused_naming_it(entry, message, tmp_path):
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    entry = {k: str(tmp_path / v) if k == "folder" else v for k, v in entry.items()}
    with pytest.raises(T.UsageError) as refused:
        T.parse_args(["--pretrained_model_name_or_path", "m", "--datasets",
                      json.dumps([{"folder": str(tmp_path / "B")}, entry])])
    assert message.replace("MISSING", str(tmp_path / "MISSING")).replace("(A)", f"({tmp_path / 'A'})") in str(
        refused.value)


@pytest.mark.parametrize("extra, message", [
    (["--instance_data_dir", "A"], "give exactly one of --instance_data_dir or --datasets"),
    (["--with_prior_preservation", "--class_prompt", "a dog", "--class_data_dir", "A"],
     "--class_data_dir is a folder of --datasets"),
    (["--trigger_word", "sks", "--output_preservation", "--class_word", "dog"],
     "--output_preservation replaces --trigger_word in every caption"),
    (["--cond_data_dir", "B"], "--cond_data_dir pairs with --instance_data_dir"),
])
def test_a_flag_that_does_not_combine_with_the_entries_is_refused(extra, message, tmp_path):
    for name in "AB":
        (tmp_path / name).mkdir()
    entries = [{"folder": str(tmp_path / "A"), "trigger_word": "ohwx"}, {"folder": str(tmp_path / "B")}]
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--output_dir", str(tmp_path / "out"),
                         "--datasets", json.dumps(entries), *(str(tmp_path / e) if e in "AB" else e for e in extra)])
    with pytest.raises(T.UsageError, match=message.replace("(", r"\(")):
        T.validate_args(args)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing folder", "repeats 0", "unknown key", "an image in two entries"])
def test_a_bad_entry_exits_2_naming_it_before_any_model_loads(case, tmp_path):
    a, b = _two_folders(tmp_path)
    second = {"missing folder": {"folder": str(tmp_path / "C")}, "repeats 0": {"folder": str(b), "repeats": 0},
              "unknown key": {"folder": str(b), "weight": 2},
              "an image in two entries": {"folder": str(tmp_path / "all")}}  # all holds A's images too
    out = tmp_path / "out"
    proc = launch(_args("nobody/no-such-model", out, [{"folder": str(a)}, second[case]]), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = {"missing folder": f"--datasets entry 2 ({tmp_path / 'C'}): folder", "repeats 0": "repeats 0: expected",
            "unknown key": "unknown key ['weight']",
            "an image in two entries": f"{tmp_path / 'all'}/img_00.png is entry 1's {a}/img_00.png (the same image)"}
    said = said[case]
    assert f"--datasets entry 2 (" in proc.stderr and said in proc.stderr, proc.stderr[-3000:]
    assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------------------------------------------------ runs


def test_two_folders_with_repeats_2_and_1_show_each_image_that_often_an_epoch(tiny_model, tmp_path):
    """Folder A (3 images) twice, B (3 images) once: 9 samples an epoch, every one seen once in the epoch's 9 batches;
    the log and the model card list each folder with its images, repeats and prompt."""
    a, b = _two_folders(tmp_path)
    entries = [{"folder": str(a), "repeats": 2, "prompt": "a photo of ohwx dog"}, {"folder": str(b)}]
    out = tmp_path / "out"
    proc = launch(_args(tiny_model, out, entries, "--max_train_steps", "9"))
    assert "9 samples, 9 batches of 1 per epoch" in proc.stderr
    for listed in (f"- `{a}`: 3 images, repeats 2, prompt `a photo of ohwx dog`",
                   f"- `{b}`: 3 images, repeats 1, prompt `a photo of sks dog`"):
        assert listed in proc.stderr and listed in (out / "README.md").read_text()
    epoch = [i for line in _sample_log(out) if line["epoch"] == 0 for i in line["indices"]]
    assert sorted(epoch) == list(range(9))
    records = [dataclasses.replace(r, folder=T.Folder(str(folder), None, repeats, 0.0)) for folder, repeats in
               ((a, 2), (b, 1)) for r in T.scan_image_folder(folder)]
    pairs = T.sample_images(records, 1, 1)
    shown = collections.Counter(records[pairs[i][0]].name for i in epoch)
    assert shown == {"img_00.png": 2, "img_01.jpg": 2, "img_02.png": 2, "img_03.png": 1, "img_04.jpg": 1,
                     "img_05.png": 1}
    manifest = json.loads((out / T.MANIFEST_NAME).read_text())
    assert [(r["name"], r["folder"]["repeats"]) for r in manifest["instances"]][::3] == [
        (f"{a}/img_00.png", 2), (f"{b}/img_03.png", 1)]


@pytest.mark.slow
def test_a_resumed_two_folder_run_equals_a_straight_one(tiny_model, tmp_path):
    """The entries from a config file: A twice with its own trigger word and caption dropout, B once with the
    command line's; 9 batches an epoch, accumulation 2, a checkpoint at step 2: the resumed LoRA is the straight one
    bit for bit, and it trains the batches the straight run trained after step 2."""
    a, b = _two_folders(tmp_path)
    entries = [{"folder": str(a), "repeats": 2, "trigger_word": "ohwx", "prompt": "[trigger] dog",
                "caption_dropout": 0.5}, {"folder": str(b), "prompt": "a photo of a dog"}]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"datasets": entries, "caption_dropout": 0.2}))
    common = ["--gradient_accumulation_steps", "2", "--max_train_steps", "6", "--checkpointing_steps", "2",
              "--random_flip", "--lora_dropout", "0.1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch(_args(tiny_model, straight, tmp_path / "run.yaml", *common))
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    proc = launch(_args(tiny_model, resumed, tmp_path / "run.yaml", *common, "--resume_from_checkpoint", "latest"))
    assert "resumed from" in proc.stderr and "checkpoint-2" in proc.stderr
    x, y = load_file(str(straight / LORA)), load_file(str(resumed / LORA))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert _sample_log(resumed) == _sample_log(straight)[4:]
    assert {line["epoch"] for line in _sample_log(straight)} == {0, 1}


@pytest.mark.slow
def test_from_manifest_replays_a_folders_run_from_the_cache_alone(tiny_model, tmp_path, own_cache_folder):
    """Only B drops captions (the empty prompt is in the cache for it alone); the replay, the images deleted, trains
    the same LoRA: each record carries its folder's prompt, repeats and caption dropout in the manifest. The empty
    prompt is among the entries the replay needs: gone from the cache, it is refused before training."""
    a, b = _two_folders(tmp_path)
    entries = [{"folder": str(a), "repeats": 2, "prompt": "a photo of ohwx dog"},
               {"folder": str(b), "caption_dropout": 0.7}]
    common = ["--max_train_steps", "4", "--cache_latents"]
    first = tmp_path / "first"
    launch(_args(tiny_model, first, entries, *common))
    for folder in (a, b, tmp_path / "all"):
        shutil.rmtree(folder)
    args = _sourceless(base_args(tiny_model, a, tmp_path / "second", *common), first / T.MANIFEST_NAME)
    proc = launch(args)
    assert "6 instance images and 0 more" in proc.stderr and "9 samples" in proc.stderr
    x, y = load_file(str(first / LORA)), load_file(str(tmp_path / "second" / LORA))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    prompts = json.loads((first / T.MANIFEST_NAME).read_text())["entries"]["prompts"]
    (own_cache_folder / next(e["entry"] for e in prompts if e["text"] == "")).unlink()
    refused = launch([*args[:args.index("--output_dir") + 1], str(tmp_path / "third"),
                      *args[args.index("--output_dir") + 2:]], check=False)
    assert refused.returncode == 2 and "(from prompt '')" in refused.stderr, refused.stderr[-3000:]
