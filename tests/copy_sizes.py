"""README.md's "Copy and edit" sizes: the lines of the copies --write_copy makes without options and with the diffusers
example's scope, and of the full script, measured by the script's own trimmer.

    python tests/copy_sizes.py            # print the table
    python tests/copy_sizes.py --write    # put it into README.md, and the options into the script's reading map

tests/test_copies.py fails while README.md's table is stale, tests/test_parts.py while the reading map is.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train_dreambooth_lora_flux2 as T  # noqa: E402

README = ROOT / "README.md"
START = "<!-- copy sizes: tests/copy_sizes.py --write -->"
END = "<!-- end of the copy sizes -->"


def copy_lines(keep):
    """Lines of the copy `--keep keep` writes (its header included)."""
    options = {o.name: [n for names, _ in o.flags for n in names] for o in T.OPTIONS}
    names = [n for n in options if keep == "all" or n in T.OPTION_SETS.get(keep, ())]
    names = [n for n in options if n in names or any(n in o.needs for o in T.OPTIONS if o.name in names)]
    source = (ROOT / "train_dreambooth_lora_flux2.py").read_text(encoding="utf-8")
    return len(T.trimmed_source(source, options, names, T.copy_header(names, T.VERSION, "0" * 12)).splitlines())


def render():
    diffusers = ", ".join(T.OPTION_SETS["diffusers"])
    rows = [("`--keep none` (the default): Parts 1 and 2", copy_lines("none")),
            (f"`--keep diffusers`: {diffusers}", copy_lines("diffusers")),
            ("the full script (`--keep all`)", len((ROOT / "train_dreambooth_lora_flux2.py").read_text().splitlines()))]
    return "\n".join([START, "| copy | lines |", "|---|---|", *(f"| {what} | {n:,} |" for what, n in rows), END])


if __name__ == "__main__":
    table = render()
    print(table)
    if "--write" in sys.argv[1:]:
        text = README.read_text(encoding="utf-8")
        start, end = text.index(START), text.index(END) + len(END)
        README.write_text(text[:start] + table + text[end:], encoding="utf-8")
        script = ROOT / "train_dreambooth_lora_flux2.py"
        script.write_text(T.reading_map(script.read_text(encoding="utf-8"), [o.name for o in T.OPTIONS]),
                          encoding="utf-8")
        print(f"wrote {README} and the reading map of {script.name}")
