"""Validation's cost (issue 54 item 2): a prompt's images in one batched call (one at a time when the batch is out of
memory), each from its own seed; validation on another transformer (--validation_transformer: the distilled [klein]
a base-trained LoRA is deployed on); fewer sampling steps before the final validation (--intermediate_inference_steps).
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch
from tests.tiny_flux2 import (KLEIN_TEXT_ENCODER_OUT_LAYERS, MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS,
                              build_tiny_flux2_klein)

LAYERS = KLEIN_TEXT_ENCODER_OUT_LAYERS
KLEIN = T.Family("FLUX.2 [klein]", "Flux2KleinPipeline", "Qwen3ForCausalLM")
PROMPT = "a photo of sks dog in a bucket"
# Batched and single calls run the same float32 maths with other matrix shapes, so the CPU's BLAS sums in another
# order: the tiny model's four steps end about 7e-7 apart (measured; float32's epsilon is 1.2e-7 and each step adds
# a few roundings). 1e-5 is 15 times that and 1/400 of one level of an 8-bit image; another seed moves pixels by up to 0.8.
ATOL = 1e-5


@pytest.fixture(scope="module")
def kleins(tmp_path_factory):
    """A tiny [klein] base checkpoint, and a distilled one whose transformer has other weights (the tiny builder makes
    the same for both): validation on it shows its weights, not only its steps."""
    from diffusers import Flux2Transformer2DModel

    root = tmp_path_factory.mktemp("kleins")
    base, distilled = build_tiny_flux2_klein(str(root / "base")), build_tiny_flux2_klein(str(root / "distilled"), True)
    transformer = Flux2Transformer2DModel.from_pretrained(distilled, subfolder="transformer")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in transformer.parameters():
            param.add_(0.2 * param.std().nan_to_num(0.02) * torch.randn(param.shape, generator=generator))
    transformer.save_pretrained(Path(distilled, "transformer"))
    return Path(base), Path(distilled)


def _pipeline(model, distilled=False):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(model, tokenizer=None, is_distilled=distilled)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _embeds(model, prompts):
    from transformers import AutoTokenizer

    pipe = _pipeline(model)
    tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer")
    with torch.no_grad():
        return T.encode_prompts(KLEIN, pipe.text_encoder, tokenizer, prompts, MAX_SEQUENCE_LENGTH, LAYERS)


def _call(embeds, **extra):
    """A validation call of the [klein] base pipeline with classifier-free guidance (the README's [klein] command)."""
    return {"prompt_embeds": embeds[:1], "negative_prompt_embeds": embeds[1:], "height": 32, "width": 32,
            "num_inference_steps": 4, "guidance_scale": 4.0, "seed": 7, "device": "cpu", "output_type": "np", **extra}


def _single(pipe, call, k):
    """Image k alone, from its own generator seeded from (seed, k): what a resumed run makes too."""
    call = dict(call)
    device, seed = call.pop("device"), call.pop("seed")
    return pipe(**call, generator=torch.Generator(device).manual_seed(T.seed_for(seed, k))).images[0]


@pytest.mark.slow
@pytest.mark.parametrize("edit", [False, True], ids=["text-to-image", "edit"])
def test_a_prompts_images_are_made_in_one_batch_each_from_its_own_seed(kleins, edit):
    pipe = _pipeline(kleins[0])
    condition = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    call = _call(_embeds(kleins[0], [PROMPT, ""]), **({"image": [condition]} if edit else {}))  # edit: its tokens
    calls = []
    spy = lambda **kwargs: calls.append(kwargs["num_images_per_prompt"]) or pipe(**kwargs)  # noqa: E731
    batched = T.generate_images(spy, call, 4)
    assert calls == [4] and len(batched) == 4  # one call for the four
    singles = [_single(pipe, call, k) for k in range(4)]
    for k in range(4):
        np.testing.assert_allclose(batched[k], singles[k], rtol=0, atol=ATOL)
    assert min(np.abs(batched[0] - batched[k]).max() for k in range(1, 4)) > 0.05  # four noises, not one
    # image k does not depend on how many are made with it (a different --num_validation_images keeps image 0)
    np.testing.assert_allclose(T.generate_images(pipe, call, 2)[1], batched[1], rtol=0, atol=ATOL)
    calls.clear()  # --validation_batch 3 (or the memory plan's 1): calls of at most 3, image k still from (seed, k)
    for image, reference in zip(T.generate_images(spy, call, 4, batch=3), batched, strict=True):
        np.testing.assert_allclose(image, reference, rtol=0, atol=ATOL)
    assert calls == [3, 1]


@pytest.mark.slow
def test_a_batch_out_of_memory_makes_the_same_images_one_at_a_time_and_says_so_once(kleins, caplog):
    from accelerate import PartialState

    PartialState()
    pipe = _pipeline(kleins[0])
    call = _call(_embeds(kleins[0], [PROMPT, ""]))
    expected = T.generate_images(pipe, call, 3)
    calls = []

    def small_gpu(**kwargs):  # a batch of more than one image does not fit
        calls.append(kwargs.get("num_images_per_prompt", 1))
        if calls[-1] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return pipe(**kwargs)

    type(T.logger).warning_once.cache_clear()  # said once per process: another test may have said it
    with caplog.at_level("WARNING"):
        first, second = (T.generate_images(small_gpu, call, 3) for _ in range(2))
    assert calls == [3, 1, 1, 1] * 2
    for images in (first, second):
        for image, reference in zip(images, expected, strict=True):
            np.testing.assert_allclose(image, reference, rtol=0, atol=ATOL)
    assert caplog.text.count("in one batch: made one at a time") == 1


def _images(folder, tag, count=2):
    return [np.asarray(Image.open(Path(folder, "validation", f"{tag}-{k}.png")), dtype=int) for k in range(count)]


def _fingerprint(proc):
    return re.findall(r"LoRA fingerprint ([0-9a-f]{16})", proc.stderr)


def _reference(model, lora_folder=None, weight_name=T.LORA_WEIGHTS_NAME, count=2, steps=4):
    """The distilled pipeline as a user runs it with the run's LoRA file: 4 steps, no guidance, the run's noise."""
    pipe = _pipeline(model, distilled=True)
    if lora_folder is not None:
        pipe.load_lora_weights(str(lora_folder), weight_name=weight_name)
    seed = T.seed_for("validation", 0)  # the run's --seed 0
    images = pipe(prompt_embeds=_embeds(model, [PROMPT]), height=32, width=32, num_inference_steps=steps,
                  num_images_per_prompt=count, generator=[torch.Generator().manual_seed(T.seed_for(seed, k))
                                                          for k in range(count)]).images
    return [np.asarray(image, dtype=int) for image in images]


def _close(images, references):
    """Equal within one level of 8 bits: the LoRA file folds alpha / rank into lora_B, so the reference's float sums
    differ from the run's in the last bits and a pixel can round the other way."""
    return all(np.abs(a - b).max() <= 1 for a, b in zip(images, references, strict=True))


@pytest.fixture(scope="module")
def runs(kleins, tmp_path_factory):
    """A [klein] base run validated as usual, on the distilled checkpoint (in the --validation_inference_steps given),
    and on its transformer folder with EMA (at its pipeline's steps: no --validation_inference_steps)."""
    from tests.tiny_flux2 import make_images

    root = tmp_path_factory.mktemp("validation-runs")
    make_images(str(root / "images"))
    base, distilled = kleins

    def run(name, *extra, steps="2"):
        args = base_args(base, root / "images", root / name, "--max_train_steps", "2", "--validation_prompt", PROMPT,
                         "--num_validation_images", "2", "--learning_rate", "0.05", *extra, layers=LAYERS)
        at = args.index("--validation_inference_steps")  # a LoRA that shows; base_args gives 2 steps
        return launch(args[:at] + (["--validation_inference_steps", steps] if steps else []) + args[at + 2:])
    return root, {"plain": run("plain"),
                  "distilled": run("distilled", "--validation_transformer", distilled, steps="3"),
                  "folder-ema": run("folder-ema", "--validation_transformer", distilled / "transformer", "--use_ema",
                                    "--ema_decay", "0.5", steps=None)}


@pytest.mark.slow
def test_validation_on_the_distilled_transformer_shows_its_images_with_the_same_lora(runs, kleins):
    root, procs = runs
    distilled = kleins[1]
    assert _fingerprint(procs["distilled"]) == _fingerprint(procs["plain"]) != []  # the LoRA is the same
    # in the --validation_inference_steps given (3, not its pipeline's 4): a flag the user gave is used
    assert "validation on " in procs["distilled"].stderr and ": 3 steps)" in procs["distilled"].stderr
    final, base = _images(root / "distilled", "final"), _images(root / "distilled", "base")
    assert all(np.abs(a - b).max() > 8 for a, b in zip(final, _images(root / "plain", "final")))
    with_lora, without = _reference(distilled, root / "distilled", steps=3), _reference(distilled, steps=3)
    assert not _close(with_lora, without)  # the LoRA shows in the images
    assert _close(final, with_lora) and _close(base, without)  # its weights, the LoRA, 3 steps, no CFG; base: its own
    assert not _close(final, _reference(distilled, root / "distilled"))  # its pipeline's 4 steps: other images
    assert "3 steps) with this LoRA" in (root / "distilled" / "README.md").read_text()
    # a transformer folder alone is sampled as a distilled [klein] (4 steps, no --validation_inference_steps given);
    # with --use_ema the images show the average, which is the LoRA file the run saves
    assert ": 4 steps)" in procs["folder-ema"].stderr
    average = _reference(distilled, root / "folder-ema")
    assert not _close(average, _reference(distilled, root / "folder-ema", T.RAW_LORA_WEIGHTS_NAME))
    assert _close(_images(root / "folder-ema", "final"), average)


def _resolve(model, *extra, layers=LAYERS):
    from accelerate import PartialState

    PartialState()
    args = T.parse_args(["--pretrained_model_name_or_path", str(model), "--instance_data_dir", ".",
                         "--instance_prompt", "p", "--text_encoder_out_layers", *map(str, layers), *map(str, extra)])
    hooks = T.Hooks(args)
    T.validate_args(args, hooks)
    return T.resolve_model_flags(args, hooks)


@pytest.mark.slow
def test_a_validation_transformer_that_cannot_hold_the_lora_is_refused_before_any_model_loads(
        kleins, tiny_model, images, tmp_path, monkeypatch):
    base, distilled = kleins
    (tmp_path / "empty").mkdir()
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    refused = {tmp_path / "empty": "expected a FLUX.2 checkpoint (model_index.json, transformer/) or a",
               tmp_path / "sd": "is a StableDiffusionPipeline; expected a FLUX.2 checkpoint",
               tiny_model: "its layers differ from those of",
               "someone/not-downloaded": "cannot read it"}  # offline (HF_HUB_OFFLINE), not in the Hub's cache
    for source, message in refused.items():
        with pytest.raises(T.UsageError, match=re.escape(f"--validation_transformer {source}")) as error:
            _resolve(base, "--validation_transformer", source)
        assert message in str(error.value), error.value
    with pytest.raises(T.UsageError, match="a transformer folder alone is taken as a distilled"):
        _resolve(tiny_model, "--validation_transformer", distilled / "transformer", layers=TEXT_ENCODER_OUT_LAYERS)
    _resolve(base, "--validation_transformer", distilled)  # accepted
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(T.UsageError, match="--validation_transformer is not supported under FSDP"):
        T.ValidationTransformer(T.parse_args(["--pretrained_model_name_or_path", str(base), "--instance_data_dir",
                                              ".", "--validation_transformer", str(distilled)])).check()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    out = tmp_path / "out"
    proc = launch(base_args(base, images, out, "--validation_transformer", tiny_model, layers=LAYERS), check=False)
    assert proc.returncode == 2 and "error: --validation_transformer" in proc.stderr, proc.stderr[-2000:]
    assert "its layers differ" in proc.stderr and not out.exists()


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _validate(model, out, accelerator, tags, *extra):
    """run_validation at `tags` on the tiny [klein] base model (a LoRA added, nothing trained) -> the steps of each
    call of the pipeline, as (tag, 'base' or 'lora', steps)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from peft.tuners.tuners_utils import BaseTunerLayer

    args = T.parse_args(base_args(model, ".", out, "--validation_prompt", PROMPT, "--num_validation_images", "1",
                                  "--validation_inference_steps", "3", *extra, layers=LAYERS))
    out.mkdir()
    hooks = T.Hooks(args)
    T.validate_args(args, hooks)
    T.resolve_family_defaults(args, KLEIN)  # CFG's scale
    transformer = accelerator.prepare(T.prepare_transformer(args, accelerator, T.load_transformer(args, torch.float32)))
    vae, mean, std = T.load_vae(args, accelerator, torch.float32)
    prompts = T.SampleCache()
    for prompt, embeds in zip([PROMPT, ""], _embeds(model, [PROMPT, ""])):
        prompts.put(prompt, embeds[None])
    run = T.Run(data=T.Data(KLEIN, None, 0, None, None, None, hooks=hooks), caches=T.Caches(prompts),
                weight_dtype=torch.float32, vae=vae, latent_stats=(mean, std), transformer=transformer, optimizer=None,
                lr_scheduler=None, sigmas=None, named_params={}, guidance=None, shift_steps=50,
                noise_scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler"))
    made, generate = [], T.generate_images

    def recorded(pipeline, call, count, batch=None):
        off = any(m.disable_adapters for m in pipeline.transformer.modules() if isinstance(m, BaseTunerLayer))
        made.append((tag, "base" if off else "lora", call["num_inference_steps"]))
        return generate(pipeline, call, count, batch)

    T.generate_images = recorded
    try:
        for tag in tags:
            T.run_validation(args, accelerator, run, tag, 1 + tags.index(tag))
    finally:
        T.generate_images = generate
    return made


@pytest.mark.slow
def test_intermediate_validations_may_sample_in_fewer_steps_the_base_and_final_images_never(kleins, tmp_path,
                                                                                         accelerator):
    base = kleins[0]
    tags = ["step-000001", "step-000002", "final"]
    assert _validate(base, tmp_path / "default", accelerator, tags) == [
        ("step-000001", "base", 3), ("step-000001", "lora", 3), ("step-000002", "lora", 3), ("final", "lora", 3)]
    assert _validate(base, tmp_path / "fewer", accelerator, tags, "--intermediate_inference_steps", "1") == [
        ("step-000001", "base", 3), ("step-000001", "lora", 1), ("step-000002", "lora", 1), ("final", "lora", 3)]
    # at most N: never more steps than the final validation's
    assert _validate(base, tmp_path / "more", accelerator, tags[:1], "--intermediate_inference_steps", "9") == [
        ("step-000001", "base", 3), ("step-000001", "lora", 3)]
    args = T.parse_args(base_args(base, ".", tmp_path / "m", "--intermediate_inference_steps", "1",
                                  "--validation_metrics", "dino"))
    with pytest.raises(T.UsageError, match="--intermediate_inference_steps with --validation_metrics: the scores"):
        T.validate_args(args)
