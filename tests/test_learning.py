"""What makes a run learn its subject: LoRA targets, noise levels that match inference, float32 flow-matching inputs,
a LoRA file of the same strength in every loader, the progress sheet, a clean first impression, and a test that the
default run learns."""

import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests import learning
from tests.conftest import ROOT, base_args, launch, step_generator, step_loss
from tests.tiny_flux2 import KLEIN_TEXT_ENCODER_OUT_LAYERS, MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS
from tests.tiny_metrics import build_tiny_dino

SHAPES = {  # real FLUX.2 transformers (../shared/GPU.md), built on the meta device: no memory, no download
    "dev": dict(num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360, guidance_embeds=True),
    "klein-4b": dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                     guidance_embeds=False),
}


def empty_transformer(name):
    from accelerate import init_empty_weights
    from diffusers import Flux2Transformer2DModel

    with init_empty_weights():
        model = Flux2Transformer2DModel(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256,
                                        axes_dims_rope=(32, 32, 32, 32), **SHAPES[name])
    return model.requires_grad_(False)


def adapt(model, spec, rank=16):
    from peft import LoraConfig

    targets = T.lora_target_modules(spec, model.config.num_single_layers, T.block_linear_names(model))
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets))
    return T.describe_lora(T.adapted_modules(model), sum(p.numel() for p in model.parameters() if p.requires_grad), rank)


# ---------------------------------------------------------------------------------------------------------------
# LoRA targets


@pytest.mark.parametrize("name, spec, expected", [
    ("dev", None, "LoRA rank 16 on 128 modules (8 double-stream, 48 single-stream blocks), 77.1 M trainable parameters"),
    ("klein-4b", "attention", "LoRA rank 16 on 20 modules (5 double-stream, 0 single-stream blocks), 1.97 M trainable parameters"),
    ("klein-4b", "default", "LoRA rank 16 on 60 modules (5 double-stream, 20 single-stream blocks), 16.7 M trainable parameters"),
])
def test_default_targets_cover_every_block_and_are_counted_from_the_model(name, spec, expected):
    model = empty_transformer(name)
    assert adapt(model, spec) == expected
    adapted = set(T.adapted_modules(model))
    for i in range(SHAPES[name]["num_single_layers"]):  # the block count comes from the config, not a constant
        assert ({f"single_transformer_blocks.{i}.attn.to_qkv_mlp_proj", f"single_transformer_blocks.{i}.attn.to_out"}
                <= adapted) == (spec != "attention")
    assert {f"transformer_blocks.{i}.attn.{m}" for i in range(SHAPES[name]["num_layers"])
            for m in ("to_q", "to_k", "to_v", "to_out.0")} <= adapted


def test_all_linear_adapts_every_block_linear_and_nothing_outside_the_blocks():
    model = empty_transformer("klein-4b")
    block_linears = T.block_linear_names(model)
    adapt(model, "all-linear")
    adapted = T.adapted_modules(model)
    assert adapted == block_linears and len(adapted) == 100
    assert not any(n.startswith(("x_embedder", "context_embedder", "time_guidance", "double_stream_modulation",
                                 "single_stream_modulation", "norm_out", "proj_out")) for n in adapted)


def test_lora_layers_mixes_presets_and_names():
    assert T.lora_target_modules("attention,proj_out", 2, []) == ["to_k", "to_q", "to_v", "to_out.0", "proj_out"]
    assert T.lora_target_modules(" to_q , to_q ", 2, []) == ["to_q"]
    assert T.lora_target_modules("all-linear", 2, ["a.b", "c"]) == ["a.b", "c"]
    assert T.lora_target_modules(None, 2, []) == T.lora_target_modules("default", 2, []) == [
        "to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
        "single_transformer_blocks.0.attn.to_out", "single_transformer_blocks.1.attn.to_out"]


def test_lora_layers_must_name_linear_layers_and_nothing_else():
    kinds = {"blocks.0.attn.to_out": "ModuleList", "blocks.0.attn.to_out.0": "Linear", "single.0.attn.to_out": "Linear",
             "blocks.0.attn.to_q": "Linear", "norm": "LayerNorm"}
    assert T.unusable_lora_targets(["to_q", "to_out.0", "single.0.attn.to_out", "attn.to_q"], kinds) == {}
    problems = T.unusable_lora_targets(["to_out", "norm", "nothing"], kinds)
    assert problems.keys() == {"to_out", "norm", "nothing"}
    assert problems["to_out"].startswith("also names blocks.0.attn.to_out (ModuleList)")
    assert problems["norm"] == problems["nothing"] == "no linear layer of the transformer has that name"


