"""Data and regularisation: caption alternatives drawn per (seed, epoch, sample), --trigger_word, output preservation
(DOP: the adapted model's prediction for the class prompt trained toward the base model's), several resolutions
of each image, and a quantised text encoder for precompute. The preservation proof (does it keep the class?) is in
tests/test_preservation.py."""

import json
import random
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch, step_generator, step_loss
from tests.tiny_flux2 import MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS


def _record(name, caption=None, size=(32, 32)):
    return T.ImageRecord(name=name, size=size, caption=caption, path=name)


# ---------------------------------------------------------------------------------------------------------------
# Caption alternatives


def test_each_caption_line_is_an_alternative_drawn_per_seed_epoch_and_sample():
    assert T.caption_lines(" a dog\n\n  a sks dog on grass \r\n") == ["a dog", "a sks dog on grass"]
    assert T.caption_lines(None) == [] and T.caption_lines("one") == ["one"]
    records = [_record("a", "first a\nsecond a\nthird a"), _record("b", "only b"), _record("c")]
    ds = T.DreamBoothDataset(records, "a photo of sks", [(32, 32)], repeats=2, seed=3, with_pixels=False)
    assert ds.prompt_keys(0) == ["first a", "second a", "third a"] and ds.prompt_keys(4) == ["only b"]
    assert ds.prompt_keys(2) == ["a photo of sks"]
    draws = [[ds.prompt_key(s, e) for s in range(len(ds))] for e in range(12)]
    again = T.DreamBoothDataset(records, "a photo of sks", [(32, 32)], repeats=2, seed=3, with_pixels=False)
    assert draws == [[again.prompt_key(s, e) for s in range(len(again))] for e in range(12)]  # a resume repeats
    for slot in (0, 3):  # image a, both repeats: every alternative comes up, not the same one every epoch
        assert {d[slot] for d in draws} == {"first a", "second a", "third a"}
    assert [d[0] for d in draws] != [d[3] for d in draws]  # the repeats draw independently
    other_seed = T.DreamBoothDataset(records, "a photo of sks", [(32, 32)], repeats=2, seed=4, with_pixels=False)
    assert [other_seed.prompt_key(0, e) for e in range(12)] != [d[0] for d in draws]
    assert all(d[1] == "only b" and d[2] == "a photo of sks" for d in draws)
    args = SimpleNamespace(caption_dropout=0.0, output_preservation=False, validation_prompt=None,
                           final_validation_prompt=None, validation_prompts_file=None, trigger_word=None,
                           validation_guidance_scale=1.0)
    data = SimpleNamespace(dataset=ds, hooks=T.Hooks(args), specs=(), family=SimpleNamespace(pipeline="Flux2Pipeline"))
    assert set(T.needed_prompts(args, data)) == {
        "first a", "second a", "third a", "only b", "a photo of sks"}


def test_the_step_reads_the_embedding_of_the_alternative_drawn_for_its_epoch():
    records = [_record("a", "left\nright")]
    ds = T.DreamBoothDataset(records, None, [(32, 32)], repeats=4, seed=0, with_pixels=False)
    prompts = T.SampleCache()
    prompts.put("left", torch.zeros(1, 2, 3))
    prompts.put("right", torch.ones(1, 2, 3))
    caches = T.Caches(prompts, T.SampleCache(), None)
    for key in ds.cached_latent_keys():
        caches.latents.put(key, torch.zeros(1, 4, 2, 2))
    for epoch in range(6):
        batch = {"indices": [0, 1, 2, 3], "epoch": epoch}
        inputs = T.gather_inputs(batch, ds, caches, 0.0, random.Random(0))
        got = inputs.embeds[inputs.embed_rows][:, 0, 0].tolist()
        assert got == [float(ds.prompt_key(s, epoch) == "right") for s in range(4)]


