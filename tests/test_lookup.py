"""What a step reads: the batch's prompts, latents and masks lined up from the caches (gather_inputs, token_mask),
the disk cache's entry names (every part of the identity counts), and which checkpoint `latest` is."""

import random
import shutil

import pytest
import torch

import train_dreambooth_lora_flux2 as T

SEED = 5
SCRIPT_SOURCE = open(T.__file__, encoding="utf-8").read()


def _dataset():
    """3 instance images (two captioned) and 2 class images, one 32x32 bucket, random flips, fixed crops."""
    instances = [T.ImageRecord(name=f"i{k}.png", size=(40, 40), caption=c, sha256=f"{k}" * 64)
                 for k, c in enumerate(["a red sks dog", None, "a sks dog on grass"])]
    # class images carry the class prompt as their caption
    classes = [T.ImageRecord(name=f"c{k}.png", size=(40, 40), caption="a dog", sha256=f"c{k}" * 32) for k in range(2)]
    return T.DreamBoothDataset(instances, "a sks dog", [(32, 32)], classes=classes, seed=SEED,
                               random_flip=True, with_pixels=False, fixed_crops=True)


def _code(kind, image_id, flip):
    """The value a fake cache holds for a latent: it names its source, so a lookup can be read back."""
    return (100 if kind == "class" else 0) + 10 * image_id + int(flip)


TEXT_CODES = {"a red sks dog": 1.0, "a sks dog": 2.0, "a sks dog on grass": 3.0, "a dog": 4.0, "": 5.0}


def _caches(dataset, masks=True):
    prompts, latents, mask_cache = T.SampleCache(), T.SampleCache(), T.SampleCache()
    for text, code in TEXT_CODES.items():
        prompts.put(text, torch.full((1, 3, 2), code))
    for key in dataset.cached_latent_keys():
        kind, image_id, *_, flip = key
        latents.put(key, torch.full((1, 4, 2, 2), float(_code(kind, image_id, flip))))
        mask_cache.put(key, torch.full((1, 1, 2, 2), float(_code(kind, image_id, flip)) / 1000))
    return T.Caches(prompts=prompts, latents=latents, masks=mask_cache if masks else None)


def _flip(slot, epoch):  # the definition, written out: a flip is drawn per (seed, epoch, slot)
    return random.Random(T.seed_for("flip", SEED, epoch, slot)).random() < 0.5


def test_a_steps_inputs_line_up_instance_then_class_rows_with_this_epochs_flips():
    dataset = _dataset()
    assert dataset.num_samples == 3
    epoch = next(e for e in range(1, 20) if any(_flip(s, e) != _flip(s, 0) for s in (0, 2, 3, 5)))
    batch = {"indices": [2, 0], "epoch": epoch}
    inputs = T.gather_inputs(batch, dataset, _caches(dataset), caption_dropout=0.0, rng=random.Random(0))
    latents, embeds = inputs.images[inputs.image_rows], inputs.embeds[inputs.embed_rows]  # as the step reads them
    mask = T.token_mask(inputs, 4, (2, 2))  # [B, h*w, 1]
    assert inputs.references == 0  # text-to-image: no condition images
    # rows: the instance parts of samples 2 and 0, then their class parts (class image i % 2 of sample i)
    assert embeds[:, 0, 0].tolist() == [3.0, 1.0, 4.0, 4.0]
    expected = [_code("instance", 2, _flip(2, epoch)), _code("instance", 0, _flip(0, epoch)),
                _code("class", 0, _flip(3 + 2, epoch)), _code("class", 0, _flip(3 + 0, epoch))]
    assert latents[:, 0, 0, 0].tolist() == expected
    assert mask[:, 0, 0].tolist() == pytest.approx([c / 1000 for c in expected])
    # one prompt row per distinct text (the class prompt is moved once), expanded on the device
    assert inputs.embeds.shape[0] == 3 and inputs.embed_rows.tolist() == [0, 1, 2, 2]