# ---------------------------------------------------------------------------------------------------------------
# Timestep shift


def _pipeline_sigmas(model, pipeline_class, height, width, steps, layers):
    """The sigmas (timestep / 1000) the family's own pipeline feeds its transformer at this size and step count."""
    import diffusers

    pipe = getattr(diffusers, pipeline_class).from_pretrained(model, tokenizer=None, text_encoder=None)
    pipe.set_progress_bar_config(disable=True)
    seen, forward = [], pipe.transformer.forward

    def spy(*args, **kwargs):
        seen.append(kwargs["timestep"][0].item())
        return forward(*args, **kwargs)

    pipe.transformer.forward = spy
    embeds = torch.randn(1, MAX_SEQUENCE_LENGTH, 16 * len(layers), generator=torch.Generator().manual_seed(0))
    pipe(prompt_embeds=embeds, height=height, width=width, num_inference_steps=steps, guidance_scale=1.0,
         output_type="latent", generator=torch.Generator().manual_seed(0))
    tokens = (height // (pipe.vae_scale_factor * 2)) * (width // (pipe.vae_scale_factor * 2))
    return torch.tensor(seen, dtype=torch.float64), tokens


def test_timestep_shift_auto_is_the_schedule_flux2_was_trained_with():
    """mu linear in the target's token count, 0.5 at 256 and 1.15 at 4,096 (FLUX.1's, which OneTrainer, musubi-tuner
    and SimpleTuner train FLUX.2 with; docs/learning.md), shift exp(mu), at four sizes; outside 256..4,096 extrapolated,
    not clamped, as they do. Planted: auto as the pipelines' shift, and the token count clamped: both fail here."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift  # FLUX.1's, defaults 256, 4096, 0.5, 1.15

    for tokens, mu in ((256, 0.5), (1024, 0.63), (2304, 0.5 + 0.65 * 2048 / 3840), (4096, 1.15)):  # 256² .. 1024²
        assert T.timestep_shift_for("auto", tokens, 50) == pytest.approx(math.exp(mu), rel=1e-12)
        assert T.timestep_shift_for("auto", tokens, 4) == pytest.approx(math.exp(calculate_shift(tokens)), rel=1e-12)
    assert T.timestep_shift_for("auto", 1024, 50) == pytest.approx(1.878, abs=1e-3)  # 512²: the pipeline's is 5.5
    assert T.timestep_shift_for("auto", 4096, 50) == pytest.approx(3.158, abs=1e-3)  # 1024²: the pipeline's is 7.6
    assert T.timestep_shift_for("auto", 64, 50) == pytest.approx(math.exp(calculate_shift(64)))  # 128²: 1.60 < e^0.5
    # 2048²: extrapolated to 25.3, where the pipelines' empirical mu (above 4,300 tokens) is this same line
    assert T.timestep_shift_for("auto", 16384, 50) == pytest.approx(T.timestep_shift_for("pipeline", 16384, 50), rel=1e-4)
    assert T.timestep_shift_for("auto", 16384, 50) == pytest.approx(math.exp(calculate_shift(16384)))


def test_timestep_shift_takes_what_float32_noise_levels_hold():
    """--timestep_shift 1e40 (finite, > 0) made the sigmas NaN: exit 1 at step 1, files left behind. The flag takes the
    shifts under which the training table's float32 sigmas stay finite in [0, 1], and refuses those just beyond."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    table = FlowMatchEulerDiscreteScheduler(shift=1.0).sigmas.float()  # what setup_training draws from: 1 to 0.001
    assert table.dtype == torch.float32 and table.max() == 1 and table.min() == pytest.approx(0.001)
    for shift, holds in ((1e-7, True), (1e38, True), (1e-8, False), (1e39, False)):
        shifted = T.shift_sigmas(table, shift)
        assert bool(torch.isfinite(shifted).all() and (shifted >= 0).all() and (shifted <= 1).all()) == holds, shift
        argv = ["--pretrained_model_name_or_path", "m", f"--timestep_shift={shift}"]
        if holds:
            assert T.parse_args(argv).timestep_shift == shift
        else:
            with pytest.raises(T.UsageError, match=re.escape(f"--timestep_shift {shift}: expected none, auto, "
                                                             "pipeline or a number from 1e-7 to 1e38")):
                T.parse_args(argv)


@pytest.mark.parametrize("family", ["dev", "klein-distilled"])
def test_timestep_shift_pipeline_reproduces_the_pipelines_own_sigmas(family, tiny_model, tmp_path):
    from tests.tiny_flux2 import build_tiny_flux2_klein

    if family == "dev":
        model, pipeline, layers = tiny_model, "Flux2Pipeline", TEXT_ENCODER_OUT_LAYERS
        fam = T.Family("FLUX.2 [dev]", "Flux2Pipeline", "Mistral3ForConditionalGeneration")
    else:
        model = build_tiny_flux2_klein(str(tmp_path / "klein"), distilled=True)
        pipeline, layers = "Flux2KleinPipeline", KLEIN_TEXT_ENCODER_OUT_LAYERS
        fam = T.Family("FLUX.2 [klein]", "Flux2KleinPipeline", "Qwen3ForCausalLM", distilled=True)
    steps = T.default_sampling_steps(fam)
    assert steps == (50 if family == "dev" else 4)
    for height, width in ((64, 48), (128, 128)):
        seen, tokens = _pipeline_sigmas(model, pipeline, height, width, steps, layers)
        unshifted = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)  # the pipelines' own grid
        ours = T.shift_sigmas(unshifted, T.timestep_shift_for("pipeline", tokens, steps))
        torch.testing.assert_close(ours, seen, rtol=1e-5, atol=1e-6)
        assert (seen[1:] > unshifted[1:]).all() and (seen - unshifted).max() > 0.1  # a real shift, not the identity


