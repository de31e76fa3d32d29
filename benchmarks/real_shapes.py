"""Random-weight FLUX.2 checkpoints of the real architectures, written as the Hub's folders, so the whole script runs
on real shapes where no model can be downloaded (CPU proofs, offline GPU machines).

    python benchmarks/real_shapes.py klein4b OUT     # FLUX.2 [klein] base 4B: 3.9 B transformer + Qwen3 4B, 16 GB
    python benchmarks/real_shapes.py klein9b OUT     # [klein] 9B: 9 B + Qwen3 8B, 35 GB
    python benchmarks/real_shapes.py dev OUT         # [dev]: 32 B + Mistral Small 3.1 24B, 112 GB
    python benchmarks/real_shapes.py --tiny klein4b OUT   # the tests' tiny model of that family, through this code

OUT gets transformer/, text_encoder/, vae/ (AutoencoderKLFlux2's defaults are the real VAE), scheduler/, tokenizer/,
model_index.json and real_shapes.json (this tool's mark), the models written with save_pretrained in shards of
--shard_size, so the script loads the folder exactly as it loads black-forest-labs/FLUX.2-klein-base-4B or FLUX.2-dev.
This module owns the real shapes (gpu_step.py imports them): the transformers' configs (../shared/GPU.md); the text
encoders carry the real models' configs (layer counts, widths, vocabulary); the tokenizer is the tests' offline BPE
with the real chat template's structure (its ids fit any vocabulary).
Weights are made directly on --device in --dtype (no float32 copy) one model at a time, each freed before the next:
klein4b on a 2-core CPU took 121 s at a peak RSS of 16.6 GB (the largest model and the copy save_pretrained writes
from), 32 s on an H200.

OUT must be new, empty, or a folder this tool wrote (its mark): then its parts are written again from scratch. A
folder of other files (a real checkpoint: new configs over its weights would break it) is refused unless --overwrite
(written over); so are OUT as a file, a --shard_size save_pretrained cannot read and a --device this
machine lacks, each before anything is written (exit 2).
"""

import argparse
import gc
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
import tiny_flux2 as tiny  # noqa: E402 - the offline tokenizers, the model index and the tests' tiny configs

MARK = "real_shapes.json"  # in OUT: this tool wrote the folder, so it may write it again
PARTS = ("transformer", "text_encoder", "vae", "scheduler", "tokenizer")

COMMON = dict(patch_size=1, in_channels=128, attention_head_dim=128, mlp_ratio=3.0, timestep_guidance_channels=256,
              axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6)
TRANSFORMERS = {  # Flux2Transformer2DModel's configs of the published checkpoints
    "klein4b": dict(COMMON, num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                    guidance_embeds=False),
    "klein9b": dict(COMMON, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                    guidance_embeds=False),
    "dev": dict(COMMON, num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360,
                guidance_embeds=True),
}


def qwen3(hidden, intermediate, tied, layers=36):
    """Qwen3 4B / 8B (the [klein] text encoders): 36 layers, 32 query and 8 key-value heads of 128, 151,936 tokens."""
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, tie_word_embeddings=tied,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       bos_token_id=tiny.KLEIN_PAD_ID, eos_token_id=tiny.KLEIN_IM_END_ID)


def mistral_small():
    """Mistral Small 3.1 24B (the [dev] text encoder): 40 layers of 5,120, 131,072 tokens, Pixtral vision tower."""
    from transformers import Mistral3Config
    return Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                         num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
                         tie_word_embeddings=False, bos_token_id=tiny.BOS_ID, eos_token_id=tiny.EOS_ID,
                         pad_token_id=tiny.PAD_ID),
        vision_config=dict(model_type="pixtral", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                           intermediate_size=4096, image_size=1540, patch_size=14, num_channels=3, head_dim=64,
                           rope_theta=10000.0),
        image_token_index=tiny.IMG_ID, spatial_merge_size=2, multimodal_projector_bias=False,
        projector_hidden_act="gelu", vision_feature_layer=-1, tie_word_embeddings=False,
        bos_token_id=tiny.BOS_ID, eos_token_id=tiny.EOS_ID, pad_token_id=tiny.PAD_ID)


@dataclass
class Spec:
    pipeline: str            # model_index.json's _class_name
    transformer: dict        # Flux2Transformer2DModel's config
    text_encoder: str        # the transformers class
    text_config: object      # () -> its config
    vae: dict                # AutoencoderKLFlux2's config ({}: the real one)
    out_layers: tuple        # the script's --text_encoder_out_layers for this checkpoint (the family's default)


SPECS = {
    "klein4b": Spec("Flux2KleinPipeline", TRANSFORMERS["klein4b"], "Qwen3ForCausalLM",
                    lambda: qwen3(2560, 9728, True), {}, (9, 18, 27)),
    "klein9b": Spec("Flux2KleinPipeline", TRANSFORMERS["klein9b"], "Qwen3ForCausalLM",
                    lambda: qwen3(4096, 12288, False), {}, (9, 18, 27)),
    "dev": Spec("Flux2Pipeline", TRANSFORMERS["dev"], "Mistral3ForConditionalGeneration", mistral_small, {},
                (10, 20, 30)),
}
TINY = {  # the tests' tiny_flux2.py models, same configs
    "klein4b": Spec("Flux2KleinPipeline", dict(tiny.TRANSFORMER, joint_attention_dim=tiny.KLEIN_JOINT_ATTENTION_DIM,
                                              guidance_embeds=False),
                    "Qwen3ForCausalLM", tiny.klein_text_config, tiny.VAE, tiny.KLEIN_TEXT_ENCODER_OUT_LAYERS),
    "dev": Spec("Flux2Pipeline", dict(tiny.TRANSFORMER, joint_attention_dim=tiny.JOINT_ATTENTION_DIM,
                                      guidance_embeds=True),
                "Mistral3ForConditionalGeneration", tiny.dev_text_config, tiny.VAE, tiny.TEXT_ENCODER_OUT_LAYERS),
}
TINY["klein9b"] = TINY["klein4b"]


