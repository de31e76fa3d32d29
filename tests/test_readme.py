"""The README and the module docstring give commands a user copies: each parses with the script's own parser, the
docstring's agree with the README's, and the README's install words are what the Makefile and CI run. (What the
commands need of each card is README's plan table: test_plan.py.)"""

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
    """What the commands name, made where they are run: the dog photos, the NF4 config, the edit's photo."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    (tmp_path / "dog").mkdir()
    (tmp_path / "nf4.json").write_text('{"load_in_4bit": true, "bnb_4bit_quant_type": "nf4"}')
    Image.new("RGB", (512, 512)).save(tmp_path / "photo.jpg")
    return tmp_path


def _parse(flags):
    return vars(T.parse_args(flags))


def test_every_command_in_the_readme_and_the_docstring_parses(user_folder):
    readme, docstring = commands(README), commands(T.__doc__)
    assert len(readme) >= 3 and len(docstring) == 1  # [klein], [dev], the edit LoRA
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
