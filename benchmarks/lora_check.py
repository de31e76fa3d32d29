"""Does a LoRA file fit a checkpoint? diffusers' own loader applies it to the checkpoint's transformer, and every
tensor of the file must land on a module of the right shape (used on the CPU proof's LoRA: docs/speed.md).

    python benchmarks/lora_check.py CHECKPOINT_FOLDER LORA_FILE     # exit 0 and one line when it fits
"""

import sys

import torch
from safetensors import safe_open


def check(model, lora):
    """-> (tensors in the file, LoRA modules the loader made, problems: [str])."""
    import diffusers
    import json
    from pathlib import Path

    pipeline = getattr(diffusers, json.loads((Path(model) / "model_index.json").read_text())["_class_name"])
    with safe_open(lora, "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    transformer = diffusers.Flux2Transformer2DModel.from_pretrained(model, subfolder="transformer",
                                                                    torch_dtype=torch.bfloat16)
    pipe = pipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                    transformer=transformer)
    pipe.load_lora_weights(lora)
    modules = {n: m for n, m in transformer.named_modules() if hasattr(m, "lora_A") and m.lora_A}
    problems = []
    for name, module in modules.items():
        (a,), (b,) = module.lora_A.values(), module.lora_B.values()
        base = module.base_layer
        if shapes.get(f"transformer.{name}.lora_A.weight") != (a.weight.shape[0], base.in_features):
            problems.append(f"{name}.lora_A")
        if shapes.get(f"transformer.{name}.lora_B.weight") != (base.out_features, b.weight.shape[1]):
            problems.append(f"{name}.lora_B")
    if 2 * len(modules) != len(shapes):
        problems.append(f"{len(shapes)} tensors in the file, {2 * len(modules)} applied")
    return len(shapes), len(modules), problems


if __name__ == "__main__":
    tensors, modules, problems = check(*sys.argv[1:3])
    print(f"{tensors} tensors onto {modules} modules of {sys.argv[1]}: " + ("; ".join(problems) or "all fit"))
    sys.exit(1 if problems else 0)
