"""Validation's cost (issue 54 item 2): a prompt's images in one batched call (one at a time when the batch is out of
memory), each from its own seed.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

import train_dreambooth_lora_flux2 as T
from tests.tiny_flux2 import KLEIN_TEXT_ENCODER_OUT_LAYERS, MAX_SEQUENCE_LENGTH, build_tiny_flux2_klein

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


def test_a_prompts_images_are_made_in_one_batch_each_from_its_own_seed(kleins):
    pipe = _pipeline(kleins[0])
    call = _call(_embeds(kleins[0], [PROMPT, ""]))
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
