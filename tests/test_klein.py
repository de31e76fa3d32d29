"""FLUX.2 [klein] (Qwen3 text encoder, no guidance embedding, base or distilled) through the same script."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch
from tests.tiny_flux2 import KLEIN_TEXT_ENCODER_OUT_LAYERS, MAX_SEQUENCE_LENGTH

LAYERS = KLEIN_TEXT_ENCODER_OUT_LAYERS


def _args(model, *extra):
    return T.parse_args(["--pretrained_model_name_or_path", str(model), "--instance_prompt", "p", "--instance_data_dir",
                         ".", *extra])


def test_family_and_its_defaults_come_from_the_checkpoint_and_the_pipeline_classes(tiny_klein, tiny_model, caplog):
    import inspect

    from accelerate import PartialState
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    PartialState()
    distilled = json.loads(open(f"{tiny_klein}/model_index.json").read())["is_distilled"]
    klein = T.detect_family(_args(tiny_klein))
    assert (klein.pipeline, klein.text_encoder, klein.distilled) == ("Flux2KleinPipeline", "Qwen3ForCausalLM", distilled)
    args = _args(tiny_klein)
    T.resolve_family_defaults(args, klein)
    expected = list(inspect.signature(Flux2KleinPipeline.encode_prompt).parameters["text_encoder_out_layers"].default)
    assert args.text_encoder_out_layers == expected == [9, 18, 27]  # not [dev]'s (10, 20, 30): diffusers #13445
    assert (args.validation_inference_steps, args.validation_guidance_scale) == ((4, 1.0) if distilled else (50, 4.0))
    dev = T.detect_family(_args(tiny_model))
    args = _args(tiny_model)
    T.resolve_family_defaults(args, dev)
    assert args.text_encoder_out_layers == list(inspect.signature(Flux2Pipeline.encode_prompt).parameters["text_encoder_out_layers"].default)
    with caplog.at_level(logging.WARNING):
        T.resolve_family_defaults(_args(tiny_klein, "--text_encoder_out_layers", "1", "2", "3"), klein)
    assert "overrides the FLUX.2 [klein] default [9, 18, 27]" in caplog.text


def test_klein_prompt_embeddings_equal_the_pipeline(tiny_klein):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(tiny_klein)
    prompts = ["a photo of sks dog on a red sofa", "a red car"]
    family = T.Family("FLUX.2 [klein]", "Flux2KleinPipeline", "Qwen3ForCausalLM")
    ours = T.encode_prompts(family, pipe.text_encoder, pipe.tokenizer, prompts, MAX_SEQUENCE_LENGTH, LAYERS)
    theirs, _ = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=MAX_SEQUENCE_LENGTH, text_encoder_out_layers=LAYERS)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert (ours[0] - ours[1]).abs().max() > 1e-3


@pytest.mark.slow
def test_klein_trains_with_prior_cache_and_validation_and_its_lora_loads(tiny_klein, images, tmp_path):
    from diffusers import Flux2KleinPipeline

    out = tmp_path / "out"
    proc = launch(base_args(tiny_klein, images, out, "--max_train_steps", "3", "--cache_latents",
                            "--with_prior_preservation", "--class_data_dir", tmp_path / "class", "--class_prompt",
                            "a photo of a dog", "--num_class_images", "2", "--validation_prompt", "a photo of sks dog",
                            "--num_validation_images", "1", "--caption_dropout", "0.2", layers=LAYERS))
    assert "FLUX.2 [klein]" in proc.stderr and len(list((tmp_path / "class").iterdir())) == 2
    assert (out / "validation" / "final-0.png").is_file() and "Flux2KleinPipeline" in (out / "README.md").read_text()
    state = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert state and all(k.startswith("transformer.") for k in state)
    pipe = Flux2KleinPipeline.from_pretrained(tiny_klein)
    embeds = torch.randn(1, MAX_SEQUENCE_LENGTH, 48, generator=torch.Generator().manual_seed(0))
    run = lambda: pipe(prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=32, width=32,  # noqa: E731
                       num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    before = run()
    pipe.load_lora_weights(str(out))
    assert not torch.equal(before, run())
