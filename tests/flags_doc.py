"""docs/flags.md, generated from the script's parser: every flag, what it accepts, its default and its help.

Run `python tests/flags_doc.py` (or `make docs`) after changing a flag; tests/test_flags.py fails while the file is stale.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train_dreambooth_lora_flux2 as T  # noqa: E402

DOC = ROOT / "docs" / "flags.md"


def accepts(action):
    if isinstance(action, argparse._StoreTrueAction):  # a --config file's true is undone by `--flag false`
        return "on or off (a switch: bare or true, or false)"
    if isinstance(action.type, T.Accepts):
        return action.type.what
    if action.choices:
        return "one of " + ", ".join(action.choices)
    return "any text"


def cell(text):
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def render():
    parser = T.build_parser()
    lines = ["# Flags", "", "[README](../README.md) · Every flag of `train_dreambooth_lora_flux2.py`, what it accepts and its "
             "default, generated from the script's parser by `python tests/flags_doc.py` (do not edit by hand). A value a "
             "flag does not accept ends the run before anything loads: one line naming the flag and the value, exit "
             "status 2. Checks that combine flags are in the script's `validate_args`.", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.dest != "help"]
        if not actions:
            continue
        lines += [f"## {group.title}", "", "| Flag | Accepts | Default | What it does |", "|---|---|---|---|"]
        for a in actions:
            default = "required" if a.required else "" if a.default is None or a.default is False else f"`{a.default}`"
            lines.append(f"| `{a.option_strings[0]}` | {cell(accepts(a))} | {cell(default)} | {cell(a.help)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    DOC.write_text(render(), encoding="utf-8")
    print(f"wrote {DOC}")
