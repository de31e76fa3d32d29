"""README.md's table "What --memory_plan auto chooses": the plan of the README's first command for FLUX.2 [klein] 4B,
[klein] 9B and [dev] on cards of 16 to 141 GB, made by the script's own planner (`make_plan`, what --plan_only
prints) from config-only checkpoint folders of the real architectures (real_shapes.py --configs_only): no weights,
no GPU, about 20 s.

    python benchmarks/plan_table.py            # print the table
    python benchmarks/plan_table.py --write    # and put it into README.md (a test fails while the README's is stale)

The host RAM each card is planned with is twice the card's memory, at least 64 GB (what machines with such cards
usually hold); the plan's other inputs are the command's flags.
"""

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import train_dreambooth_lora_flux2 as T  # noqa: E402
from gpu_check import readme_command, set_flags  # noqa: E402 - the README's first command, parsed
from real_shapes import SPECS, write  # noqa: E402

CARDS = (16, 24, 32, 48, 80, 141)  # GB: consumer 16 and 24, RTX 5090 32, A6000/L40S 48, A100/H100 80, H200 141
MODELS = {"klein4b": ("[klein] 4B", "black-forest-labs/FLUX.2-klein-base-4B"),
          "klein9b": ("[klein] 9B", "black-forest-labs/FLUX.2-klein-base-9B"),
          "dev": ("[dev]", "black-forest-labs/FLUX.2-dev")}
START = "<!-- plan table: benchmarks/plan_table.py --write -->"
END = "<!-- end of the plan table -->"


def host_gb(card):
    return max(64, 2 * card)


def plans(work):
    """{(model, card GB): (report lines, chosen PlanRow or None, text-encoder choice)} for the README command."""
    from accelerate import PartialState

    PartialState()
    images = Path(work, "images")
    images.mkdir(parents=True, exist_ok=True)
    found = {}
    for model in MODELS:
        folder = write(SPECS[model], Path(work, model), "meta", configs_only=True, say=lambda *_: None)
        args = T.parse_args(set_flags(readme_command(), pretrained_model_name_or_path=str(folder),
                                      instance_data_dir=str(images), output_dir=str(Path(work, "out")),
                                      memory_plan="auto", plan_only=True))
        family = T.detect_family(args)
        estimate, text_size = T.run_estimate(args, torch.bfloat16), T.text_encoder_size(args, family)
        for card in CARDS:
            found[model, card] = T.make_plan(args, family.name, card * T.GIB, host_gb(card) * T.GIB, estimate,
                                             text_size, torch.bfloat16)
    return found


def adds(chosen, text_choice):
    return f"`{T.plan_flags(chosen, text_choice)}`" if T.plan_flags(chosen, text_choice) else "nothing"


def table(found):
    lines = [START, "",
             "| Model | Card | Host RAM | `--memory_plan auto` adds | Peak GPU memory | Text encoder | Step time |",
             "|---|---|---|---|---|---|---|"]
    for (model, card), (report, chosen, text_choice) in found.items():
        name = MODELS[model][0]
        if chosen is None:
            smallest = re.search(r"the smallest card that fits is (\d+) GB", report[-1])
            lines.append(f"| {name} | {card} GB | {host_gb(card)} GB | does not fit"
                         f"{f': {smallest.group(1)} GB does' if smallest else ''} | | | |")
            continue
        label = "bf16" if text_choice in (None, "none") else text_choice
        text = re.search(rf"text encoder \({label}\): ([\d.]+) GiB", "\n".join(report)).group(1)
        estimated = " (estimated)" * (chosen.quant == "int8")  # 8-bit weights' step: not measured on a GPU yet
        lines.append(f"| {name} | {card} GB | {host_gb(card)} GB | {adds(chosen, text_choice)} | "
                     f"{chosen.peak / T.GIB:.1f} GiB | {label}, {text} GiB | {chosen.cost:.2f}x{estimated} |")
    return "\n".join(lines + ["", END])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        text = table(plans(work))
    print(text)
    if args.write:
        readme = HERE.parent / "README.md"
        old = readme.read_text(encoding="utf-8")
        start, end = old.index(START), old.index(END) + len(END)
        readme.write_text(old[:start] + text + old[end:], encoding="utf-8")


if __name__ == "__main__":
    main()