def test_fixed_shift_equals_the_schedulers_static_shift_and_none_is_none():
    from diffusers import FlowMatchEulerDiscreteScheduler

    static = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False).sigmas
    unshifted = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False).sigmas
    torch.testing.assert_close(T.shift_sigmas(unshifted, T.timestep_shift_for(3.0, 4096, 50)), static)
    assert T.timestep_shift_for("none", 4096, 50) is None
    assert T.parse_args(["--pretrained_model_name_or_path", "m", "--timestep_shift", "2.5"]).timestep_shift == 2.5
    for bad in ("0", "-1", "inf", "nan", "sometimes"):
        with pytest.raises(T.UsageError, match="--timestep_shift"):
            T.parse_args(["--pretrained_model_name_or_path", "m", f"--timestep_shift={bad}"])


class RecordingTransformer(torch.nn.Module):
    """Stands in for the transformer: records its inputs, predicts a fixed function of them."""

    def forward(self, hidden_states, timestep, encoder_hidden_states, **kwargs):
        self.hidden_states, self.timestep, self.embeds = hidden_states, timestep, encoder_hidden_states
        return (hidden_states.float() * 0.5 + 0.25,)


def _step(shift, latents, embeds, seed=3):
    table = torch.linspace(1.0, 0.001, 1000)
    model = RecordingTransformer()
    loss = step_loss(model, latents, embeds, table, seed=seed, timestep_shift=shift)
    return model, loss, table


def test_training_draws_the_shifted_noise_levels_per_batch_size():
    latents = torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(1))
    embeds = torch.randn(2, 16, 32)
    model, _, table = _step("auto", latents, embeds)
    g = step_generator()
    torch.randn(latents.shape, generator=g)  # the step draws its noise first
    unshifted = T.sample_sigmas(table, 2, "none", 0.0, 1.0, 1.29, g)
    expected = T.shift_sigmas(unshifted, T.timestep_shift_for("auto", 6 * 8, 50))
    torch.testing.assert_close(model.timestep, expected)
    assert (expected > unshifted + 1e-3).all()
    torch.testing.assert_close(_step("none", latents, embeds)[0].timestep, unshifted)


# ---------------------------------------------------------------------------------------------------------------
# Precision


