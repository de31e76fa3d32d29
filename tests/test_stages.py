"""Stages of the script on the tiny FLUX.2 model, in-process: prompt encoding, cache alignment, LoRA dtype,
validation side effects."""

from pathlib import Path

import pytest
import torch

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, step_generator, step_loss

DEV = T.Family("FLUX.2 [dev]", "Flux2Pipeline", "Mistral3ForConditionalGeneration")
from tests.tiny_flux2 import MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _precompute(args, accelerator, dataset):
    """Stage 2 in memory for a dataset built here -> (Caches, the VAE if still needed, its statistics)."""
    data = T.Data(DEV, None, 0, dataset, None, None, hooks=T.Hooks(args))
    return T.precompute(args, accelerator, data, torch.float32, T.MemoryCache())


def _pipeline(model):
    from diffusers import Flux2Pipeline
    from transformers import AutoTokenizer

    pipe = Flux2Pipeline.from_pretrained(model, tokenizer=None)
    pipe.tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer")
    return pipe


def test_prompt_embeddings_equal_flux2_pipeline_encode_prompt(tiny_model, images, tmp_path, accelerator):
    prompts = ["a photo of sks dog on a red sofa", "a portrait of sks dog wearing a small blue hat", "a dog"]
    args = T.parse_args(base_args(tiny_model, images, tmp_path / "out"))
    tokenizer = T.load_pipeline_tokenizer(args)
    pipe = _pipeline(tiny_model)
    ours = T.encode_prompts(T.Family("FLUX.2 [dev]", "Flux2Pipeline", "Mistral3ForConditionalGeneration"), pipe.text_encoder, tokenizer, prompts, MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS)
    theirs, _ = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=MAX_SEQUENCE_LENGTH,
                                   text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS)
    assert ours.shape == (3, MAX_SEQUENCE_LENGTH, 32)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # the captions reach the embedding (a tiny max_sequence_length would truncate them all away)
    assert (ours[0] - ours[1]).abs().max() > 1e-3 and (ours[0] - ours[2]).abs().max() > 1e-3


def test_tokenizer_without_chat_template_is_refused(tiny_model, tmp_path, images):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    for name in ("chat_template.jinja", "chat_template.json"):
        (broken / "tokenizer" / name).unlink(missing_ok=True)
    config = broken / "tokenizer" / "tokenizer_config.json"
    import json

    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    args = T.parse_args(base_args(broken, images, tmp_path / "out"))
    with pytest.raises(T.UsageError, match="chat template"):
        T.load_pipeline_tokenizer(args)


def test_cached_inputs_match_a_fresh_encode_of_batch_indices_over_three_epochs(tiny_model, tmp_path, accelerator):
    """Reshuffled buckets, repeats and prior preservation: the cache rows returned for batch["indices"] are the
    encodings of exactly those samples (latents of their pixels, embeddings of their own caption)."""
    from PIL import Image

    from tests.tiny_flux2 import make_images

    paths = make_images(str(tmp_path / "images"))
    class_dir = tmp_path / "class"
    class_dir.mkdir()
    for k in range(5):
        Image.new("RGB", (32, 32), (50 * k, 90, 200 - 30 * k)).save(class_dir / f"c{k}.png")
    args = T.parse_args(base_args(tiny_model, tmp_path / "images", tmp_path / "out", "--repeats", "2", "--cache_latents",
                                  "--center_crop", "--aspect_ratio_buckets", "32,48;48,32;32,32", "--train_batch_size", "2",
                                  "--with_prior_preservation", "--class_prompt", "a photo of a dog",
                                  "--class_data_dir", class_dir, "--num_class_images", "5"))
    instances = T.load_instance_images(args, T.MemoryCache(), accelerator)
    classes = T.load_class_images(args, accelerator, 0, DEV, T.MemoryCache())
    dataset, sampler, _ = T.build_data(args, instances, classes, 0, accelerator)
    caches, _, _ = _precompute(args, accelerator, dataset)
    prompts, latents = caches.prompts, caches.latents
    vae, mean, std = T.load_vae(args, accelerator, torch.float32)
    # 12 instance slots (6 images x 2 repeats, center crop) share 6 latents; class slots share per (image, bucket)
    assert len([k for k in latents.store if k[0] == "instance"]) == 6 and len(latents.store) < 2 * len(dataset) == 24

    pipe = _pipeline(tiny_model)
    fresh_dataset = T.DreamBoothDataset(instances, args.instance_prompt, dataset.buckets, repeats=2, classes=classes,
                                        seed=0, center_crop=True, with_pixels=True)
    captions = {Path(p).name: (Path(p).with_suffix(".txt").read_text().strip() if Path(p).with_suffix(".txt").exists()
                               else args.instance_prompt) for p in paths}
    seen = set()
    for epoch in range(3):
        for indices in sampler.epoch_batches(epoch):
            seen.update(indices)
            slots = indices + dataset.class_slots(indices)
            batch = T.collate([fresh_dataset[(epoch, i)] for i in indices])
            with torch.no_grad():
                expected_latents = T.encode_images(vae, batch["pixel_values"], mean, std)
            unique, rows = latents.gather_unique([dataset.latent_key(s, epoch) for s in slots])
            cached = unique[rows]
            torch.testing.assert_close(cached, expected_latents, rtol=1e-5, atol=1e-5)
            texts = [captions[instances[i % len(instances)].name] for i in indices] + [args.class_prompt] * len(indices)
            with torch.no_grad():
                expected_embeds, _ = pipe.encode_prompt(texts, device="cpu", max_sequence_length=MAX_SEQUENCE_LENGTH,
                                                        text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS)
            unique, rows = prompts.gather_unique([dataset.prompt_key(s, 0) for s in slots])
            cached = unique[rows]
            torch.testing.assert_close(cached, expected_embeds, rtol=1e-5, atol=1e-5)
    assert seen == set(range(len(dataset)))  # reshuffles reached every sample


