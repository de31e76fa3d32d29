"""--transformer_quantization int8 (issue 61): the transformer's frozen linear weights in 8 bits (torchao's int8
weight-only through diffusers' TorchAoConfig) under a float32 LoRA, on the CPU.

- The tiny transformer loads with every linear weight in int8, the bytes the memory estimate counts for it; PEFT's
  torchao LoRA layers wrap it with float32 adapters.
- Trained on fixed inputs its loss falls at every step, as the unquantised one's does; with its last blocks swapped
  it trains the same LoRA bit for bit.
- The script end to end (bf16, two processes, validation, a checkpoint): resumed from its checkpoint it ends at the
  straight run's LoRA bit for bit; that LoRA on the unquantised bf16 pipeline makes nearly the run's validation image
  (closer than the same pipeline without it); the model card and config.yaml say the weights were int8.
- Refusals: with another quantisation, fp8 matmuls, FSDP, other adapters than a plain LoRA.
The plan's choice of 8-bit weights is tested with the other plans in test_plan.py.
"""

import shutil

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch, step_loss
from tests.test_speed import _args, _train
from tests.test_swap import deep_model  # noqa: F401  (a fixture: 5 blocks, 3 of them to swap)
from tests.tiny_flux2 import MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS, make_images

INT8 = ("--transformer_quantization", "int8")
PROMPT = "a photo of sks dog in a bucket"


def _int8_linears(transformer):
    """{name: weight} of the linear layers' weights held as torchao int8 tensors."""
    from torchao.quantization import Int8Tensor

    return {n: m.weight for n, m in transformer.named_modules()
            if isinstance(m, torch.nn.Linear) and isinstance(m.weight, Int8Tensor)}


def test_the_transformer_loads_in_8_bits_and_the_estimate_counts_its_bytes(tiny_model, images, tmp_path):
    """Every linear weight in int8 and nothing else (the rest stays bf16, not PEFT's k-bit float32): the plan counts
    a byte and a share of the scales a weight (QUANT_BYTES: 2/1024; torchao's float32 scale and int8 zero point are
    5 bytes a row, as much for rows of 2,560) and the rest at its dtype's size."""
    from accelerate import Accelerator

    args = _args(tiny_model, images, tmp_path, *INT8)
    transformer = T.load_transformer(args, torch.bfloat16)
    linears = _int8_linears(transformer)
    assert linears and len(linears) == len([p for p in transformer.parameters() if p.ndim == 2])
    assert all(w.qdata.dtype == torch.int8 and w.dtype == torch.bfloat16 for w in linears.values())
    weights = sum(w.qdata.nbytes for w in linears.values())
    rest = [p for p in transformer.parameters() if p.ndim != 2]
    assert rest and {p.dtype for p in rest} == {torch.bfloat16}
    with torch.device("meta"):
        empty = T.empty_transformer(args).to(torch.bfloat16).requires_grad_(False)
    counted = T.weight_bytes(empty, 0, "int8")[0]
    assert counted == pytest.approx(weights * T.QUANT_BYTES["int8"] + sum(p.nbytes for p in rest), rel=1e-9)
    transformer = T.prepare_transformer(args, Accelerator(cpu=True), transformer)
    lora = [p for p in transformer.parameters() if p.requires_grad]
    assert lora and {p.dtype for p in lora} == {torch.float32}
    assert type(transformer.transformer_blocks[0].attn.to_q).__name__ == "TorchaoLoraLinear"


def test_the_loss_falls_on_fixed_inputs_as_without_quantisation(tiny_model, images, tmp_path):
    """Eight steps on one batch with the same noise each step: backward runs through the int8 layers into the LoRA,
    whose loss falls at every step, within 0.5% of the unquantised (float32) weights' at each (0.05% here)."""
    from accelerate import Accelerator

    def losses(*extra):
        args = _args(tiny_model, images, tmp_path, "--learning_rate", "1e-2", *extra)
        torch.manual_seed(0)  # the LoRA's initial A
        transformer = T.prepare_transformer(args, Accelerator(cpu=True), T.load_transformer(args, torch.float32))
        optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-2)
        g = torch.Generator().manual_seed(0)
        latents, embeds = torch.randn(1, 4, 4, 4, generator=g), torch.randn(1, MAX_SEQUENCE_LENGTH, 32, generator=g)
        found = []
        for _ in range(8):
            loss = step_loss(transformer, latents, embeds, torch.linspace(1, 0.01, 1000), seed=1,
                             weighting_scheme="none")  # the same noise and sigma at each step
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            found.append(loss.item())
        return found

    int8, full = losses(*INT8), losses()
    assert all(b < a for a, b in zip(int8, int8[1:])) and int8[-1] < 0.98 * int8[0], int8
    print(f"\nlosses, int8: {[round(x, 4) for x in int8]}\n    float32: {[round(x, 4) for x in full]}")
    assert int8 == pytest.approx(full, rel=0.005) and int8 != full


