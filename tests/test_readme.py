"""The README and the module docstring give commands a user copies: each parses with the script's own parser, the
docstring's agree with the README's, and the README's install words are what the Makefile and CI run. The README stays
a short user's page (issue 60: at most 340 lines, its prose within 120 columns, every relative link of it and of docs/
resolving). (What the commands need of each card is README's plan table: test_plan.py.)"""

import re

import pytest

import train_dreambooth_lora_flux2 as T
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def commands(text):
    """Each `accelerate launch train_dreambooth_lora_flux2.py ...` in `text` -> its flags (continuations joined)."""
    found = []
    for block in re.findall(r"accelerate launch train_dreambooth_lora_flux2\.py((?:[^\n]*\\\n)*[^\n]*)", text):
        found.append(shlex_split(block.replace("\\\n", " ")))
    return found


def shlex_split(line):
    import shlex

    return shlex.split(line.split("  #")[0])


def sections(text):
    """{GitHub anchor of a heading: the text under it, up to the next heading}."""
    parts = re.split(r"^#{2,3} (.+)$", text, flags=re.M)
    anchor = lambda title: re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")  # noqa: E731
    return {anchor(title): body for title, body in zip(parts[1::2], parts[2::2])}


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """What the commands name, made where they are run: the dog photos, the NF4 config, the edits' photos and the
    several-reference edit's folders."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    for folder in ("dog", "tryon/result", "tryon/person", "tryon/garment"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "nf4.json").write_text('{"load_in_4bit": true, "bnb_4bit_quant_type": "nf4"}')
    for photo in ("photo.jpg", "me.jpg", "shirt.jpg"):
        Image.new("RGB", (512, 512)).save(tmp_path / photo)
    return tmp_path


def _parse(flags):
    return vars(T.parse_args(flags))


def test_every_command_in_the_readme_and_the_docstring_parses(user_folder):
    readme, docstring = commands(README), commands(T.__doc__)
    assert len(readme) >= 4 and len(docstring) == 1  # [klein], [dev], the edit LoRAs (one and several references)
    for flags in readme + docstring:
        _parse(flags)


def test_the_docstrings_commands_are_the_readmes(user_folder):
    (klein,) = commands(T.__doc__)
    first = commands(sections(README)["train-your-first-lora"])
    assert len(first) == 1 and _parse(klein) == _parse(first[0])
    # the docstring's [dev] command: "the same flags with" the [dev] checkpoint and output folder
    said = re.search(r"FLUX\.2 \[dev\]: the same flags with --pretrained_model_name_or_path (\S+) and\s+"
                     r"--output_dir (\S+) ", T.__doc__)
    dev = [said.group(1) if f == "black-forest-labs/FLUX.2-klein-base-4B" else said.group(2)
           if f == "flux2-klein-dog-lora" else f for f in klein]
    (readme_dev,) = commands(sections(README)["flux2-dev"])
    assert _parse(dev) == _parse(readme_dev)


def test_the_readmes_install_words_are_what_the_makefile_and_ci_run():
    install = sections(README)["install"]
    assert "pip install -r requirements.txt" in install and "make install" in install and "accelerate config default" in install
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(VENV\)/\.installed:.*?\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert "pip install -r requirements.txt" in recipe and "tests/requirements.txt" not in recipe  # no test tools
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make install$", ci, flags=re.M) and re.search(r"^make test$", ci, flags=re.M)
    assert "make test" in README


def test_the_readmes_dev_commands_train_at_embedded_guidance_1(user_folder):
    """Issue 60: every [dev] command trains at guidance 1, as the diffusers README's [dev] commands do (the parser's
    default, so the [dev] command need not pass it); validation keeps the pipeline's own."""
    dev = [_parse(flags) for flags in commands(README) if "black-forest-labs/FLUX.2-dev" in flags]
    assert len(dev) >= 2  # the DreamBooth command and the relighting edit
    assert all(args["guidance_scale"] == 1.0 and args["validation_guidance_scale"] is None for args in dev)


def test_the_readmes_edit_section_gives_a_several_reference_command(user_folder):
    """Issue 60: a folder per reference (in reference order) and one validation image per folder."""
    edit = [_parse(flags) for flags in commands(sections(README)["training-an-edit-image-to-image-lora"])]
    several = [args for args in edit if len(args["cond_data_dir"] or []) >= 2]
    assert several and all(len(args["validation_image"]) == len(args["cond_data_dir"]) for args in several)


def test_the_readme_is_a_short_page():
    """Issue 60: at most 340 lines; its prose (not table rows, which Markdown cannot wrap) within 120 columns; what
    it says of single-file checkpoints links to the page with the detail."""
    lines = README.splitlines()
    assert len(lines) <= 340, f"README.md has {len(lines)} lines: move detail to docs/"
    assert [n for n, line in enumerate(lines, 1) if len(line) > 120 and not line.startswith("|")] == []
    assert "--transformer_file" in README and "docs/models.md#a-transformer-from-one-file" in README


def _anchors(path):
    """GitHub's anchors of a Markdown file's headings (lowercased, punctuation but - and _ dropped, spaces -)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """A link to a file or a heading that moved is found here, not by a reader."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):
                continue
            target, _, anchor = link.partition("#")
            path = (page.parent / target) if target else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert broken == []