def made_on(device, dtype, build):
    """build() with its tensors created on `device` in `dtype`: no float32 copy, no host round trip."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return build()
    finally:
        torch.set_default_dtype(previous)


def build_transformer(config, device, dtype):
    """A random Flux2Transformer2DModel of `config`, made on `device` in `dtype`."""
    from diffusers import Flux2Transformer2DModel
    return made_on(device, dtype, lambda: Flux2Transformer2DModel(**config))


def save(model, folder, shard_size):
    """save_pretrained in shards, then free the model (the next one is made in its place)."""
    model.save_pretrained(folder, max_shard_size=shard_size)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write(spec, out, device, dtype=torch.bfloat16, shard_size="5GB", say=print, configs_only=False):
    """The checkpoint folder of `spec` at `out` -> out. configs_only: every file but the weights (what
    --memory_plan auto --plan_only reads), in a second."""
    import transformers
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler

    out, device = Path(out), "meta" if configs_only else device
    out.mkdir(parents=True, exist_ok=True)
    if (out / MARK).exists():  # written here before: no weights of another model (or configs_only's none) stay
        for part in PARTS:
            shutil.rmtree(out / part, ignore_errors=True)
    (out / MARK).write_text(json.dumps(dict(pipeline=spec.pipeline, configs_only=configs_only)) + "\n")
    torch.manual_seed(0)
    parts = (("transformer", lambda: build_transformer(spec.transformer, device, dtype)),
             ("text_encoder", lambda: made_on(device, dtype, lambda: getattr(transformers, spec.text_encoder)(
                 spec.text_config()))),
             ("vae", lambda: made_on(device, dtype, lambda: vae_with_statistics(AutoencoderKLFlux2(**spec.vae)))))
    for name, build in parts if configs_only else ():
        if name == "text_encoder":  # its config alone: a 24 B model takes seconds to make even on the meta device
            spec.text_config().save_pretrained(out / name)
        else:
            build().save_config(out / name)
    for name, build in () if configs_only else parts:
        start = time.perf_counter()
        model = build()
        count = sum(p.numel() for p in model.parameters())
        save(model, out / name, shard_size)
        say(f"{name}: {count / 1e9:.2f} B parameters, {folder_bytes(out / name) / 1e9:.2f} GB, "
            f"{time.perf_counter() - start:.0f} s")
    # The FLUX.2 scheduler: flow matching, shift 3, the pipelines pass the resolution's mu
    FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True).save_pretrained(out / "scheduler")
    if spec.pipeline == "Flux2KleinPipeline":
        tiny.build_klein_tokenizer().save_pretrained(out / "tokenizer")
        tiny._write_model_index(str(out), spec.pipeline, text_encoder=spec.text_encoder,
                                tokenizer="Qwen2TokenizerFast", is_distilled=False)
    else:
        tiny._save_tokenizer(tiny.build_tokenizer(), str(out / "tokenizer"))
        tiny._write_model_index(str(out), spec.pipeline, text_encoder=spec.text_encoder, tokenizer="PixtralProcessor")
    return out


def vae_with_statistics(vae):
    """Latent statistics away from mean 0 / variance 1, as a trained VAE's are, so a trainer that skips the latent
    normalisation computes something else."""
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) * 2.0 + 0.5)
    return vae


def folder_bytes(folder):
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def shard_size(text):
    """--shard_size as huggingface_hub reads save_pretrained's max_shard_size: a number > 0, then KB, MB, GB or TB."""
    if not re.fullmatch(r"\s*\d+(\.\d*)?\s*[KMGT]B\s*", text, flags=re.I) or float(text.strip()[:-2]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 5GB, 500MB or 20KB")
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", choices=sorted(SPECS))
    p.add_argument("out", help="the checkpoint folder to write (pass it as --pretrained_model_name_or_path): new, "
                   "empty, or one this tool wrote (its parts are replaced)")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny model of that family (CI, seconds)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the weights are made (default: cuda when there is one)")
    p.add_argument("--configs_only", action="store_true", help="no weights: enough for --plan_only")
    p.add_argument("--shard_size", default="5GB", type=shard_size,
                   help="the largest weight file (save_pretrained's max_shard_size)")
    p.add_argument("--overwrite", action="store_true", help="write into OUT although it holds files of another origin")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"OUT {args.out}: a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARK).exists() and not args.overwrite:
        p.error(f"OUT {args.out}: the folder holds files this tool did not write (a checkpoint's would be broken); "
                "give a new or empty folder, or --overwrite")
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError) as e:  # AssertionError: a torch built without CUDA
        p.error(f"--device {args.device}: {str(e).splitlines()[0]}")
    spec = (TINY if args.tiny else SPECS)[args.model]
    start = time.perf_counter()
    write(spec, args.out, args.device, shard_size=args.shard_size, configs_only=args.configs_only)
    print(f"{args.out}: {folder_bytes(args.out) / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s; train with "
          f"--text_encoder_out_layers {' '.join(map(str, spec.out_layers))}")


if __name__ == "__main__":
    main()