def test_swapped_int8_blocks_train_the_same_lora(deep_model, images, tmp_path):  # noqa: F811
    """The swapper moves an int8 weight's data and scales (a torchao tensor is a wrapper): 3 of 5 blocks swapped
    train the same losses and LoRA as none, and the swapped blocks hold no int8 data while out."""
    from accelerate import Accelerator

    shapes = [(4, 6)]
    flags = ("--gradient_checkpointing", *INT8)
    plain = _train(_args(deep_model, images, tmp_path, *flags), deep_model, shapes)
    args = _args(deep_model, images, tmp_path, *flags, "--blocks_to_swap", "3")
    swapped = _train(args, deep_model, shapes)
    assert swapped[0] == plain[0] and all(torch.equal(swapped[1][k], plain[1][k]) for k in plain[1])
    transformer = T.prepare_transformer(args, Accelerator(cpu=True), T.load_transformer(args, torch.float32))
    last = _int8_linears(T.transformer_blocks(transformer)[-1])
    assert last and all(w.qdata.numel() == 0 and w.scale.numel() == 0 for w in last.values())


@pytest.fixture(scope="module")
def int8_runs(tiny_model, tmp_path_factory):
    """The script with int8 weights in bf16 on two processes (DDP, which must not broadcast the int8 weights): 4
    steps, a checkpoint at 2, the final validation; then resumed from that checkpoint into another folder."""
    root = tmp_path_factory.mktemp("int8")
    make_images(str(root / "images"))
    common = [*INT8, "--mixed_precision", "bf16", "--max_train_steps", "4", "--checkpointing_steps", "2",
              "--learning_rate", "3e-2"]  # a LoRA that changes the images more than 8 bits do
    launch(base_args(tiny_model, root / "images", root / "straight", *common, "--validation_prompt", PROMPT,
                     "--num_validation_images", "1"), num_processes=2)
    launch(base_args(tiny_model, root / "images", root / "resumed", *common, "--resume_from_checkpoint",
                     root / "straight" / "checkpoint-2"), num_processes=2)
    return root


def test_a_resumed_run_ends_at_the_straight_runs_lora(int8_runs):
    straight, resumed = (load_file(str(int8_runs / name / T.LORA_WEIGHTS_NAME)) for name in ("straight", "resumed"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    checkpoint = load_file(str(int8_runs / "straight" / "checkpoint-2" / T.LORA_WEIGHTS_NAME))
    assert {v.dtype for v in checkpoint.values()} == {torch.float32}  # the trained adapter: float32


def test_its_lora_on_the_unquantised_pipeline_makes_the_validation_image(tiny_model, int8_runs):
    """The run's final validation image came from the int8 transformer with the LoRA; the bf16 pipeline with the
    saved LoRA, the same prompt embedding, seed and steps, makes nearly the same image: closer to it than the base
    model's image is (what the LoRA changed is more than what 8 bits changed)."""
    from diffusers import Flux2Pipeline

    out = int8_runs / "straight"
    args = T.parse_args(base_args(tiny_model, int8_runs / "images", out, *INT8, "--mixed_precision", "bf16"))
    family = T.detect_family(args)
    T.resolve_family_defaults(args, family)  # validation's steps and guidance, as the run resolved them
    pipe = Flux2Pipeline.from_pretrained(tiny_model, tokenizer=None, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(out))
    with torch.no_grad():
        embeds = T.encode_prompts(family, pipe.text_encoder, T.load_pipeline_tokenizer(args), [PROMPT],
                                  MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS)
    call = dict(prompt_embeds=embeds, height=32, width=32, num_inference_steps=args.validation_inference_steps,
                guidance_scale=args.validation_guidance_scale, seed=T.seed_for("validation", 0), device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = np.asarray(T.generate_images(pipe, call, 1)[0], dtype=float)
        with T.adapters_off(pipe.transformer):
            base = np.asarray(T.generate_images(pipe, call, 1)[0], dtype=float)
    final = np.asarray(Image.open(out / "validation" / "final-0.png"), dtype=float)
    near, lora = np.abs(ours - final).mean(), np.abs(ours - base).mean()
    print(f"\nint8 validation vs bf16 + LoRA: {near:.2f} grey levels (the LoRA's change: {lora:.2f})")
    assert near < 0.5 * lora, (near, lora)


def test_the_model_card_and_config_say_the_weights_were_int8(int8_runs):
    out = int8_runs / "straight"
    assert "linear weights in int8 (`--transformer_quantization int8`" in (out / "README.md").read_text()
    assert yaml.safe_load((out / "config.yaml").read_text())["transformer_quantization"] == "int8"


@pytest.mark.parametrize("extra, message", [
    (["--bnb_quantization_config_path", "nf4"], "--transformer_quantization int8 and --bnb_quantization_config_path "
                                                "exclude each other"),
    (["--do_fp8_training"], "--transformer_quantization int8 and --do_fp8_training exclude each other"),
    (["--use_dora"], "--transformer_quantization int8 trains a plain LoRA"),
    (["--adapter", "lokr"], "--transformer_quantization int8 trains a plain LoRA"),
    (["FSDP"], "--transformer_quantization int8 does not work under FSDP"),
])
def test_what_cannot_work_with_int8_weights_is_refused(extra, message, tiny_model, images, tmp_path, monkeypatch):
    if extra == ["FSDP"]:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        extra = []
    args = T.parse_args(base_args(tiny_model, images, tmp_path / "out", *INT8, *extra))
    with pytest.raises(T.UsageError, match=message):
        T.Int8Weights(args).check()