def test_caption_dropout_empties_instance_rows_only_and_uncaptioned_images_use_the_instance_prompt():
    dataset = _dataset()
    batch = {"indices": [1, 0], "epoch": 0}
    caches = _caches(dataset, masks=False)
    kept = T.gather_inputs(batch, dataset, caches, caption_dropout=0.0, rng=random.Random(0))
    assert kept.embeds[kept.embed_rows][:, 0, 0].tolist() == [2.0, 1.0, 4.0, 4.0] and kept.masks is None
    dropped = T.gather_inputs(batch, dataset, caches, caption_dropout=1.0, rng=random.Random(0))
    assert dropped.embeds[dropped.embed_rows][:, 0, 0].tolist() == [5.0, 5.0, 4.0, 4.0]


# ------------------------------------------------------------------------------------------------------ cache keys


def test_every_part_of_the_cache_identity_changes_the_entry_names(tiny_model, tmp_path):
    """A part dropped from the identity would let a run read entries made under other settings or models."""
    dev = T.Family("FLUX.2 [dev]", "Flux2Pipeline", "Mistral3ForConditionalGeneration")
    klein = T.Family("FLUX.2 [klein]", "Flux2KleinPipeline", "Qwen3ForCausalLM")
    latent_key = ["ab" * 32, (32, 32), (32, 32), 0, 0, False]

    def names(*flags, model=tiny_model, dtype=torch.float32, family=dev):
        args = T.parse_args(["--pretrained_model_name_or_path", str(model), "--instance_prompt", "p",
                             "--instance_data_dir", ".", "--cache_latents", "--max_sequence_length", "64",
                             "--text_encoder_out_layers", "1", "2", *flags])
        identity = T.cache_identity(args, dtype, family)
        return (T.json_digest("prompt", identity.prompts, "a dog"),
                T.json_digest("latent", identity.latents, latent_key))

    def edited(component):
        copy = tmp_path / f"model-{component}"
        shutil.copytree(tiny_model, copy)
        weights = next(p for p in sorted((copy / component).iterdir()) if p.suffix in (".safetensors", ".json"))
        data = bytearray(weights.read_bytes())
        data[-2] ^= 1
        weights.write_bytes(bytes(data))
        return copy

    base = names()
    assert names() == base  # deterministic
    prompt_only, latent_only, both = (True, False), (False, True), (True, True)
    changes = {
        "--max_sequence_length": (names("--max_sequence_length", "128"), prompt_only),
        "--text_encoder_out_layers": (names("--text_encoder_out_layers", "0", "2"), prompt_only),
        "family": (names(family=klein), prompt_only),
        "dtype": (names(dtype=torch.bfloat16), both),
        "--latent_sampling": (names("--latent_sampling", "sample"), latent_only),
        "text encoder": (names(model=edited("text_encoder")), prompt_only),
        "tokenizer": (names(model=edited("tokenizer")), prompt_only),
        "VAE": (names(model=edited("vae")), latent_only),
    }
    for part, ((prompt, latent), (prompt_changes, latent_changes)) in changes.items():
        assert (prompt != base[0], latent != base[1]) == (prompt_changes, latent_changes), part


def test_a_library_version_changes_every_entry_name(tiny_model, monkeypatch):
    """Another torch, diffusers or transformers may encode otherwise: entries name the versions that made them."""
    import diffusers
    import transformers

    args = T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--instance_prompt", "p",
                         "--instance_data_dir", ".", "--cache_latents", "--text_encoder_out_layers", "1", "2"])
    family = T.Family("FLUX.2 [dev]", "Flux2Pipeline", "Mistral3ForConditionalGeneration")
    base = T.cache_identity(args, torch.float32, family)
    for module in (torch, diffusers, transformers):
        with monkeypatch.context() as patch:
            patch.setattr(module, "__version__", f"{module.__version__}.post1")
            other = T.cache_identity(args, torch.float32, family)
        assert other.prompts != base.prompts and other.latents != base.latents, module.__name__
    assert T.cache_identity(args, torch.float32, family) == base


