"""Tiny random FLUX.2 [dev] and [klein] pipelines and a small image set, for CPU tests of the trainer.

The saved folders mirror the Hub layouts of black-forest-labs/FLUX.2-dev and FLUX.2-klein-4B
(model_index.json plus transformer/, vae/, text_encoder/, scheduler/, tokenizer/) so the trainer
is exercised through exactly the same loading code paths, just with kilobyte-sized random weights.

Usage:  python tests/tiny_flux2.py OUT_DIR
        ->  OUT_DIR/tiny-flux2, OUT_DIR/tiny-flux2-klein (base, not distilled) and OUT_DIR/images
"""

import json
import os
import sys

import numpy as np
import torch
from PIL import Image

# Hidden states of these text-encoder layers are stacked into the prompt embedding, so every
# test must pass `text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS` (the real default (10, 20, 30)
# does not exist in a 2-layer encoder). joint_attention_dim is derived from it.
TEXT_HIDDEN_SIZE = 16
TEXT_ENCODER_OUT_LAYERS = (1, 2)
JOINT_ATTENTION_DIM = TEXT_HIDDEN_SIZE * len(TEXT_ENCODER_OUT_LAYERS)
# The chat prefix (<s>[SYSTEM_PROMPT] + 27-token system message + [/SYSTEM_PROMPT][INST]) is
# 31 tokens, so the caption only reaches the embedding when max_sequence_length > 31; at 8
# every prompt encodes identically (useful to show truncation).
MAX_SEQUENCE_LENGTH = 64
VOCAB_SIZE = 1000
VAE_SCALE_FACTOR = 2  # two VAE blocks -> one 2x downsample

# Order fixes the ids: <unk>=0, <s>=1, </s>=2, ..., [IMG]=7, <pad>=8.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                  "[/SYSTEM_PROMPT]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]"]
UNK_ID, BOS_ID, EOS_ID, IMG_ID, PAD_ID = 0, 1, 2, 7, 8

# Mistral-Small-3.1 style: content may be a plain string or a list of typed chunks, which is
# what diffusers' format_input() produces.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set chunks = [{'type': 'text', 'text': message['content']}] %}"
    "{%- else %}{%- set chunks = message['content'] %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' }}{%- endif %}"
    "{%- for chunk in chunks %}"
    "{%- if chunk['type'] == 'text' %}{{- chunk['text'] }}"
    "{%- elif chunk['type'] == 'image' %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if message['role'] == 'system' %}{{- '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- eos_token }}{%- endif %}"
    "{%- endfor %}"
)

# --- FLUX.2 [klein]: Qwen3 text encoder -------------------------------------------------------
# Same role as TEXT_ENCODER_OUT_LAYERS: pass `text_encoder_out_layers=KLEIN_TEXT_ENCODER_OUT_LAYERS`
# (the real default (9, 18, 27) does not exist in the 3-layer encoder). Layer 3 is the last one,
# which transformers returns after the final RMSNorm (the real layers are all pre-norm states).
KLEIN_TEXT_HIDDEN_SIZE = 16
KLEIN_TEXT_ENCODER_OUT_LAYERS = (1, 2, 3)
KLEIN_JOINT_ATTENTION_DIM = KLEIN_TEXT_HIDDEN_SIZE * len(KLEIN_TEXT_ENCODER_OUT_LAYERS)
# Qwen3 names; trained first, so these are the ids 0..4 (Qwen3 has no <unk>/<s>).
KLEIN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
KLEIN_PAD_ID, KLEIN_IM_START_ID, KLEIN_IM_END_ID, KLEIN_THINK_ID, KLEIN_END_THINK_ID = range(5)
# "<|im_start|>user\n" precedes the caption and
# "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" follows it (9 tokens).
KLEIN_PROMPT_PREFIX_TOKENS = 3
KLEIN_PROMPT_SUFFIX_TOKENS = 9

# Qwen3's ChatML template, cut down to plain-string content; like the real one it closes an empty
# think block when the caller passes enable_thinking=False (as Flux2KleinPipeline does).
KLEIN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# (width, height, caption or None); None means "no .txt file" so loaders see a missing caption.
IMAGE_SPECS = [
    (64, 40, "a photo of sks dog on a red sofa"),
    (64, 40, "a photo of sks dog running across a green park"),
    (64, 40, None),
    (40, 64, "a portrait of sks dog wearing a small blue hat"),
    (40, 64, "sks dog sitting next to a yellow door at night"),
    (48, 48, "a close up photo of sks dog with bright eyes"),
]
IMAGE_SIZES = sorted({(w, h) for w, h, _ in IMAGE_SPECS})  # (width, height), all multiples of 8


