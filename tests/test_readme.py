"""The README and the module docstring give commands a user copies: each parses with the script's own parser, the
docstring's agree with the README's, every command the README places on a 24 GB card is one the memory estimate says
fits there, and the README's install words are what the Makefile and CI run."""

import re
import sys

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
    assert len(readme) >= 4 and len(docstring) == 1
    for flags in readme + docstring:
        _parse(flags)


def test_the_docstrings_commands_are_the_readmes(user_folder):
    (klein,) = commands(T.__doc__)
    first = commands(sections(README)["train-your-first-lora"])
    assert len(first) == 1 and _parse(klein) == _parse(first[0])
    # the docstring's [dev] command: "the same flags with" the [dev] checkpoint and output folder, on an 80 GB card
    said = re.search(r"FLUX\.2 \[dev\] on an 80 GB GPU: the same flags with --pretrained_model_name_or_path (\S+) and\s+"
                     r"--output_dir (\S+) ", T.__doc__)
    dev = [said.group(1) if f == "black-forest-labs/FLUX.2-klein-base-4B" else said.group(2)
           if f == "flux2-klein-dog-lora" else f for f in klein]
    (readme_dev,) = commands(sections(README)["dev-on-an-80-gb-card"])
    assert _parse(dev) == _parse(readme_dev)


def _row(flags):
    """A README command -> benchmarks/gpu_step.py's row for the memory estimate."""
    args = T.parse_args(flags)
    model = {"4B": "klein4b", "9B": "klein9b"}.get(re.search(r"(\dB)?$", args.pretrained_model_name_or_path).group(1), "dev")
    precision = "nf4" if args.bnb_quantization_config_path else "fp8" if args.do_fp8_training else "bf16"
    return args, dict(model=model, mode="compile" if args.compile else "eager", attention=args.attention_backend,
                      gc="on" if args.gradient_checkpointing else "off", resolution=args.resolution,
                      batch=args.train_batch_size, precision=precision, swap=str(args.blocks_to_swap),
                      references=int(bool(args.cond_data_dir or args.cond_image_column)), baseline=False)


def test_every_command_the_readme_places_on_a_24_gb_card_fits_one_by_the_memory_estimate(user_folder):
    from accelerate import PartialState

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_step

    PartialState()
    table = [row for row in README.splitlines() if re.match(r"\| [^|]+ \| 24 GB \|", row)]
    anchors = [re.search(r"\]\(#([\w-]+)\)", row).group(1) for row in table]
    assert len(anchors) >= 2  # [klein] and [dev]
    for anchor in anchors:
        (flags,) = commands(sections(README)[anchor])
        args, row = _row(flags)
        peak = gpu_step.estimate(row, gpu_step.MODELS[row["model"]], args.rank, args.max_sequence_length,
                                 args.lora_layers)["run_gib"]
        assert 24 in gpu_step.fits(peak), (anchor, peak)
        if not args.remote_text_encoder:  # precompute holds the text encoder first: it must fit as well
            encoder = gpu_step.text_encoder_gib(row["model"], args.text_encoder_quantization)
            assert 24 in gpu_step.fits(encoder), (anchor, args.text_encoder_quantization, encoder)


def test_the_readmes_install_words_are_what_the_makefile_and_ci_run():
    install = sections(README)["install"]
    assert "pip install -r requirements.txt" in install and "make install" in install and "accelerate config default" in install
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(VENV\)/\.installed:.*?\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert "pip install -r requirements.txt" in recipe and "tests/requirements.txt" not in recipe  # no test tools
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make install$", ci, flags=re.M) and re.search(r"^make test$", ci, flags=re.M)
    assert "make test" in README


def _without(flags, *drop):
    """A command minus some flags (and their values: a flag is dropped with the words up to the next flag)."""
    out, skipping = [], False
    for word in flags:
        if word.startswith("--"):
            skipping = word in drop
        if not skipping:
            out.append(word)
    return out


def test_the_commands_the_readme_describes_as_changes_parse_and_fit_their_card(user_folder):
    """48 GB rows are written as changes to a command above: applied, they parse and fit 48 GB (the training step
    and, for [dev], the text encoder while prompts are encoded)."""
    from accelerate import PartialState

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_step

    PartialState()
    (first,) = commands(sections(README)["train-your-first-lora"])
    (dev24,) = commands(sections(README)["dev-on-a-24-gb-card"])
    assert "without `--gradient_checkpointing`" in sections(README)["klein-4b-on-a-48-or-80-gb-card"]
    assert "without `--blocks_to_swap 28`, and with `--text_encoder_quantization int8`" in " ".join(
        sections(README)["dev-on-a-48-gb-card"].split())
    klein48 = _without(first, "--gradient_checkpointing")
    dev48 = ["int8" if w == "nf4" else w for w in _without(dev24, "--blocks_to_swap")]
    for flags in (klein48, dev48):
        args, row = _row(flags)
        peak = gpu_step.estimate(row, gpu_step.MODELS[row["model"]], args.rank, args.max_sequence_length,
                                 args.lora_layers)["run_gib"]
        encoder = gpu_step.text_encoder_gib(row["model"], args.text_encoder_quantization)
        assert 48 in gpu_step.fits(peak) and 48 in gpu_step.fits(encoder), (flags, peak, encoder)