def test_a_list_valued_caption_column_gives_alternatives_and_a_text_cell_one_caption(tmp_path, monkeypatch):
    """A list's entries are alternatives; a text cell is one caption however many lines it has (an LLM captioner's
    paragraphs), never alternatives as a caption file's lines are; a cell that is not text is refused, naming it."""
    pytest.importorskip("datasets")
    import datasets
    from datasets import Dataset

    red = Image.new("RGB", (32, 32), "red")
    Dataset.from_dict({"image": [red] * 2, "text": [["a red square", "", "crimson"], ["a red\nsquare", "crimson"]]}
                      ).save_to_disk(str(tmp_path / "lists"))
    Dataset.from_dict({"image": [red] * 2, "label": [0, 1], "text": ["a red square,\n\n  flat colour\n", "red"]}
                      ).save_to_disk(str(tmp_path / "texts"))
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, cache_dir=None: {
        "train": datasets.load_from_disk(name)})
    lists, texts = (T.load_hf_dataset(str(tmp_path / name), None, "image", "text", None) for name in ("lists", "texts"))
    assert [T.caption_lines(r.caption) for r in lists + texts] == [
        ["a red square", "crimson"], ["a red square", "crimson"], ["a red square, flat colour"], ["red"]]
    with pytest.raises(T.UsageError, match=r"--caption_column 'label': row 0 holds int, not text \(feature Value"):
        T.load_hf_dataset(str(tmp_path / "texts"), None, "image", "label", None)
    with pytest.raises(T.UsageError, match=r"--caption_column 'image': row 0 holds \w*ImageFile, not text"):
        T.load_hf_dataset(str(tmp_path / "texts"), None, "image", "image", None)


# ---------------------------------------------------------------------------------------------------------------
# --trigger_word


def _trigger_args(word, instance_prompt="a photo of [trigger] dog", **extra):
    return SimpleNamespace(trigger_word=word, instance_prompt=instance_prompt, **extra)


def apply_trigger(args, records):
    """What prepare_data does with the trigger option: the prompt flags filled, then the captions."""
    option = T.TriggerWords(args)
    option.resolve(None)
    return option.images(records)


def test_trigger_word_fills_the_placeholder_and_goes_before_captions_that_lack_it():
    records = [_record("a", "[trigger] on a sofa\na dog, sks style\nasks nothing"), _record("b")]
    args = _trigger_args("sks")
    out = apply_trigger(args, records)
    assert T.caption_lines(out[0].caption) == ["sks on a sofa", "a dog, sks style", "sks, asks nothing"]
    assert out[1].caption is None and args.instance_prompt == "a photo of sks dog"
    assert apply_trigger(args, out) == out  # idempotent: a --from_manifest run applies it to applied captions


def test_trigger_word_problems_are_refused_naming_the_images_or_flag():
    with pytest.raises(T.UsageError, match=r"\[trigger\] in the captions of a: give --trigger_word"):
        apply_trigger(_trigger_args(None, "p"), [_record("a", "[trigger] dog"), _record("b", "dog")])
    with pytest.raises(T.UsageError, match=r"--instance_prompt 'a photo of a dog'.*1 image\(s\) without a caption \(b\)"):
        apply_trigger(_trigger_args("sks", "a photo of a dog"), [_record("a", "dog"), _record("b")])
    # every image captioned: the instance prompt is unused, so it need not name the subject
    assert apply_trigger(_trigger_args("sks", "a photo of a dog"), [_record("a", "dog")])[0].caption == "sks, dog"


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["--instance_prompt", "a [trigger] dog"], r"\[trigger\] in --instance_prompt: give --trigger_word"),
    (["--class_word", "dog"], "--class_word is the word --output_preservation"),
    # --trigger_word turns the option on, which kept the generic stray-flag refusal quiet: the weight was ignored
    (["--trigger_word", "sks", "--output_preservation_weight", "0.5"],
     "--output_preservation_weight has no effect without --output_preservation"),
    (["--output_preservation_weight", "0.5"], "--output_preservation_weight has no effect without"),
    (["--output_preservation", "--trigger_word", "sks"], "--output_preservation needs --trigger_word and --class_word"),
    (["--output_preservation", "--trigger_word", "sks", "--class_word", "dog", "--with_prior_preservation",
      "--class_prompt", "a dog", "--class_data_dir", "c"], "two ways to the same end"),
    (["--output_preservation", "--trigger_word", "sks", "--class_word", "dog", "--compile"], "--compile"),
    (["--output_preservation", "--trigger_word", "sks", "--class_word", "sks dog"], "contains --trigger_word"),
    (["--text_encoder_quantization", "nf4"], "nf4 needs a CUDA GPU"),
    (["--text_encoder_quantization", "int8", "--remote_text_encoder", "--hub_token", "x"], "leave out --remote_text_encoder"),
    (["--resolution", "512,512"], "--resolution 512,512: expected sides from 16 to 4096"),
    (["--resolution", "512,100"], "expected sides from 16 to 4096"),
])
def test_flag_combinations_are_refused_before_anything_loads(extra, message, tmp_path):
    proc = launch(["--pretrained_model_name_or_path", "nobody/no-model", "--instance_data_dir", str(tmp_path),
                   "--output_dir", str(tmp_path / "out"), "--instance_prompt", "a sks dog", *extra], check=False)
    assert proc.returncode == 2 and re.search(message, proc.stderr), proc.stderr[-1500:]
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error:")]) == 1