# diffusers/transformers are imported inside the builders so that make_images() and the
# constants stay cheap to import.


_WORDS = (
    "a an the of on in at to with and or next across near under over behind photo picture "
        "portrait close up shot image painting drawing render of sks dog cat person man woman "
        "child car house tree flower sofa chair table door window park street beach mountain "
        "river sky cloud sun moon night day morning evening red green blue yellow orange purple "
        "black white gray pink brown bright dark small big tall short old young happy sad "
        "running sitting standing walking jumping sleeping wearing holding looking eating hat "
        "eyes face hands ball toy book cup light shadow water grass snow rain wooden metal "
    "glass stone soft sharp blurry detailed realistic colorful style high quality art"
)


def _corpus():
    # Training the BPE on the system message and caption vocabulary makes those words single
    # tokens: a realistic ~30-token system prefix and distinct tokens per caption word.
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    lines = [SYSTEM_MESSAGE, _WORDS] + [c for _, _, c in IMAGE_SPECS if c]
    return lines * 3


def _klein_corpus():
    # The chat-template pieces make "user", "assistant", "\n\n" single tokens, as in Qwen3.
    lines = ["user\n", "assistant\n", "system\n", "\n\n", _WORDS] + [c for _, _, c in IMAGE_SPECS if c]
    return lines * 3