def test_lora_parameters_stay_float32_on_a_bf16_transformer(tiny_model):
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig

    transformer = Flux2Transformer2DModel.from_pretrained(tiny_model, subfolder="transformer", torch_dtype=torch.bfloat16)
    transformer.requires_grad_(False)
    T.add_lora(transformer, LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"], init_lora_weights="gaussian"))
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    frozen = [p for p in transformer.parameters() if not p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert all(p.dtype == torch.bfloat16 for p in frozen)


def test_validation_leaves_the_trained_transformer_alone(tiny_model, images, tmp_path, accelerator):
    from diffusers import FlowMatchEulerDiscreteScheduler

    args = T.parse_args(base_args(tiny_model, images, tmp_path / "out", "--num_validation_images", "2",
                                  "--validation_prompt", "a sks dog"))
    T.resolve_family_defaults(args, DEV)  # the pipeline's own guidance, as main() resolves it
    (tmp_path / "out").mkdir()  # main() makes it before training
    transformer = accelerator.prepare(T.prepare_transformer(args, accelerator, T.load_transformer(args, torch.float32)))
    transformer.train()
    vae, mean, std = T.load_vae(args, accelerator, torch.float32)
    prompts = T.SampleCache()
    prompts.put("a sks dog", torch.randn(1, MAX_SEQUENCE_LENGTH, 32))
    before = {n: (p.device, p.dtype, p.requires_grad, p.detach().clone()) for n, p in transformer.named_parameters()}
    run = T.Run(data=T.Data(DEV, None, 0, None, None, None, hooks=T.Hooks(args)), caches=T.Caches(prompts),
                weight_dtype=torch.float32, vae=vae, latent_stats=(mean, std), transformer=transformer, optimizer=None,
                lr_scheduler=None, sigmas=None, named_params={}, guidance=None, shift_steps=50,
                noise_scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_model, subfolder="scheduler"))
    paths = T.run_validation(args, accelerator, run, "step-3", 3)
    assert [p.name for p in paths] == ["step-3-0.png", "step-3-1.png"] and all(p.stat().st_size > 0 for p in paths)
    assert transformer.training
    for name, param in transformer.named_parameters():
        device, dtype, grad, value = before[name]
        assert (param.device, param.dtype, param.requires_grad) == (device, dtype, grad) and torch.equal(param, value)
    assert not any(hasattr(m, "_hf_hook") for m in transformer.modules())


@pytest.mark.parametrize("weighting_scheme, num_instance", [("none", 2), ("cosmap", 1), ("logit_normal", 2)])
def test_training_loss_matches_the_flux2_recipe_step_by_step(tiny_model, weighting_scheme, num_instance):
    """Our step (loss on packed tokens, sigma looked up by index) equals the diffusers example's recipe (sigma
    looked up by timestep, prediction unpacked with its position ids) for the same noise and timestep draws."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    transformer = Flux2Transformer2DModel.from_pretrained(tiny_model, subfolder="transformer")
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_model, subfolder="scheduler")
    latents = torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(1))
    embeds = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = step_loss(transformer, latents, embeds, scheduler.sigmas.float(), num_instance=num_instance,
                         weighting_scheme=weighting_scheme, prior_loss_weight=0.7)

        g = step_generator()
        noise = torch.randn(latents.shape, generator=g)
        u = compute_density_for_timestep_sampling(weighting_scheme, 2, 0.0, 1.0, 1.29, generator=g)
        timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
        sigmas = scheduler.sigmas[[(scheduler.timesteps == t).nonzero().item() for t in timesteps]].view(-1, 1, 1, 1)
        noisy = (1 - sigmas) * latents + sigmas * noise
        ids = Flux2Pipeline._prepare_latent_ids(latents)
        pred = transformer(hidden_states=Flux2Pipeline._pack_latents(noisy), timestep=timesteps / 1000,
                           guidance=torch.full((2,), 3.5), encoder_hidden_states=embeds,
                           txt_ids=Flux2Pipeline._prepare_text_ids(embeds), img_ids=ids, return_dict=False)[0]
        pred = Flux2Pipeline._unpack_latents_with_ids(pred, ids)
        weighting = compute_loss_weighting_for_sd3(weighting_scheme, sigmas)
        per_sample = (weighting * (pred - (noise - latents)) ** 2).flatten(1).mean(1)
        expected = per_sample[:num_instance].mean()
        if num_instance < 2:
            expected = expected + 0.7 * per_sample[num_instance:].mean()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_text_encoder_is_released_after_prompt_precompute(tiny_model, images, tmp_path, accelerator, monkeypatch):
    import gc
    import weakref

    from transformers import Mistral3ForConditionalGeneration

    loaded = []
    original = Mistral3ForConditionalGeneration.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        loaded.append(weakref.ref(model))
        return model

    monkeypatch.setattr(Mistral3ForConditionalGeneration, "from_pretrained", classmethod(spy))
    args = T.parse_args(base_args(tiny_model, images, tmp_path / "out", "--validation_prompt", "a dog"))
    dataset, _, _ = T.build_data(args, T.load_instance_images(args, T.MemoryCache(), accelerator), [], 0, accelerator)
    cache = _precompute(args, accelerator, dataset)[0].prompts
    gc.collect()
    assert len(loaded) == 1 and loaded[0]() is None
    assert cache["a dog"].device.type == "cpu" and len(cache.store) == 6 + 1  # 5 captions, instance prompt, validation


def test_seed_is_drawn_when_absent_and_taken_from_the_checkpoint_on_resume(tmp_path, accelerator, caplog):
    import json
    import logging

    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir", "."])
    with caplog.at_level(logging.INFO):
        drawn = T.agree_seed(args, None, accelerator)
    assert 0 <= drawn < 2**31 and f"--seed {drawn}" in caplog.text
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / T.TRAINER_STATE_NAME).write_text(json.dumps({"global_step": 4, "seed": 1234}))
    assert T.agree_seed(args, checkpoint, accelerator) == 1234
    args.seed = 9
    assert T.agree_seed(args, checkpoint, accelerator) == 9


def test_posterior_sampling_cache_draws_fresh_latents_around_the_cached_mean(tiny_model, images, tmp_path, accelerator):
    args = T.parse_args(base_args(tiny_model, images, tmp_path / "out", "--cache_latents", "--center_crop",
                                  "--latent_sampling", "sample"))
    dataset, _, _ = T.build_data(args, T.load_instance_images(args, T.MemoryCache(), accelerator), [], 0, accelerator)
    sampled = _precompute(args, accelerator, dataset)[0].latents
    args.latent_sampling = "mode"
    caches, unused_vae, _ = _precompute(args, accelerator, dataset)
    moded = caches.latents
    assert unused_vae is None  # cached latents and no validation: the VAE is released
    vae, *stats = T.load_vae(args, accelerator, torch.float32)
    key = dataset.latent_key(0, 0)
    params, mean = sampled[key], moded[key]
    assert params.shape == (1, 2, *mean.shape[1:]) and torch.equal(params[:, 0], mean)
    draws = [T.draw_latents(params, torch.Generator().manual_seed(T.seed_for("step", 0, m, 0))) for m in range(400)]
    assert not torch.equal(draws[0], draws[1])  # two uses of the same sample see different latents
    with torch.no_grad():  # cached equals a fresh encode of the same pixels: the mode, and the mean and std
        fresh = T.encode_images(vae, dataset.pixels(key)[None], *stats)
        fresh_params = T.encode_images(vae, dataset.pixels(key)[None], *stats, "sample")
    torch.testing.assert_close(moded[key], fresh, rtol=0, atol=1e-6)
    torch.testing.assert_close(params, fresh_params, rtol=0, atol=1e-6)
    # the draws spread as the fresh encode's std says: tolerances come from it, not from the cached value under test
    sigma, stacked = fresh_params[:, 1], torch.stack(draws)
    assert sigma.min() > 0 and ((stacked.mean(0) - mean).abs() <= 4 * sigma / 20).all()  # 4 standard errors of 400
    torch.testing.assert_close(stacked.std(0), sigma.expand_as(stacked[0]), rtol=0.2, atol=0)


def test_dev_trains_at_embedded_guidance_1_and_validates_at_its_pipelines(tiny_model, tmp_path, accelerator):
    """Issue 60: [dev] (a guidance embedding) trains at --guidance_scale 1, as every [dev] command of the diffusers
    README passes it (its parser's default, 3.5, is not what they train at); validation keeps the pipeline's own."""
    import inspect
    from types import SimpleNamespace

    from diffusers import Flux2Pipeline

    args = T.parse_args(base_args(tiny_model, ".", tmp_path))
    T.resolve_family_defaults(args, DEV)
    pipelines = inspect.signature(Flux2Pipeline.__call__).parameters["guidance_scale"].default
    assert args.guidance_scale == 1.0 and args.validation_guidance_scale == pipelines == 4.0
    run = SimpleNamespace(caches=SimpleNamespace(prompts={"a dog": torch.zeros(1, 4, 8)}), weight_dtype=torch.float32,
                          data=SimpleNamespace(seed=0, condition=None))
    assert T.pipeline_call(args, run, T.ValidationSpec("a dog"), "cpu", DEV, 2)["guidance_scale"] == 4.0