def test_trigger_fills_validation_prompts_and_the_file(tmp_path):
    listed = tmp_path / "prompts.txt"
    listed.write_text("[trigger] at the beach --seed 3\na plain prompt\n")
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", ".", "--instance_prompt",
                         "a [trigger] dog", "--trigger_word", "sks", "--validation_prompt", "a [trigger] dog, oil",
                         "--validation_prompts_file", str(listed)])
    hooks = T.Hooks(args)
    hooks.each("check")
    hooks.each("resolve", None)
    assert args.instance_prompt == "a sks dog"
    data = SimpleNamespace(specs=T.option_validation_specs(hooks))
    assert T.validation_prompts(args, data) == ["a sks dog, oil", "sks at the beach", "a plain prompt"]
    assert [s.prompt for s in T.validation_specs(args, data)] == T.validation_prompts(args, data)


# ---------------------------------------------------------------------------------------------------------------
# Output preservation: the step


def test_preservation_text_replaces_the_word_only():
    assert T.preservation_text("sks, a sks dog near asks", "sks", "dog") == "dog, a dog dog near asks"
    assert T.preservation_text("a photo of sks", "sks", r"dog\1") == r"a photo of dog\1"


@pytest.fixture(scope="module")
def adapted(tiny_model):
    """The tiny transformer with a LoRA whose B is drawn (a fresh B is zero: adapted and base would agree)."""
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig

    transformer = Flux2Transformer2DModel.from_pretrained(tiny_model, subfolder="transformer")
    T.add_lora(transformer, LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    g = torch.Generator().manual_seed(0)
    for name, param in transformer.named_parameters():
        if "lora_B" in name:
            param.data = 0.3 * torch.randn(param.shape, generator=g)
    return transformer


def _step(transformer, preserve, weight=0.7, seed=0):
    latents = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    embeds = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    sigmas = torch.linspace(1, 0.001, 1000)
    loss = step_loss(transformer, latents, embeds, sigmas, seed=seed, preserve=preserve,
                     output_preservation_weight=weight)
    return loss, latents, embeds, sigmas


def test_preservation_adds_the_weighted_distance_between_adapted_and_base_predictions_on_the_same_noise(adapted):
    from diffusers import Flux2Pipeline

    preserve = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    loss, latents, embeds, sigmas = _step(adapted, preserve, weight=1000.0)  # large: a clear difference
    plain = _step(adapted, None)[0]
    # the same draws by hand: noise and sigma first from the step's generator, as training_step takes them
    g = step_generator(0)
    noise = torch.randn(latents.shape, generator=g)
    sigma = T.sample_sigmas(sigmas, 2, "none", 0.0, 1.0, 1.29, g)
    noisy = Flux2Pipeline._pack_latents((1 - sigma.view(-1, 1, 1, 1)) * latents + sigma.view(-1, 1, 1, 1) * noise)
    call = dict(hidden_states=noisy, timestep=sigma, guidance=torch.full((2,), 3.5), encoder_hidden_states=preserve,
                txt_ids=Flux2Pipeline._prepare_text_ids(preserve), img_ids=Flux2Pipeline._prepare_latent_ids(latents),
                return_dict=False)
    with torch.no_grad():
        trained = adapted(**call)[0]
        with T.adapters_off(adapted):
            base = adapted(**call)[0]
    assert (trained - base).abs().max() > 1e-3  # the LoRA changes the prediction: the term measures something
    torch.testing.assert_close(loss - plain, 1000 * (trained - base).pow(2).mean(), rtol=1e-3, atol=0)
    torch.testing.assert_close(_step(adapted, preserve, weight=0.0)[0], plain)  # (more rows: rounding differs)


def test_preservation_trains_the_adapted_prediction_only_and_leaves_the_adapters_on(adapted):
    preserve = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    adapted.zero_grad()
    loss = _step(adapted, preserve, weight=1.0)[0] - _step(adapted, None)[0]  # the preservation term alone
    loss.backward()
    grads = [p.grad for n, p in adapted.named_parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    assert all(not m.disable_adapters for m in adapted.modules() if hasattr(m, "disable_adapters")
               and isinstance(m.disable_adapters, bool))
    adapted.zero_grad()


# ---------------------------------------------------------------------------------------------------------------
# Several resolutions


def test_each_image_is_a_sample_at_each_resolution_with_its_own_buckets():
    records = [_record("wide", size=(96, 48)), _record("tall", size=(40, 80)), _record("square", size=(64, 64))]
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--resolution", "32,64", "--use_aspect_ratio_buckets"])
    assert args.resolution == 64 and args.resolutions == (32, 64)
    ladders = T.resolve_buckets(args)
    assert ladders == [T.bucket_ladder(32), T.bucket_ladder(64)]
    ds = T.DreamBoothDataset(records, "p", ladders, repeats=2, seed=0, with_pixels=False, center_crop=True)
    assert len(ds) == 3 * 2 * 2
    for i in range(len(ds)):
        kind, image, bucket, *_ = ds.latent_key(i, 0)
        record, ladder = records[i % 3], ladders[(i // 3) % 2]
        assert image == i % 3 and bucket == ladder[T.nearest_bucket(record.size[1], record.size[0], ladder)]
        assert ds.buckets[ds.sample_buckets()[i][0]] == bucket  # the sampler groups by the same bucket
    # each (image, resolution) pair is a sample `repeats` times; the cache holds each pair's latents once
    assert len({ds.latent_key(i, 0)[:3] for i in range(len(ds))}) == 6
    assert len(set(ds.cached_latent_keys())) == 6


def test_one_resolution_is_todays_dataset_and_mismatched_bucket_lists_are_refused():
    records = [_record("wide", size=(96, 48)), _record("tall", size=(40, 80))]
    one = T.DreamBoothDataset(records, "p", T.bucket_ladder(32), repeats=3, seed=0, with_pixels=False)
    assert one.buckets == T.bucket_ladder(32) and len(one) == 6
    assert [one.latent_key(i, 1) for i in range(6)] == [one.latent_key(i, 1) for i in range(6)]
    assert one.sample_buckets() == [(T.nearest_bucket(r.size[1], r.size[0], one.buckets), 0) for r in records] * 3
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--resolution", "32,64", "--aspect_ratio_buckets",
                         "32,32;32,48"])
    with pytest.raises(T.UsageError, match="1 bucket list.*2 --resolution side"):
        T.resolve_buckets(args)
    args.aspect_ratio_buckets = "32,32;32,48|64,64"
    assert T.resolve_buckets(args) == [[(32, 32), (32, 48)], [(64, 64)]]


# ---------------------------------------------------------------------------------------------------------------
# A quantised text encoder


def test_int8_text_encoder_embeddings_are_close_to_full_precision_and_cached_apart(tiny_model, capsys):
    import transformers

    load = lambda **kw: transformers.Mistral3ForConditionalGeneration.from_pretrained(  # noqa: E731
        tiny_model, subfolder="text_encoder", torch_dtype=torch.float32, **kw)
    tokenizer = T.load_pipeline_tokenizer(T.parse_args(["--pretrained_model_name_or_path", str(tiny_model)]))
    family = T.detect_family(SimpleNamespace(pretrained_model_name_or_path=str(tiny_model), revision=None,
                                             cache_dir=None))
    prompts = ["a photo of sks dog", "a red car at night, rain on the road"]
    full_model = load().eval()
    int8 = T.TextEncoders(T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--text_encoder_quantization",
                                         "int8"]))
    quantized = int8.text_encoder(load, SimpleNamespace(device=torch.device("cpu")), torch.float32)
    assert any("Int8" in type(m.weight).__name__ or "AffineQuantized" in type(m.weight).__name__
               for m in quantized.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad():
        full, int8 = (T.encode_prompts(family, m, tokenizer, prompts, MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS)
                      for m in (full_model, quantized))
    relative = ((int8 - full).norm() / full.norm()).item()
    with capsys.disabled():
        print(f"\nint8 text encoder: relative embedding difference {relative:.4f} (tiny random Mistral)")
    assert 0 < relative < 0.05
    args = T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--text_encoder_out_layers", "1", "2"])
    plain = T.cache_identity(args, torch.float32, family).prompts
    args.text_encoder_quantization = "int8"
    identity = T.TextEncoders(args).cache_identity(torch.float32, family)
    assert identity.prompts == plain + ["int8"]  # the default identity: unchanged


# ---------------------------------------------------------------------------------------------------------------
# All of it in one run: alternatives, trigger word, output preservation, two resolutions, int8 text encoder;
# checkpoint and exact resume; two processes


def _tensors(path):
    return load_file(str(path))


@pytest.fixture(scope="module")
def together(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("together")
    images = root / "images"
    images.mkdir()
    for i, colour in enumerate(["red", "green", "blue"]):
        Image.new("RGB", (48 if i else 32, 32), colour).save(images / f"{i}.png")
    (images / "0.txt").write_text("[trigger] on a red field\na red sks photo\n\nred, close up\n")
    (images / "1.txt").write_text("a green dog\n")
    common = ["--max_train_steps", "4", "--checkpointing_steps", "2", "--cache_latents", "--rank", "2",
              "--trigger_word", "sks", "--instance_prompt", "a photo of [trigger] dog", "--output_preservation",
              "--class_word", "dog", "--output_preservation_weight", "0.5", "--resolution", "32,48",
              "--use_aspect_ratio_buckets", "--text_encoder_quantization", "int8", "--train_batch_size", "2",
              "--repeats", "2"]
    straight, resumed = root / "straight", root / "resumed"
    first = launch(base_args(tiny_model, images, straight, *common))
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    second = launch(base_args(tiny_model, images, resumed, *common, "--resume_from_checkpoint", "latest"))
    two = launch(base_args(tiny_model, images, root / "two", *common), num_processes=2)
    return SimpleNamespace(root=root, straight=straight, resumed=resumed, first=first, second=second, two=two)


@pytest.mark.slow
def test_one_run_with_every_option_resumes_bit_for_bit(together):
    a, b = _tensors(together.straight / T.LORA_WEIGHTS_NAME), _tensors(together.resumed / T.LORA_WEIGHTS_NAME)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c) for k, c in _tensors(together.straight / "checkpoint-2" / T.LORA_WEIGHTS_NAME).items())
    prints = re.findall(r"\[RANK (\d)\] LoRA fingerprint (\w+)", together.two.stderr)
    assert sorted(r for r, _ in prints) == ["0", "1"] and prints[0][1] == prints[1][1], together.two.stderr[-2000:]