def _train_bpe(model, pre_tokenizer, special_tokens, corpus, normalizer=None):
    """Train a byte-level BPE (never emits <unk>) on `corpus`; special tokens get the first ids."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers

    bpe = Tokenizer(model)
    if normalizer is not None:
        bpe.normalizer = normalizer
    bpe.pre_tokenizer = pre_tokenizer
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=special_tokens, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    return bpe


def build_tokenizer():
    """Byte-level BPE (never emits <unk>) wrapped as a fast tokenizer with a chat template."""
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = _train_bpe(models.BPE(unk_token="<unk>"), pre_tokenizers.ByteLevel(add_prefix_space=False),
                     SPECIAL_TOKENS, _corpus())
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        model_max_length=131072,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_klein_tokenizer():
    """Qwen2Tokenizer (transformers' Qwen2TokenizerFast) over a tiny BPE with a Qwen3 chat template.

    Transformers 5 rebuilds a Qwen2Tokenizer from tokenizer.json's vocab/merges with its own NFC
    normalizer and Qwen2 split regex, so the BPE is trained with exactly that pipeline: the saved
    tokenizer then encodes identically after AutoTokenizer.from_pretrained.
    """
    from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
    from transformers import Qwen2TokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe = _train_bpe(models.BPE(), pre_tokenizer, KLEIN_SPECIAL_TOKENS, _klein_corpus(),
                     normalizer=normalizers.NFC())
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # Special-token roles as in Qwen3's tokenizer_config.json.
    tok = Qwen2TokenizerFast(
        vocab=model["vocab"], merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=131072,
    )
    # <think> / </think> are added (never split) but not special tokens, as in Qwen3.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = KLEIN_CHAT_TEMPLATE
    return tok


def _save_tokenizer(tok, folder):
    """Write the Hub's PixtralProcessor folder layout around our tokenizer.

    The configs are written by hand because constructing a PixtralProcessor object needs
    torchvision; the trainer only needs AutoTokenizer.from_pretrained(..., subfolder="tokenizer"),
    while Flux2Pipeline.from_pretrained without an explicit tokenizer= tries to build a
    PixtralProcessor from these files, exactly as with the Hub checkpoint.
    """
    tok.save_pretrained(folder)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    processor = {
        "processor_class": "PixtralProcessor", "patch_size": 6, "spatial_merge_size": 2,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
    }
    image_processor = {  # Mistral-Small-3.1 values, shrunk to the tiny vision tower
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": {"height": 6, "width": 6}, "resample": 3, "rescale_factor": 1 / 255,
        "size": {"longest_edge": 30},
    }
    for name, data in (("processor_config.json", processor), ("preprocessor_config.json", image_processor)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)


def build_tiny_flux2(path, hub_processor=True):
    """Build and save a deterministic tiny random FLUX.2 [dev] pipeline; return `path`.

    With `hub_processor=True` (default) model_index.json names the tokenizer a PixtralProcessor,
    exactly like the Hub checkpoint. diffusers then rejects a plain tokenizer passed as
    `Flux2Pipeline.from_pretrained(path, tokenizer=tok)` (TypeError without torchvision; its type
    check expects a ProcessorMixin with it), just as it would for the real model; use
    `from_pretrained(path, tokenizer=None)` then `pipe.tokenizer = tok`, or build the pipeline
    from components. `hub_processor=False` names the fast tokenizer class instead, so passing
    `tokenizer=tok` (or nothing) works.
    """
    from transformers import Mistral3ForConditionalGeneration

    os.makedirs(path, exist_ok=True)
    transformer = _build_transformer(JOINT_ATTENTION_DIM, guidance_embeds=True)  # [dev] is guidance-distilled
    vae = _build_vae()

    tok = build_tokenizer()
    assert len(tok) <= VOCAB_SIZE
    torch.manual_seed(0)
    text_encoder = Mistral3ForConditionalGeneration(dev_text_config())

    _save_models(path, transformer, vae, text_encoder)
    _save_tokenizer(tok, os.path.join(path, "tokenizer"))
    _write_model_index(
        path, "Flux2Pipeline", text_encoder="Mistral3ForConditionalGeneration",
        tokenizer="PixtralProcessor" if hub_processor else "PreTrainedTokenizerFast",
    )
    return path


def build_tiny_flux2_klein(path, distilled=False):
    """Build and save a deterministic tiny random FLUX.2 [klein] pipeline; return `path`.

    Layout of black-forest-labs/FLUX.2-klein-4B: Qwen3ForCausalLM text encoder, Qwen2 fast
    tokenizer with Qwen3's chat template, transformer without guidance embedding, and
    `is_distilled` in model_index.json. `distilled=False` is a klein *base* model (real CFG with
    guidance_scale > 1); `distilled=True` a step-distilled one (the pipeline ignores guidance_scale).
    Encode prompts with `text_encoder_out_layers=KLEIN_TEXT_ENCODER_OUT_LAYERS`.
    """
    from transformers import Qwen3ForCausalLM

    os.makedirs(path, exist_ok=True)
    transformer = _build_transformer(KLEIN_JOINT_ATTENTION_DIM, guidance_embeds=False)
    vae = _build_vae()

    tok = build_klein_tokenizer()
    assert len(tok) <= VOCAB_SIZE
    torch.manual_seed(0)
    text_encoder = Qwen3ForCausalLM(klein_text_config())

    _save_models(path, transformer, vae, text_encoder)
    tok.save_pretrained(os.path.join(path, "tokenizer"))  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    _write_model_index(path, "Flux2KleinPipeline", text_encoder="Qwen3ForCausalLM",
                       tokenizer="Qwen2TokenizerFast", is_distilled=bool(distilled))
    return path


# The tiny models' configs (benchmarks/real_shapes.py --tiny writes them too)
TRANSFORMER = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4])
VAE = dict(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
           up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(4, 8), layers_per_block=1,
           latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)


def dev_text_config():
    """Mistral-Small-3.1 (text + Pixtral vision tower), shrunk."""
    from transformers import Mistral3Config

    return Mistral3Config(
        text_config={
            "model_type": "mistral", "vocab_size": VOCAB_SIZE, "hidden_size": TEXT_HIDDEN_SIZE,
            "intermediate_size": 37, "max_position_embeddings": 512, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "rope_theta": 1e9, "sliding_window": None,
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        },
        vision_config={
            "model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4,
            "intermediate_size": 37, "image_size": 30, "patch_size": 6, "num_channels": 3,
        },
        image_token_index=IMG_ID, vision_feature_layer=-1,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )


def klein_text_config():
    """Qwen3-4B settings (tied embeddings, rope theta 1e6), shrunk."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=KLEIN_TEXT_HIDDEN_SIZE, intermediate_size=37,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=KLEIN_PAD_ID, eos_token_id=KLEIN_IM_END_ID,
    )


def _build_transformer(joint_attention_dim, guidance_embeds):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(**TRANSFORMER, joint_attention_dim=joint_attention_dim,
                                   guidance_embeds=guidance_embeds)


def _build_vae():
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(**VAE)
    # Fresh BatchNorm stats are mean 0 / var 1, which would hide a trainer that forgets the
    # latent normalisation; make them clearly non-trivial.
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) * 2.0 + 0.5)
    return vae


def _save_models(path, transformer, vae, text_encoder):
    """Save the three models and the scheduler into the Hub subfolders."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Same shift settings as the real FLUX.2 schedulers; the pipelines always pass `mu`.
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    transformer.save_pretrained(os.path.join(path, "transformer"))
    vae.save_pretrained(os.path.join(path, "vae"))
    text_encoder.save_pretrained(os.path.join(path, "text_encoder"))
    scheduler.save_pretrained(os.path.join(path, "scheduler"))


def _write_model_index(path, class_name, text_encoder, tokenizer, **pipeline_config):
    """model_index.json as DiffusionPipeline.save_pretrained writes it (sorted keys; pipeline
    config entries such as klein's `is_distilled` sit beside the components)."""
    import diffusers

    model_index = {
        "_class_name": class_name,
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", text_encoder],
        "tokenizer": ["transformers", tokenizer],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
        **pipeline_config,
    }
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump(model_index, f, indent=2, sort_keys=True)


# diffusers' FLUX.2 transformer names -> BFL's (flux2-dev.safetensors, ComfyUI's diffusion_models/ files): the inverse
# of diffusers' convert_flux2_transformer_checkpoint_to_diffusers (test_transformer_file.py loads it back through it)
BFL_NAMES = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
             "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
             "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
             "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
             "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
             "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
             "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
             "single_stream_modulation.linear": "single_stream_modulation.lin"}