def test_noisy_input_and_target_are_computed_in_float32_and_cast_at_the_transformer():
    latents = torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(1)) * 3 + 1
    embeds = torch.randn(2, 16, 32).to(torch.bfloat16)
    model, loss, table = _step("none", latents, embeds)
    g = step_generator()
    noise = torch.randn(latents.shape, generator=g)
    s = T.sample_sigmas(table, 2, "none", 0.0, 1.0, 1.29, g).view(-1, 1, 1, 1)
    from diffusers import Flux2Pipeline

    noisy = Flux2Pipeline._pack_latents((1 - s) * latents + s * noise)  # float32
    assert model.hidden_states.dtype == torch.bfloat16
    assert torch.equal(model.hidden_states, noisy.to(torch.bfloat16))
    pred = model.hidden_states.float() * 0.5 + 0.25
    expected = (pred - Flux2Pipeline._pack_latents(noise - latents)).pow(2).mean()  # float32 target
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert loss.dtype == torch.float32 and model.embeds.dtype == torch.bfloat16  # the prompts in the training dtype
    # posteriors cached in bf16 (mean and std) reach the path in float32: the draw too is made in float32
    params = torch.stack([latents, torch.rand(latents.shape) + 0.5], dim=1).to(torch.bfloat16)  # [B, 2, C, h, w]
    model = RecordingTransformer()
    step_loss(model, params, embeds, table, latent_sampling="sample")
    g = step_generator()
    drawn = T.draw_latents(params.float(), g)
    noise = torch.randn(latents.shape, generator=g)
    s = T.sample_sigmas(table, 2, "none", 0.0, 1.0, 1.29, g).view(-1, 1, 1, 1)
    assert torch.equal(model.hidden_states, Flux2Pipeline._pack_latents((1 - s) * drawn + s * noise).to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------------
# Portable strength


def _fused_deltas(model, folder):
    """What diffusers applies: weight after load_lora_weights + fuse_lora minus the base weight, by module."""
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(model, tokenizer=None, text_encoder=None)
    base = {n: m.weight.detach().clone() for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    pipe.load_lora_weights(str(folder))
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # the fused weights stay, in plain linear layers
    fused = {n: m.weight.detach() for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    return {n: fused[n] - base[n] for n in base if not torch.equal(fused[n], base[n])}


def _headerless_deltas(path):
    """What a loader that ignores the safetensors header applies (ComfyUI without `.alpha` tensors): B @ A."""
    state = load_file(str(path))
    return {k.removeprefix("transformer.").removesuffix(".lora_A.weight"):
            state[k.replace("lora_A", "lora_B")].float() @ state[k].float() for k in state if k.endswith("lora_A.weight")}


def test_saved_lora_has_the_same_strength_in_every_loader(tiny_model, images, tmp_path):
    out = tmp_path / "out"
    launch(base_args(tiny_model, images, out, "--max_train_steps", "3", "--checkpointing_steps", "3",
                     "--rank", "4", "--lora_alpha", "16"))  # scale alpha / rank = 4
    for folder in (out, out / "checkpoint-3"):  # a checkpoint's LoRA is a usable file too
        headerless = _headerless_deltas(folder / "pytorch_lora_weights.safetensors")
        fused = _fused_deltas(tiny_model, folder)
        assert fused.keys() == headerless.keys() and len(fused) == 6
        for name in fused:
            torch.testing.assert_close(fused[name], headerless[name], rtol=1e-5, atol=1e-7)
    # ... and it is the strength the run trained: scale x B @ A of the raw adapter the checkpoint resumes from
    raw = T.read_state(out / "checkpoint-3", "training")["lora"]
    for name, delta in headerless.items():
        trained = 4.0 * raw[f"{name}.lora_B.weight"] @ raw[f"{name}.lora_A.weight"]
        assert trained.abs().max() > 0
        torch.testing.assert_close(delta, trained, rtol=1e-5, atol=1e-7)
    with safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt") as f:
        config = json.loads(f.metadata()["lora_adapter_metadata"])
    assert (config["transformer.r"], config["transformer.lora_alpha"]) == (4, 4)  # the scale is in the weights


# ---------------------------------------------------------------------------------------------------------------
# Progress sheet


def test_progress_sheet_puts_each_validation_in_a_column_under_its_caption():
    from PIL import ImageDraw, ImageFont

    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    columns = [(f"step {i}", [Image.new("RGB", (20, 10), c), Image.new("RGB", (20, 10), tuple(v // 2 for v in c))])
               for i, c in enumerate(colours)]
    sheet = T.progress_sheet(columns)
    measure, font = ImageDraw.Draw(Image.new("RGB", (1, 1))), ImageFont.load_default()
    assert sheet.height == 14 + 2 * 10 + 4 * 4  # caption band, two rows, padding
    x = 4
    for (caption, _), colour in zip(columns, colours):
        width = max(20, int(measure.textlength(caption, font=font)))
        assert sheet.getpixel((x + 5, 14 + 8 + 5)) == colour  # first row
        assert sheet.getpixel((x + 5, 14 + 8 + 10 + 4 + 5)) == tuple(v // 2 for v in colour)  # second row
        band = [sheet.getpixel((i, j)) for i in range(x, x + width) for j in range(4, 14)]
        assert any(p[0] < 128 for p in band)  # the caption is written
        x += width + 4
    assert sheet.width == x


def test_progress_sheet_drops_columns_of_a_timeline_a_resume_left(tmp_path):
    for tag in ("base", "step-10", "step-20", "step-15"):
        for i in range(2):
            Image.new("RGB", (8, 8), (i * 100, 0, 0)).save(tmp_path / f"{tag}-{i}.png")
    for tag, step in (("step-10", 10), ("step-20", 20), ("step-15", 15)):
        T.update_progress_sheet(tmp_path, tag, step, 2)
    assert [c["tag"] for c in json.loads((tmp_path / "progress-0.json").read_text())["columns"]] == ["step-10", "step-15"]
    assert Image.open(tmp_path / "progress-0.png").size[1] == 14 + 2 * 8 + 4 * 4


def test_progress_sheet_drops_a_column_with_fewer_rows_than_now(tmp_path):
    """A column made with fewer prompts, strengths or images (a prompts file, then a final prompt added as a row;
    an older run's) lacks rows: the sheet leaves it out instead of failing on its missing files."""
    for tag, rows in (("base", 4), ("step-10", 2), ("step-20", 4)):
        for i in range(rows):
            Image.new("RGB", (8, 8), (i * 60, 0, 0)).save(tmp_path / f"{tag}-{i}.png")
    T.update_progress_sheet(tmp_path, "step-10", 10, 2)
    T.update_progress_sheet(tmp_path, "step-20", 20, 4)
    assert [c["tag"] for c in json.loads((tmp_path / "progress-0.json").read_text())["columns"]] == ["step-20"]
    assert Image.open(tmp_path / "progress-0.png").size[1] == 14 + 4 * 8 + 4 * 6  # base and step 20: four rows


def _validation_run(*extra):
    """args and run of a text-to-image run with --validation_prompt (and `extra` flags), for the output functions."""
    from accelerate import PartialState

    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", ".", "--output_dir", "out",
                         "--validation_prompt", "a sks dog", "--validation_inference_steps", "2",
                         "--num_validation_images", "1", "--max_train_steps", "10",
                         *map(str, extra)])
    hooks = T.Hooks(args)
    dataset = SimpleNamespace(conditions=None, instances=[])
    data = SimpleNamespace(seed=0, specs=tuple(T.option_validation_specs(hooks)), dataset=dataset, hooks=hooks,
                           family=T.Family("FLUX.2 [dev]", "Flux2Pipeline", "Mistral3ForConditionalGeneration"))
    PartialState()  # the script's logger
    T.resolve_family_defaults(args, data.family)  # validation's guidance: the pipeline's
    return args, SimpleNamespace(data=data, hooks=hooks, weight_dtype=torch.float32)


def _base_record(*extra, seed=0, condition=None, model=None, steps=None):
    """The record of the run's base images; `model` and `steps`: of another transformer that samples them."""
    args, run = _validation_run(*extra)
    run.data.seed = seed
    scales = run.hooks.first("validation_scales", default=lambda: [1.0])
    sampler = SimpleNamespace(config={"_name_or_path": model or args.pretrained_model_name_or_path})
    return T.base_record(args, run, T.validation_specs(args, run.data), scales, sampler,
                         steps or args.validation_inference_steps, condition)


def test_base_images_are_remade_when_what_made_them_changes(tmp_path):
    """validation/base.json records what the base model's images were made from: the same flags skip them (a
    resume), another prompt, strength list, image count, seed, size, steps, guidance, model (or the transformer that
    samples: --validation_transformer) or condition remakes them and starts the progress sheet again; base images
    without the record (an older version's, or one before image k had its own noise) are remade."""
    plain = SimpleNamespace(distributed_type=None)
    made = _base_record()
    assert T.base_images_missing(plain, tmp_path, made)  # none yet
    Image.new("RGB", (8, 8)).save(tmp_path / "base-0.png")
    assert T.base_images_missing(plain, tmp_path, made)  # no record: an older version made them
    T.write_json_atomic(tmp_path / "base.json", {k: v for k, v in made.items() if k != "noise"})
    assert T.base_images_missing(plain, tmp_path, made)  # drawn from one generator in sequence: other noise
    (tmp_path / "progress-0.json").write_text('{"columns": [{"tag": "step-10", "step": 10}]}')
    Image.new("RGB", (8, 8)).save(tmp_path / "condition.png")
    T.record_base_images(tmp_path, made, None)
    assert not (tmp_path / "progress-0.json").exists() and not (tmp_path / "condition.png").exists()
    assert not T.base_images_missing(plain, tmp_path, _base_record())  # the same flags: kept
    (tmp_path / "progress-0.json").write_text('{"columns": [{"tag": "step-10", "step": 10}]}')
    T.record_base_images(tmp_path, made, None)  # remade (a file was missing) from the same: the sheet goes on
    assert (tmp_path / "progress-0.json").exists()
    with_prompts = tmp_path / "prompts.txt"
    with_prompts.write_text("a sks dog on a beach --seed 3\n")
    (tmp_path / "tuned.safetensors").write_bytes(b"")  # --transformer_file's own checks come later
    condition = Image.new("RGB", (16, 16), (9, 9, 9))
    for other in (_base_record("--validation_prompt", "a sks cat"), _base_record("--num_validation_images", "2"),
                  _base_record("--validation_lora_scales", "0,1"),
                  _base_record("--validation_prompts_file", with_prompts),
                  _base_record(seed=1), _base_record("--resolution", "64"),
                  _base_record("--validation_inference_steps", "3"),
                  _base_record("--validation_guidance_scale", "2"),
                  _base_record("--pretrained_model_name_or_path", "other"), _base_record("--revision", "v2"),
                  _base_record("--transformer_file", tmp_path / "tuned.safetensors"),
                  _base_record(condition=[condition]), _base_record(model="distilled", steps=4)):
        assert other != made and T.base_images_missing(plain, tmp_path, other), other
    assert _base_record("--guidance_scale", "2") == made  # training's guidance: validation does not sample with it
    assert _base_record(condition=[condition]) == _base_record(condition=[condition.copy()])  # pixels, not objects
    assert _base_record(condition=[condition]) != _base_record(condition=[Image.new("RGB", (16, 16), (9, 9, 8))])
    T.record_base_images(tmp_path, _base_record("--validation_prompt", "a sks cat"), None)
    assert not (tmp_path / "progress-0.json").exists()  # its columns hold the other prompt's rows


def _card(tmp_path, *extra, images=4):
    args, run = _validation_run("--output_dir", tmp_path, *extra)
    folder = tmp_path / "validation"
    folder.mkdir(exist_ok=True)
    T.write_model_card(args, [folder / f"final-{i}.png" for i in range(images)], run)
    return (tmp_path / "README.md").read_text()


def test_model_card_captions_each_final_image_with_its_prompt_and_strength(tmp_path):
    """Rows are prompts times strengths: each image is captioned with its own; the widget lists strength 1 only; a
    prompts file alone (no prompt from finish) shows its prompts, never None; the usage snippet is valid Python with
    quotes in the prompt."""
    import ast
    import yaml

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a sks dog on a beach\na [sks] dog's *toy*\n")
    card = _card(tmp_path, "--validation_prompt", "", "--validation_prompts_file", prompts, "--validation_lora_scales",
                 "0,1", "--instance_prompt", 'a photo of "sks" dog')
    front = yaml.safe_load(card.split("---")[1])
    assert front["widget"] == [{"text": "a sks dog on a beach", "output": {"url": "validation/final-1.png"}},
                               {"text": "a [sks] dog's *toy*", "output": {"url": "validation/final-3.png"}}]
    assert "None" not in card and "null" not in card
    assert "![a sks dog on a beach](validation/final-0.png)\na sks dog on a beach (LoRA strength 0)" in card
    assert "![a sks dog on a beach](validation/final-1.png)\na sks dog on a beach (LoRA strength 1)" in card
    assert "\\[sks\\] dog's \\*toy\\* (LoRA strength 1)" in card  # markup escaped: shown as written
    code = card.split("```py\n")[1].split("```")[0]
    ast.parse(code)
    assert "pipe('a photo of \"sks\" dog', guidance_scale=4)" in code  # [dev]'s pipeline's, as validation
    assert f"pipe.load_lora_weights({str(tmp_path)!r}," in code
    # the snippet samples as validation did (--validation_guidance_scale, not training's --guidance_scale) and loads
    # from the Hub repository pushed to, with or without --hub_model_id
    args, run = _validation_run("--output_dir", tmp_path, "--validation_guidance_scale", "2.5", "--guidance_scale", "3")
    T.write_model_card(args, [], run, "someone/my-dog-lora")
    code = (tmp_path / "README.md").read_text().split("```py\n")[1].split("```")[0]
    assert "pipe('a sks dog', guidance_scale=2.5)" in code
    assert "pipe.load_lora_weights('someone/my-dog-lora', weight_name='pytorch_lora_weights.safetensors')" in code


def test_model_card_of_a_loha_loads_it_with_peft(tmp_path):
    """diffusers' load_lora_weights cannot read a LoHa (README: adapters and files): the card loads it with PEFT
    (a run's LoHa file loads this way: test_e2e), or for ComfyUI's layout says that ComfyUI's loader reads it."""
    import ast

    code = _card(tmp_path, "--adapter", "loha", images=1).split("```py\n")[1].split("```")[0]
    ast.parse(code)
    assert "pipe.load_lora_weights(" not in code and "LoHaConfig" in code and "set_peft_model_state_dict" in code
    code = _card(tmp_path, "--adapter", "loha", "--lora_format", "comfyui", images=1).split("```py\n")[1]
    assert "pipe.load_lora_weights(" not in code.split("```")[0] and "ComfyUI's LoRA loader reads it" in code


# ---------------------------------------------------------------------------------------------------------------
# A default run: what it adapts, what it prints, the modes of its files


LIBRARY_NOISE = re.compile(r"torchao|bitsandbytes|_pytree|triton|Unable to import|mxfp8|cutlass", re.IGNORECASE)


COUNT_SAMPLING_STEPS = """
import atexit, os
import torch  # not diffusers: importing it here, before the script quiets its libraries, would print their noise
_calls = [0]
_call = torch.nn.Module.__call__
def _counting(self, *args, **kwargs):  # the transformer in eval mode: a denoising step of validation
    _calls[0] += type(self).__name__ == "Flux2Transformer2DModel" and not self.training
    return _call(self, *args, **kwargs)
torch.nn.Module.__call__ = _counting
atexit.register(lambda: _calls[0] and open(os.environ["SAMPLING_STEPS_FILE"], "a").write(f"{_calls[0]}\\n"))
"""


@pytest.mark.slow
def test_a_default_run_adapts_every_block_prints_only_its_own_lines_and_writes_ordinary_files(
        tiny_model, images, tmp_path, own_cache_folder):
    """Also the family's default sampling steps, end to end: no --validation_inference_steps, so [dev] validates with
    its pipeline's 50 (a spy counts the transformer's eval-mode calls)."""
    out = tmp_path / "out"
    spy = tmp_path / "spy"
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(COUNT_SAMPLING_STEPS)
    args = base_args(tiny_model, images, out, "--max_train_steps", "2", "--checkpointing_steps", "1", "--cache_latents",
                     "--validation_prompt", "a dog", "--num_validation_images", "1")
    i = args.index("--validation_inference_steps")
    old = os.umask(0o027)  # unusual on purpose: 0640 files, where safetensors alone writes 0600
    try:
        proc = launch(args[:i] + args[i + 2:], via_accelerate=True,
                      env={"PYTHONPATH": f"{spy}:{ROOT}", "SAMPLING_STEPS_FILE": str(tmp_path / "steps")})
    finally:
        os.umask(old)
    assert "validation with 50 steps" in proc.stderr
    assert (tmp_path / "steps").read_text().split() == [str(2 * 50)]  # the base model's image and the final one
    output = proc.stdout + proc.stderr
    assert "LoRA rank 4 on 6 modules (1 double-stream, 1 single-stream blocks)" in output
    noise = [line for line in output.splitlines() if LIBRARY_NOISE.search(line)]
    assert not noise, noise
    keys = {k.split(".lora_")[0].removeprefix("transformer.") for k in load_file(str(out / "pytorch_lora_weights.safetensors"))}
    assert keys == {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
                    "transformer_blocks.0.attn.to_out.0", "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
                    "single_transformer_blocks.0.attn.to_out"}
    files = [p for root in (out, own_cache_folder) for p in root.rglob("*") if p.is_file() and p.name != ".lock"]
    assert any(p.suffix == ".safetensors" for p in files) and any("latents" in p.parts for p in files)
    wrong = {str(p): oct(p.stat().st_mode & 0o777) for p in files if p.stat().st_mode & 0o777 != 0o640}
    assert not wrong


# ---------------------------------------------------------------------------------------------------------------
# Learning


@pytest.fixture(scope="session")
def base_model(tmp_path_factory):
    """learning.build_base_model's model, its weights shipped in tests/data/learning (a second, not 35 to 55 s)."""
    return learning.base_model("tiny-flux2", tmp_path_factory.mktemp("learning") / "tiny-flux2")


@pytest.mark.parametrize("name", list(learning.base_models()))
def test_the_shipped_base_models_are_the_builders(name):
    """The learning tests' base models (here, tests/test_edit_learning.py's and tests/test_preservation.py's) are
    copied from tests/data/learning/<name>, trained once by their builder; build.json records the digest of the
    builder's source and arguments. A builder changed without regenerating them fails here (the fixtures would
    build instead, a minute each). Planted once: build_base_model's default steps 1000 -> 999."""
    assert learning.shipped_digest(name) == learning.builder_digest(name), (
        f"tests/data/learning/{name} was trained by another builder: regenerate with `{learning.REGENERATE}`")
    assert all((learning.DATA / name / part / file).is_file() for part in ("vae", "transformer")
               for file in ("config.json", "diffusion_pytorch_model.safetensors"))


@pytest.mark.slow
def test_a_default_run_learns_the_subject(base_model, tmp_path):
    """Default LoRA targets, 1,000 CPU steps on one image: diffusers' Flux2Pipeline with the saved LoRA samples
    latents several times closer to the subject's than the base model does. Measured with `python
    tests/learning.py OUT [flags]` (docs/learning.md): default 1.205 -> 0.304 (4.0x); --lora_layers attention 0.675
    (1.8x); all-linear 0.158 (7.6x); --timestep_shift auto 0.263 (4.6x), pipeline 0.258 (4.7x). Fails when the loss
    target, the timestep convention, the saved LoRA scale or the default targets break (each planted once)."""
    images = tmp_path / "subject"
    learning.make_subject(images)
    # the final validation scores the subject's likeness (--validation_metrics dino, a tiny random DINOv2): it rises
    # from the base model's images to the LoRA's, and not for a LoRA that does not learn (learning rate 1e-30: the
    # flag refuses 0). Measured: 0.901 -> 0.986 (validating every 50 steps: 0.941 at 50, 0.971 at 300, 0.983 at 500)
    dino = build_tiny_dino(tmp_path / "dino")
    metrics = ["--validation_prompt", learning.PROMPT, "--validation_epochs", "100000", "--validation_inference_steps",
               str(learning.SAMPLING_STEPS), "--validation_metrics", "dino", "--metrics_dino_model", dino]
    base, lora = learning.learning_figure(base_model, images, tmp_path / "out", *metrics)
    print(f"latent distance to the subject: base {base:.3f} -> LoRA {lora:.3f}")
    assert base / lora > 3.0, (base, lora)
    learning.train(base_model, images, tmp_path / "still", *metrics, steps=1, learning_rate="1e-30")
    (first, learned), (same, still) = ([json.loads(line)["subject"] for line in (tmp_path / out / "validation" /
                                        "metrics.jsonl").read_text().splitlines()] for out in ("out", "still"))
    print(f"subject similarity (DINO): base {first:.3f} -> LoRA {learned:.3f}; not learning: {same:.3f} -> {still:.3f}")
    assert first == same and learned - first > 0.03 and abs(still - same) < 0.005, (first, learned, same, still)