@pytest.mark.slow
def test_the_run_encodes_every_alternative_and_preservation_prompt_and_says_so(together):
    log = together.first.stderr
    # captions: 3 alternatives of image 0 and image 1's one, the trigger put in; image 2 uses the instance prompt
    texts = {"sks on a red field", "a red sks photo", "sks, red, close up", "sks, a green dog", "a photo of sks dog"}
    preserved = {t.replace("sks", "dog") for t in texts}
    assert f"encoded {len(texts | preserved)} of {len(texts | preserved)} missing prompts" in log, log[-3000:]
    assert "2 of 3 images captioned, 4 caption alternatives" in log and "trigger word `sks`" in log
    assert "output preservation: `sks` -> `dog`, weight 0.5" in log
    card = (together.straight / "README.md").read_text()
    assert "4 caption alternatives" in card and "trigger word `sks`" in card
    # two resolutions: 3 images x 2 sides x 2 repeats samples, latents at both sizes
    assert "12 samples" in log
    sizes = {tuple(json.loads(line)["latent_hw"]) for line in
             (together.straight / "logs" / "samples-0.jsonl").read_text().splitlines()}
    assert len(sizes) >= 2, sizes


def test_a_manifest_of_several_resolutions_restores_their_buckets(tmp_path):
    from accelerate import PartialState

    PartialState()  # apply_manifest logs through accelerate's logger
    data = {flag: None for flag in T.MANIFEST_DATA_FLAGS}
    data.update(instance_prompt="a sks dog", repeats=1, resolution=48, seed=7, resolutions=[32, 48],
                buckets=[[32, 32], [48, 48]], ladders=[[[32, 32]], [[48, 48]]])
    manifest = T.build_manifest(data, {}, [], [], [], [], tmp_path)
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--from_manifest", __file__])
    T.apply_manifest(args, manifest)
    assert args.resolutions == (32, 48) and args.resolution == 48
    assert T.resolve_buckets(args) == [[(32, 32)], [(48, 48)]]


def test_a_missing_caption_alternative_is_traced_to_its_image():
    ds = T.DreamBoothDataset([_record("a.png", "first\nsecond"), _record("b.png")], "a photo of sks", [(32, 32)],
                             with_pixels=False)
    message = T.missing_entries_message("/cache", "/cache", ds, ["second", "a photo of sks", "elsewhere"], [], 9)
    assert "3 of 9 cache entries" in message and "from a.png, b.png, prompt 'elsewhere'" in message, message