def _edited(node):
    """A copy of the definition `node` with its code changed: a statement added to its body, or its value (a
    constant's) written otherwise."""
    import ast
    import copy

    node = copy.deepcopy(node)
    if hasattr(node, "body"):
        node.body.insert(0, ast.parse("_edited = 1").body[0])
    else:
        node.value = ast.Subscript(ast.Tuple([node.value], ast.Load()), ast.Constant(0), ast.Load())  # (value,)[0]
    return node


def test_the_code_identity_covers_each_place_between_a_file_and_its_entry_alone():
    """The code that makes an entry is followed from the definitions named (PROMPT_CODE, LATENT_CODE) through every
    function, class and constant of the script it names: the closure where precompute calls the VAE (an edit there
    reused the old latents), the image transform and decoding. Each covered place edited alone changes the names of
    the entries it makes, and only those; an edit elsewhere, or of a comment, changes none."""
    kinds = {"prompts": T.PROMPT_CODE, "latents": T.LATENT_CODE}
    definitions = T.script_definitions(SCRIPT_SOURCE)
    covered = {kind: T.covered_code(definitions, names).keys() for kind, names in kinds.items()}
    assert {"prepare_latents.encode", "encode_images", "load_vae", "DreamBoothDataset.pixels",
            "DreamBoothDataset.record", "ImageRecord.load", "image_to_tensor", "transform_image", "to_rgb", "grey8",
            "NEUTRAL_GREY", "on_device", "encode_missing"} <= covered["latents"]
    assert {"prompt_encoder", "encode_prompts", "load_pipeline_tokenizer", "encode_missing"} <= covered["prompts"]
    assert not {"encode_images", "transform_image", "prepare_latents.encode"} & covered["prompts"]

    def digests(defs):
        return {kind: T.json_digest(sorted(T.covered_code(defs, names).items())) for kind, names in kinds.items()}
    base = digests(definitions)
    for name in sorted(covered["prompts"] | covered["latents"]) + ["log_step"]:  # the loop's: no entry's code
        node, owner = definitions[name]
        changed = digests({**definitions, name: (_edited(node), owner)})
        assert {kind for kind in kinds if changed[kind] != base[kind]} == {
            kind for kind in kinds if name in covered[kind]}, name
    lines = SCRIPT_SOURCE.splitlines(keepends=True)  # a comment a user adds, in the file: the same code
    body = definitions["encode_images"][0].body[0].lineno - 1
    assert digests(T.script_definitions("".join(lines[:body] + ["    # a note of a user's\n"] + lines[body:]))) == base


# ----------------------------------------------------------------------------------------------------- checkpoints


def test_latest_is_the_highest_step_and_the_limit_keeps_the_newest_k(checkpoint_run, tmp_path):
    """Steps 9 and 10 sort the other way as text; a limit of 2 keeps the two newest."""
    accelerator, run = checkpoint_run
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir", ".",
                         "--output_dir", str(tmp_path), "--checkpoints_total_limit", "2"])
    for step in (9, 10):
        T.save_checkpoint(args, accelerator, run, step)
    assert [p.name for p in T.list_checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-10"]
    args.resume_from_checkpoint = "latest"
    assert T.find_resume_checkpoint(args).name == "checkpoint-10"
    for step in (11, 100):
        T.save_checkpoint(args, accelerator, run, step)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-100", "checkpoint-11"]
    assert T.find_resume_checkpoint(args).name == "checkpoint-100"


def test_each_tensor_moves_every_tensor_field_a_new_one_too():
    """A tensor added to the step's inputs reaches the device without a second list to edit (issue 51)."""
    import dataclasses

    NewInputs = dataclasses.make_dataclass("NewInputs", [("weights", torch.Tensor, dataclasses.field(default=None))],
                                           bases=(T.StepInputs,))
    inputs = NewInputs(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), encoded=True,
                       weights=torch.ones(2))
    moved = T.each_tensor(inputs, lambda t: t + 1)
    assert torch.equal(moved.weights, torch.full((2,), 2.0)) and torch.equal(moved.embeds, torch.ones(1))
    assert moved.encoded is True and moved.masks is None and type(moved) is NewInputs