BFL_DOUBLE = {"attn.norm_q.weight": "img_attn.norm.query_norm.scale", "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
              "attn.to_out.0": "img_attn.proj", "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
              "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
              "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale", "attn.to_add_out": "txt_attn.proj",
              "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
BFL_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q.weight": "norm.query_norm.scale",
              "attn.norm_k.weight": "norm.key_norm.scale"}
BFL_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
             "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}


def to_bfl(state):
    """A diffusers FLUX.2 transformer state dict -> BFL's layout: renamed, q/k/v fused, norm_out's (scale, shift)
    halves back in BFL's (shift, scale) order."""
    out, fused = {}, set()
    for name, tensor in state.items():
        parts = name.split(".")
        if parts[0] in ("transformer_blocks", "single_transformer_blocks"):
            double, block, rest = parts[0] == "transformer_blocks", parts[1], ".".join(parts[2:])
            fuse = next(((bfl, sources) for bfl, sources in BFL_FUSED.items() if double
                         and rest.rsplit(".", 1)[0] in sources), None)
            if fuse:
                kind = rest.rsplit(".", 1)[1]
                out[f"double_blocks.{block}.{fuse[0]}.{kind}"] = torch.cat(
                    [state[f"transformer_blocks.{block}.{s}.{kind}"] for s in fuse[1]])
                continue
            table = BFL_DOUBLE if double else BFL_SINGLE
            key = rest if rest in table else rest.rsplit(".", 1)[0]
            new = table[key] + ("" if rest in table else "." + rest.rsplit(".", 1)[1])
            out[f"{'double_blocks' if double else 'single_blocks'}.{block}.{new}"] = tensor
        elif name.startswith("norm_out.linear."):
            scale, shift = tensor.chunk(2, dim=0)
            out["final_layer.adaLN_modulation.1." + parts[-1]] = torch.cat([shift, scale])
        else:
            base, kind = name.rsplit(".", 1)
            out[f"{BFL_NAMES[base]}.{kind}"] = tensor
    return out


def write_bfl_transformer(folder, path, dtype=None, prefix=""):
    """The transformer of the checkpoint `folder` as one BFL-layout .safetensors file at `path` (in `dtype`; `prefix`
    before every name, e.g. ComfyUI's 'model.diffusion_model.') -> path."""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import save_file

    model = Flux2Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    state = {prefix + n: (t if dtype is None else t.to(dtype)).contiguous() for n, t in to_bfl(model.state_dict()).items()}
    save_file(state, str(path))
    return path


def make_images(folder, captions=True):
    """Write a seeded mixed-aspect image set (+ captions for most); return sorted image paths."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h, caption) in enumerate(IMAGE_SPECS):
        # Smooth colour gradients plus noise: non-constant content in every channel so the VAE
        # sees real structure, without being pure noise.
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        base = rng.uniform(0, 255, size=3)
        freq = rng.uniform(0.05, 0.3, size=3)
        img = np.stack([base[c] / 2 + 60 * np.sin(freq[c] * (xx + (c + 1) * yy)) for c in range(3)], -1)
        img = np.clip(img + rng.normal(0, 12, size=img.shape) + 64, 0, 255).astype(np.uint8)
        ext = "jpg" if i % 3 == 1 else "png"  # both formats, as in real datasets
        stem = f"img_{i:02d}"
        p = os.path.join(folder, f"{stem}.{ext}")
        Image.fromarray(img, "RGB").save(p)
        paths.append(p)
        if captions and caption:
            with open(os.path.join(folder, f"{stem}.txt"), "w", encoding="utf-8") as f:
                f.write(caption + "\n")
    with open(os.path.join(folder, "notes.md"), "w", encoding="utf-8") as f:
        f.write("Not an image: dataset loaders must skip this file.\n")
    return sorted(paths)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tiny_flux2.py OUT_DIR")
    out = sys.argv[1]
    print(build_tiny_flux2(os.path.join(out, "tiny-flux2")))
    print(build_tiny_flux2_klein(os.path.join(out, "tiny-flux2-klein")))
    make_images(os.path.join(out, "images"))
    print(os.path.join(out, "images"))
