"""--memory_plan auto (issue 36): the plan for FLUX.2 [klein] 4B, [klein] 9B and [dev] on cards of 16 to 141 GB,
made from config-only folders of the real architectures (benchmarks/real_shapes.py --configs_only: no weights, no
GPU), is README.md's table; each plan fits its card, more memory never gives a slower plan, flags the user set are
kept, a card nothing fits is refused with the smallest one that would; --plan_only prints it and stops; and on the
tiny model a planned run trains the same LoRA, bit for bit, as the flags the plan printed."""

import inspect
import json
import os
import re
import sys
import unittest.mock

import pytest
import torch
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import ROOT, base_args, launch

sys.path.insert(0, str(ROOT / "benchmarks"))
import plan_table  # noqa: E402

README = (ROOT / "README.md").read_text(encoding="utf-8")
GIB = T.GIB


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """{(model, card GB): (report, chosen, text encoder)} for the README's first command; the config folders."""
    from tests.tiny_flux2 import make_images

    work = tmp_path_factory.mktemp("plans")
    make_images(str(work / "images"))  # what --instance_data_dir must hold; the plan reads none of them
    return plan_table.plans(work), work


def _command(work, model, *extra):
    """The README's first command on a config-only folder, with --memory_plan auto (as written) and `extra`."""
    return plan_table.set_flags(plan_table.readme_command(), pretrained_model_name_or_path=str(work / model),
                                instance_data_dir=str(work / "images"), output_dir=str(work / "out")) + list(extra)


def test_the_readmes_table_is_what_the_plan_chooses(planned):
    found, _ = planned
    start, end = README.index(plan_table.START), README.index(plan_table.END) + len(plan_table.END)
    assert README[start:end] == plan_table.table(found), "stale: run python benchmarks/plan_table.py --write"
    assert "--memory_plan auto" in " ".join(plan_table.readme_command())


def test_each_plan_fits_its_card_and_more_memory_never_gives_a_slower_plan(planned):
    found, _ = planned
    for model in plan_table.MODELS:
        previous = None
        for card in plan_table.CARDS:
            report, chosen, text = found[model, card]
            if chosen is None:  # only [dev] on 16 GB: its NF4 text encoder alone needs 18.4 GiB with the margin
                assert (model, card) == ("dev", 16) and "the smallest card that fits is 24 GB" in report[-1]
                continue
            assert chosen.peak * 1.1 + 1.5 * GIB <= card * GIB and chosen.host <= 0.8 * plan_table.host_gb(card) * GIB
            label = "bf16" if text == "none" else text
            text_peak = float(re.search(rf"text encoder \({label}\): ([\d.]+) GiB", "\n".join(report))[1])
            assert text_peak * 1.1 + 1.5 <= card + 0.1  # (one decimal printed)
            rank = (chosen.quant is not None, chosen.cost)  # full precision first, then the fastest
            assert previous is None or rank <= previous, (model, card, rank, previous)
            previous = rank
    # what the margins make of the real models
    assert found["klein4b", 24][1].checkpointing and not found["klein4b", 48][1].checkpointing
    assert (found["dev", 24][1].quant, found["dev", 24][2]) == ("int8", "nf4") and found["dev", 24][1].swap > 0
    assert found["dev", 80][1].quant is None and found["dev", 80][1].swap == 0



def test_8bit_weights_come_after_bf16_and_before_nf4(planned):
    """Issue 61: where no bf16 setting fits and 8-bit weights (--transformer_quantization int8) do, the plan takes
    them before NF4 ([dev] on 24 and 32 GB took NF4 before), its rows saying their step cost is estimated; where bf16
    fits, with swapping too ([klein] 9B on 16 GB, [dev] on 48 GB), bf16 stays, and the rows show 8-bit's alternative
    (no block swapped, an estimated step cost above bf16's swapping)."""
    found, _ = planned
    for card, swapped in ((24, 40), (32, 25)):
        report, chosen, _ = found["dev", card]
        printed = "\n".join(report)
        assert (chosen.quant, chosen.swap) == ("int8", swapped) and "--transformer_quantization int8" in report[-1]
        assert re.search(r"^  bf16 +on +off +none fits ", printed, flags=re.M)  # bf16 does not fit, swapped or not
        assert re.search(r"^  nf4 +on +off +\d+ +[\d.]+ +[\d.]+ +1\.2\dx$", printed, flags=re.M)  # NF4 fits, costs more
        assert re.search(r"^  int8 +on +off +\d+ .* \(estimated\)  <- chosen$", printed, flags=re.M), printed
    for model, card in (("klein9b", 16), ("dev", 48)):
        report, chosen, _ = found[model, card]
        assert chosen.quant is None and chosen.swap > 0
        assert re.search(r"^  int8 +on +off +0 +[\d.]+ +[\d.]+ +1\.10x \(estimated\)$", "\n".join(report), flags=re.M)


def test_the_24_and_48_gb_plans_ran_on_a_gpu_near_their_estimate(planned):
    """benchmarks/gpu_check.sh on an H200 (2026-11-26) ran the README's first command on real [klein] 4B shapes with
    the GPU cut to 24 and to 48 GB (torch.cuda.set_per_process_memory_fraction, --gpu_memory): each ran the flags
    planned here, peaked within 10% of the planned peak, and within the card with the plan's margin. Those runs made
    their validation images one at a time: their peak is the plan's with --validation_batch 1 (a prompt's four images
    in one call are estimated, not yet measured on a GPU)."""
    found, work = planned
    for card, flags, allocated, reserved in ((24, "--gradient_checkpointing", 10.91, 13.17), (48, "", 22.71, 26.49)):
        _, chosen, text = found["klein4b", card]
        assert T.plan_flags(chosen._replace(compiled=False), text) == flags  # (compiled: the same memory)
        args = T.parse_args(_command(work, "klein4b", "--gpu_memory", f"{card}GB", "--validation_batch", "1"))
        _, measured, _ = T.make_plan(args, "klein4b", card * GIB, 64 * GIB, T.run_estimate(args, torch.bfloat16),
                                     T.text_encoder_size(args, T.detect_family(args)), torch.bfloat16)
        assert measured.peak / GIB == pytest.approx(allocated, rel=0.1) and measured.peak <= chosen.peak
        assert T.fits_card(allocated * GIB, card * GIB) and reserved < card

def test_plan_only_prints_every_candidate_and_the_flags_then_stops(planned, monkeypatch, capsys, fresh_accelerate):
    found, work = planned
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for model, card in (("dev", 24), ("klein4b", 80)):
        with pytest.raises(SystemExit) as stop:
            T.main(_command(work, model, "--gpu_memory", f"{card}GB", "--host_memory", f"{plan_table.host_gb(card)}GB",
                            "--plan_only"))
        assert stop.value.code == 0
        printed = capsys.readouterr().out
        report, chosen, text = found[model, card]
        assert printed.strip().splitlines() == report
        assert f"flags: {T.plan_flags(chosen, text) or '(none added)'}" in printed
        # bf16 and NF4, checkpointing off and on; [klein] compiled too (bf16: where it was measured)
        assert len(re.findall(r"^  (bf16|nf4) ", printed, flags=re.M)) == {"dev": 4, "klein4b": 6}[model]
    assert not (work / "out").exists()  # nothing trained, no output folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU plans for its own")
def test_plan_only_without_a_gpu_needs_the_card_to_plan_for(planned):
    _, work = planned
    with pytest.raises(T.UsageError, match="--plan_only: no GPU here; give --gpu_memory"):
        T.validate_args(T.parse_args(_command(work, "dev", "--plan_only")))
    assert T.read_bnb_config("nf4") == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}  # what the plan passes
    assert T.parse_args(_command(work, "dev", "--bnb_quantization_config_path", "nf4")).bnb_quantization_config_path


def _resolve(work, model, *extra):
    """The flags of the README command on `model` after prepare_data's resolution (family defaults, the plan), on a
    machine that says it has CUDA, and the options then on."""
    from accelerate import PartialState

    PartialState()
    args = T.parse_args(_command(work, model, *extra))
    hooks = T.Hooks(args)
    with unittest.mock.patch("torch.cuda.is_available", lambda: True):
        T.resolve_model_flags(args, hooks)
    return args, {o.name for o in hooks.options}


def test_the_plan_sets_the_flags_it_printed_and_their_options_turn_on(planned):
    found, work = planned
    args, on = _resolve(work, "dev", "--gpu_memory", "24GB", "--host_memory", "64GB")
    _, chosen, text = found["dev", 24]
    assert T.plan_flags(chosen, text) == ("--gradient_checkpointing --blocks_to_swap 40 --transformer_quantization "
                                          "int8 --text_encoder_quantization nf4 --validation_batch 1")
    assert (args.gradient_checkpointing, args.blocks_to_swap, args.transformer_quantization,
            args.text_encoder_quantization) == (True, 40, "int8", "nf4")
    assert {"block_swap", "int8_weights", "text_encoders", "memory_plan"} <= on
    # with --compile given, the option was on before the plan chose NF4 (8-bit weights kept out): it still knows the
    # 4-bit weights are placed as they load (not moved again by the recipe's .to(device)); on 32 GB no swapping
    # places them either
    args = T.parse_args(_command(work, "dev", "--gpu_memory", "32GB", "--host_memory", "64GB", "--compile",
                                 "--transformer_quantization", "none"))
    hooks = T.Hooks(args)
    assert not hooks.flag("places_transformer")
    with unittest.mock.patch("torch.cuda.is_available", lambda: True):
        T.resolve_model_flags(args, hooks)
    assert (args.bnb_quantization_config_path, args.blocks_to_swap) == ("nf4", 0)
    assert hooks.flag("places_transformer")


def test_flags_the_user_set_are_kept(planned):
    found, work = planned
    # on 80 GB the plan drops checkpointing for speed; given, it stays
    assert not found["klein4b", 80][1].checkpointing
    args, _ = _resolve(work, "klein4b", "--gpu_memory", "80GB", "--host_memory", "160GB", "--gradient_checkpointing")
    assert args.gradient_checkpointing and args.blocks_to_swap == 0
    # a swap count given stays, and the plan fits around it ([dev] on 24 GB would take 40)
    args, _ = _resolve(work, "dev", "--gpu_memory", "24GB", "--host_memory", "64GB", "--gradient_checkpointing",
                       "--blocks_to_swap", "45")
    assert (args.blocks_to_swap, args.transformer_quantization, args.bnb_quantization_config_path) == (45, "int8", None)
    # a text encoder precision given stays: int8 cannot fit 24 GB, so the run is refused, naming what would fit
    with pytest.raises(T.UsageError, match=r"nothing fits 24\.0 GiB .*--text_encoder_quantization nf4 fits; .* the "
                       r"smallest card that fits is 32 GB, with --gradient_checkpointing .*"
                       r"--text_encoder_quantization int8"):
        _resolve(work, "dev", "--gpu_memory", "24GB", "--host_memory", "64GB", "--text_encoder_quantization", "int8")


def test_flags_given_at_their_default_value_are_kept_too(planned, tmp_path):
    """A flag given at its default is given: on the command line, or in a --config file (a run's config.yaml, which
    resumes with the plan's choices, holds every flag). [klein] 9B on 16 GB: the plan takes 20 swapped blocks and the
    int8 text encoder."""
    found, work = planned
    assert T.plan_flags(*found["klein9b", 16][1:]) == ("--gradient_checkpointing --blocks_to_swap 20 "
                                                       "--text_encoder_quantization int8 --validation_batch 1")
    args, _ = _resolve(work, "klein9b", "--gpu_memory", "16GB", "--host_memory", "64GB", "--blocks_to_swap", "0")
    assert (args.blocks_to_swap, args.transformer_quantization, args.text_encoder_quantization) == (0, "int8", "int8")
    config = tmp_path / "config.yaml"
    config.write_text("text_encoder_quantization: none\nblocks_to_swap: 0\n")
    for given in (["--text_encoder_quantization", "none"], ["--config", str(config)]):
        with pytest.raises(T.UsageError, match=r"the text encoder peaks at 16\.3 GiB \(bf16\) while prompts are "
                           r"encoded; --text_encoder_quantization int8 fits; the smallest card that fits is 24 GB"):
            _resolve(work, "klein9b", "--gpu_memory", "16GB", "--host_memory", "64GB", *given)
    # a switch given false stays off: [klein] 4B on 24 GB needs checkpointing, so the run is refused
    (tmp_path / "off.yaml").write_text("gradient_checkpointing: false\n")
    for given in (["--gradient_checkpointing", "false"], ["--config", str(tmp_path / "off.yaml")]):
        with pytest.raises(T.UsageError, match=r"training peaks at [\d.]+ GiB at the least"):
            _resolve(work, "klein4b", "--gpu_memory", "24GB", "--host_memory", "64GB", *given)


def test_a_refusal_shows_the_candidates_the_margin_and_what_does_not_fit(planned, monkeypatch, capsys,
                                                                         fresh_accelerate):
    """[dev] on 16 GB: training fits (bf16, checkpointing, swapping: 12.9 GiB) and the NF4 text encoder does not
    (15.4 GiB; a peak fits 16 GiB up to 13.2 GiB with the margin): the refusal says so, and that --remote_text_encoder
    avoids it; --plan_only printed the candidates first."""
    _, work = planned
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(T.UsageError) as refused:
        T.main(_command(work, "dev", "--gpu_memory", "16GB", "--host_memory", "256GB", "--plan_only"))
    assert re.fullmatch(r"--memory_plan auto: nothing fits 16\.0 GiB of GPU memory \(a peak fits when peak x 1\.1 \+ "
                        r"1\.5 GiB does: up to 13\.2 GiB\): the text encoder peaks at 15\.4 GiB \(nf4\) while prompts "
                        r"are encoded; --remote_text_encoder .* needs none here, and training fits with "
                        r"--gradient_checkpointing --blocks_to_swap \d+ --validation_batch 1; the smallest card that "
                        r"fits is 24 GB, with .*",
                        str(refused.value)), refused.value
    printed = capsys.readouterr().out
    assert len(re.findall(r"^  (bf16|nf4) ", printed, flags=re.M)) == 4 and "text encoder (nf4): 15.4 GiB" in printed


def test_the_plan_labels_unquantised_weights_with_their_precision(planned, monkeypatch, capsys, fresh_accelerate):
    """Without --mixed_precision the weights are float32: the rows and the text encoder say fp32, not bf16."""
    _, work = planned
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    command = plan_table.set_flags(_command(work, "klein4b", "--gpu_memory", "24GB", "--host_memory", "64GB",
                                            "--plan_only"), mixed_precision=False)
    with pytest.raises(SystemExit):
        T.main(command)
    printed = capsys.readouterr().out
    assert len(re.findall(r"^  fp32 ", printed, flags=re.M)) == 4 and "text encoder (fp32): 16.0 GiB" in printed
    assert "bf16" not in printed and re.search(r"\d\.\d\dx of fp32 with checkpointing", printed)


def test_plan_only_without_a_gpu_takes_the_flags_it_plans(planned):
    """--plan_only --gpu_memory works on a machine without CUDA, where the plan recommends swapping and NF4 (README's
    [dev] on 24 GB): given, they are not refused there (nor fp8); a run that trains still is."""
    _, work = planned
    for given in (["--bnb_quantization_config_path", "nf4", "--gradient_checkpointing"],
                  ["--text_encoder_quantization", "nf4"], ["--gradient_checkpointing", "--blocks_to_swap", "10"],
                  ["--do_fp8_training"]):
        with unittest.mock.patch("torch.cuda.is_available", lambda: False):
            T.validate_args(T.parse_args(_command(work, "dev", "--gpu_memory", "24GB", "--plan_only", *given)))
            with pytest.raises(T.UsageError, match="needs a CUDA GPU"):
                T.validate_args(T.parse_args(_command(work, "dev", "--gpu_memory", "24GB", *given)))


def test_a_card_nothing_fits_is_refused_before_loading(planned, monkeypatch, fresh_accelerate):
    """A real run (not --plan_only) on a card nothing fits: a UsageError (the script's exit 2, one line) naming the
    smallest card that fits and its flags, as on a machine with CUDA; no output folder."""
    _, work = planned
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(T.UsageError) as refused:
        T.main(_command(work, "dev", "--gpu_memory", "12GB", "--host_memory", "64GB"))
    assert re.fullmatch(r"--memory_plan auto: nothing fits 12\.0 GiB .* the smallest card that fits is 24 GB, with "
                        r"--gradient_checkpointing --blocks_to_swap \d+ --transformer_quantization int8 "
                        r"--text_encoder_quantization nf4 --validation_batch 1", str(refused.value)), refused.value
    assert not (work / "out").exists()


def test_a_planned_tiny_run_trains_the_lora_of_the_flags_it_printed(tiny_model, images, tmp_path):
    """On a CPU the plan may choose checkpointing and the text encoder's precision (swapping and NF4 need CUDA). A
    card between what the tiny text encoder needs in int8 and in float32 makes it choose int8; that run and one with
    --text_encoder_quantization int8 train the same LoRA, bit for bit (a plan that printed int8 but did not set it,
    or set it without turning its option on, trains the float32 encoder's)."""
    from accelerate import PartialState

    PartialState()
    flags = base_args(tiny_model, images, tmp_path / "x", "--max_train_steps", "2", "--cache_latents")
    args = T.parse_args(flags)
    params, kept = T.text_encoder_size(args, T.detect_family(args))
    full, int8 = (T.text_encoder_peak(params, kept, q, 4)[0] for q in (None, "int8"))
    assert int8 < full
    card = (full + int8) / 2 * 1.1 + 1.5 * GIB
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path / "xdg")}

    def run(out, *extra):
        proc = launch(base_args(tiny_model, images, tmp_path / out, "--max_train_steps", "2", "--cache_latents", *extra),
                      env=env, check=False, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr, load_file(str(tmp_path / out / "pytorch_lora_weights.safetensors"))

    log, planned = run("planned", "--memory_plan", "auto", "--gpu_memory", f"{card / GIB:.12f}GB", "--host_memory",
                       "64GB")
    assert "flags: --text_encoder_quantization int8" in log
    _, given = run("given", "--text_encoder_quantization", "int8")
    _, plain = run("plain")
    assert planned.keys() == given.keys() and all(torch.equal(planned[k], given[k]) for k in given)
    assert any(not torch.equal(plain[k], given[k]) for k in given)  # int8 embeddings: another LoRA


def test_the_estimate_is_sized_by_the_largest_bucket_the_run_trains(tiny_model, tmp_path):
    """Activations, sampling and the VAE's shapes follow the run's largest bucket, not --resolution^2: --resolution
    512 with 1024x1024 buckets was planned at a quarter of the tokens it trains; the report names the bucket."""
    def estimate(*extra):
        args = T.parse_args(base_args(tiny_model, tmp_path, tmp_path / "out", "--memory_plan", "auto",
                                      "--validation_prompt", "a sks dog", *extra))
        found = T.run_estimate(args, torch.bfloat16)
        report = T.plan_report(args, "tiny", 24 * GIB, 64 * GIB, [], None, [], None, "bf16")
        return found.peak(False), found.decode, report[0]

    square, decode, report = estimate("--resolution", "512", "--aspect_ratio_buckets", "1024,1024")
    assert (square, decode) == estimate("--resolution", "1024")[:2] and "1024x1024 px (the largest bucket)" in report
    assert "1024 px, batch" in estimate("--resolution", "1024")[2]  # the usual square: as before
    wide, wide_decode, report = estimate("--resolution", "512", "--aspect_ratio_buckets", "512,512;512,1024")
    assert (wide, wide_decode) == estimate("--resolution", "512", "--aspect_ratio_buckets", "512,1024")[:2]
    small, small_decode, _ = estimate("--resolution", "512")
    assert small["activations"] < wide["activations"] < square["activations"] and small_decode < wide_decode < decode
    assert "512x1024 px (the largest bucket)" in report


def test_every_process_plans_with_the_least_free_host_ram_of_them_all(planned, monkeypatch, capsys, fresh_accelerate):
    """Host RAM decides swapping and the text encoder's precision: a process that read more free RAM than another
    would choose another plan (other frozen shapes: DDP's broadcast of them fails or hangs), so it is agreed like the
    GPU's."""
    _, work = planned
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(T, "available_host_memory", lambda: 512 * 2**30)
    monkeypatch.setattr(T, "agreed_minimum", lambda value: min(value, 20 * 2**30))  # another process's: 20 GiB
    with pytest.raises(SystemExit):
        T.main(_command(work, "dev", "--gpu_memory", "24GB", "--plan_only"))
    assert "on 24.0 GiB of GPU memory and 20.0 GiB of host RAM" in capsys.readouterr().out


ESTIMATES = {}  # (module, model, extra flags) -> its run_estimate, which no card changes (about 6 s each)


def _plan_of(module, work, model, card, *extra):
    """`module`'s plan (the script, or a trimmed copy of it) of the README command on `model` for a `card` GB card
    and 64 GB of host RAM, as --plan_only makes it on any machine -> the report's lines and its flags."""
    args = module.parse_args(_command(work, model, "--gpu_memory", f"{card}GB", "--plan_only", *extra))
    family = module.detect_family(args)
    key = (module.__name__, str(work), model, extra)  # each copy has a name of its own
    if key not in ESTIMATES:
        ESTIMATES[key] = module.run_estimate(args, torch.bfloat16)
    report, chosen, text = module.make_plan(args, family.name, card * GIB, 64 * GIB, ESTIMATES[key],
                                            module.text_encoder_size(args, family), torch.bfloat16)
    text = [text] if "text" in inspect.signature(module.plan_flags).parameters else []  # a copy without encoders
    return "\n".join(report), module.plan_flags(chosen, *text) if chosen else None


# each option the plan refers to, the flags of it the plan may print, a report's row that uses it (swapped blocks,
# quantised weights, a quantised text encoder), and where the full script prints them (with flags, if another option's
# choice would hide them)
TRIMMED = [("block_swap", ["--blocks_to_swap"], r"^  \w+ +o\w+ +o\w+ +[1-9]", [("dev", 24)]),
           ("compile", ["--bnb_quantization_config_path", "--compile"],
            r"^  (nf4|llm\.int8) |^  \w+ +o\w+ +on ", [("dev", 24, "--transformer_quantization", "none"),
                                                     ("klein4b", 24)]),
           ("int8_weights", ["--transformer_quantization"], r"^  int8 ", [("dev", 24)]),
           ("text_encoders", ["--text_encoder_quantization", "--remote_text_encoder"], r"encoder \((nf4|int8)\)",
            [("dev", 16)])]


@pytest.mark.parametrize("option, flags, used, where", TRIMMED, ids=[t[0] for t in TRIMMED])
def test_a_copy_without_an_option_plans_without_it(option, flags, used, where, planned, fresh_accelerate):
    """The trimmed-copy rule in the plan: its lines for another option are marked, so a copy of the script without
    block swapping (or quantised weights, or the text encoder's options) still plans, on the same inputs where the
    full script proposes that option's flags, and neither chooses nor names them (in the plan or its refusal)."""
    from accelerate import PartialState
    from tests.test_parts import SOURCE, load, option_sections, undefined_globals, without_options

    _, work = planned
    PartialState()
    source = without_options(SOURCE, [option])
    assert undefined_globals(source) == set()
    start, end = option_sections(source)["memory_plan"]
    section = "\n".join(source.splitlines()[start:end])
    assert not [f for f in flags if f in section], "a line of the plan names a deleted option's flag"
    full = "\n".join(report + str(chosen) for report, chosen in (_plan_of(T, work, *w) for w in where))
    assert all(f in full for f in flags) and re.search(used, full, flags=re.M), full
    copy = load(source, "without_" + re.sub(r"\W", "_", option))
    for model, card, *extra in (*where, ("klein4b", 80), ("klein9b", 16), ("dev", 12)):
        report, chosen = _plan_of(copy, work, model, card, *extra)
        assert not [f for f in flags if f in report + str(chosen)], (model, card, report)
        assert not re.search(used, report, flags=re.M), (model, card, report)  # nor takes it, unnamed


def test_an_edit_row_counts_the_tokens_of_each_of_its_references(tiny_model, images, tmp_path, monkeypatch,
                                                                 fresh_accelerate):
    """An edit target's condition images follow its tokens in the sequence, each at reference_size: a row with three
    references is four images' tokens. The plan counted one reference, and only with --cond_data_dir or
    --cond_image_column (a manifest's edit records: none); it now counts the records the run loads, or the
    --validation_image files where they are more (validation samples with all of them)."""
    from accelerate import PartialState

    PartialState()
    tokens, estimate = [], T.MemoryEstimate
    monkeypatch.setattr(T, "MemoryEstimate", lambda *a, **k: tokens.append(a[3]) or estimate(*a, **k))
    args = T.parse_args(base_args(tiny_model, images, tmp_path / "out", "--memory_plan", "auto", "--gpu_memory",
                                  "24GB", "--plan_only"))  # resolution 32: 2 x 2 tokens an image
    for references in (0, 1, 3):
        target = T.ImageRecord("a.png", (32, 32), conditions=(T.ImageRecord("c.png", (32, 32)),) * references)
        with pytest.raises(SystemExit):
            T.resolve_model_flags(args, T.Hooks(args), [target])
    args.validation_image = ["a.png", "b.png"]  # two references: more than one, fewer than three
    for references in (1, 3):
        target = T.ImageRecord("a.png", (32, 32), conditions=(T.ImageRecord("c.png", (32, 32)),) * references)
        with pytest.raises(SystemExit):
            T.resolve_model_flags(args, T.Hooks(args), [target])
    assert tokens == [4, 8, 16, 12, 16]


def test_the_plan_keeps_the_quantisation_file_the_user_gave(planned, tmp_path, monkeypatch, capsys,
                                                          fresh_accelerate):
    """A bitsandbytes file given is planned as the weights it loads (4-bit: NF4's size, 8-bit: LLM.int8's, with the
    rest float32 as PEFT's k-bit preparation makes it) and printed as given: the plan printed
    `--bnb_quantization_config_path nf4` in its place."""
    _, work = planned
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for bits, label in ((4, "nf4"), (8, "llm.int8")):
        config = tmp_path / f"{bits}bit.json"
        config.write_text(json.dumps({f"load_in_{bits}bit": True}))
        with pytest.raises(SystemExit):
            T.main(_command(work, "dev", "--gpu_memory", "80GB", "--host_memory", "160GB", "--plan_only",
                            "--bnb_quantization_config_path", str(config)))
        printed = capsys.readouterr().out
        assert re.findall(r"^  (bf16|nf4|int8|llm\.int8) ", printed, flags=re.M) == [label, label], printed
        assert f"--bnb_quantization_config_path {config}" in printed and "path nf4" not in printed


def _bad_model(work):
    """The [klein] 4B folder with a transformer config that says "eight" for a number."""
    import shutil

    bad = work / "bad_model"
    if not bad.exists():
        shutil.copytree(work / "klein4b", bad)
        config = json.loads((bad / "transformer" / "config.json").read_text())
        (bad / "transformer" / "config.json").write_text(json.dumps({**config, "num_layers": "eight"}))
    return bad


@pytest.mark.parametrize("extra, message", [
    (["--gpu_memory", "24564"], "--gpu_memory 24564: expected a size up to 1024 GiB, e.g. 24GB or 24564MiB (a bare "
                                "number is read in GiB)"),
    (["--pretrained_model_name_or_path", "BAD"], "transformer/config.json's num_layers is 'eight', expected an "
                                                 "integer"),
    (["--bnb_quantization_config_path", "both.json"], "both.json: load_in_4bit and load_in_8bit are both true"),
])
def test_bad_inputs_of_the_plan_are_refused_before_it_plans(extra, message, planned, tmp_path, monkeypatch, capsys,
                                                           fresh_accelerate):
    """A card's size in MiB as nvidia-smi prints it (read as GiB: a 24,564 GiB card), a transformer config with a
    word for a number (a TypeError in diffusers), a bitsandbytes file diffusers' BitsAndBytesConfig refuses: each a
    UsageError naming the flag or file and key, before anything is planned or written."""
    _, work = planned
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "both.json").write_text(json.dumps({"load_in_4bit": True, "load_in_8bit": True}))
    extra = [str(tmp_path / e) if e.endswith(".json") else str(_bad_model(work)) if e == "BAD" else e for e in extra]
    command = [*_command(work, "klein4b", "--plan_only", "--gpu_memory", "24GB"), *extra]
    with pytest.raises(T.UsageError, match=re.escape(message)):
        T.main(command)
    assert "memory plan:" not in capsys.readouterr().out and not (work / "out").exists()
    assert T.memory_size("24564MiB") == 24564 * 2**20  # what that card's size is written as


def test_two_processes_on_a_machine_share_its_host_ram(planned, monkeypatch, capsys, fresh_accelerate):
    """Each process of a machine pins its own swapped blocks and loads its own unquantised weights, so the plan gives
    each the machine's free host RAM divided among them. [dev] on an 80 GB card with 128 GB of host RAM: one process
    loads its 60 GiB of bf16 weights within 80% of it; two would need twice that, and take 8-bit weights (30 GiB each
    as they load)."""
    _, work = planned
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def flags(processes):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
        with pytest.raises(SystemExit):
            T.main(_command(work, "dev", "--gpu_memory", "80GB", "--host_memory", "128GB", "--plan_only"))
        return re.search(r"^flags: (.*)$", capsys.readouterr().out, flags=re.M)[1]

    assert flags(1) == "--gradient_checkpointing --validation_batch 1"  # (four 1024 px images at once: 81 GiB)
    assert flags(2) == "--gradient_checkpointing --transformer_quantization int8"


def test_the_plan_compiles_a_run_long_enough_to_repay_it(planned, monkeypatch, capsys, fresh_accelerate):
    """--compile takes a third off a [klein] step for the same memory after a first step 27 s longer and a first
    validation 7 s longer (H200, docs/speed.md): the plan adds it where the run's steps repay that, with or without
    checkpointing, and shows the compiled rows and why; a short run stays eager, and so does output preservation
    (which refuses --compile), [dev] (not measured) and quantised weights."""
    found, work = planned
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the README's 500 steps on [klein] 4B: compiled, checkpointing on 24 GB, off on 80
    assert [T.plan_flags(*found["klein4b", card][1:]) for card in (24, 80)] == ["--gradient_checkpointing --compile",
                                                                                 "--compile"]
    assert not any(found["dev", card][1].compiled for card in plan_table.CARDS if found["dev", card][1])

    def plan(*extra, **changes):
        with pytest.raises(SystemExit):
            T.main(plan_table.set_flags(_command(work, "klein4b", "--gpu_memory", "80GB", "--host_memory", "160GB",
                                                 "--plan_only", *extra), **changes))
        return capsys.readouterr().out

    printed = plan()
    rows = re.findall(r"^  bf16 +(on|off) +(on|off) ", printed, flags=re.M)
    assert rows == [("off", "off"), ("on", "off"), ("off", "on"), ("on", "on")], printed
    pays = re.search(r"^  compiled: (\d+) s once, ([\d.]+) s less a step: it pays from (\d+) steps; this run trains "
                     r"500$", printed, flags=re.M)
    assert pays and int(pays[1]) == 34 and 60 <= int(pays[3]) <= 80, printed  # about 70 steps (docs/speed.md)
    # without --max_train_steps, its epochs: 6 images, 4 a step: 10 epochs are 15 steps, 100 epochs 150
    short, long = (plan(max_train_steps=False, num_train_epochs=epochs) for epochs in ("10", "100"))
    assert "this run trains 15" in short and "flags: (none added)" in short, short
    assert "this run trains 150" in long and "flags: --compile" in long, long
    preserved = plan("--trigger_word", "sks", "--class_word", "dog", "--output_preservation")
    assert " compiled:" not in preserved and not re.search(r"^  bf16 +o\w+ +on ", preserved, flags=re.M)


def test_a_validation_batch_that_does_not_fit_is_planned_one_image_a_call(tiny_model, images, tmp_path, monkeypatch,
                                                                           fresh_accelerate):
    """A prompt's validation images are made in one pipeline call: the estimate counts the call's sampling and
    decoding for all of them. On a card where that call does not fit but one image does, the plan keeps its training
    settings and sets --validation_batch 1 (rather than trying the batch and falling back on out of memory); a
    --validation_batch the user gave is planned as given."""
    from accelerate import PartialState

    PartialState()
    monkeypatch.setattr(T, "TEXT_ACTIVATIONS", 0)  # a real text encoder's 1 GiB: the tiny cards here hold tiny models

    def plan(card, *extra):
        args = T.parse_args(base_args(tiny_model, images, tmp_path / "out", "--memory_plan", "auto",
                                      "--validation_prompt", "a sks dog", "--num_validation_images", "4", *extra))
        estimate = T.run_estimate(args, torch.float32)
        return estimate, T.make_plan(args, "tiny", card, 64 * GIB, estimate, (0, 0), torch.float32)

    estimate, _ = plan(GIB)
    assert estimate.per_call == 4 and estimate.calls[4] > estimate.calls[1] > 0  # four images cost more than one
    row = estimate.peak(False)
    assert row["peak"] > row["peak_one"] and row["peak"] == row["validation"]  # validation is this run's peak
    card = T.PLAN_MARGIN[0] * (row["peak"] + row["peak_one"]) / 2 + T.PLAN_MARGIN[1]  # one image fits, four do not
    _, (report, chosen, _) = plan(card)
    assert chosen.one_at_a_time and not chosen.checkpointing and chosen.peak == row["peak_one"]
    assert T.plan_flags(chosen) == "--validation_batch 1" and T.plan_settings(chosen, None)["validation_batch"] == 1
    assert "validation one image a call (4 in one would not fit)" in report[-2]
    _, (_, roomy, _) = plan(4 * card)  # a card the call fits: all four at once, no flag
    assert not roomy.one_at_a_time and "validation_batch" not in T.plan_flags(roomy)
    given, (_, kept, _) = plan(4 * card, "--validation_batch", "2")  # the user's batch: planned as given
    assert given.per_call == 2 and not kept.one_at_a_time and kept.peak == given.peak(kept.checkpointing)["peak"]
    _, (report, refused, _) = plan(card, "--validation_batch", "4")  # ... and never changed: nothing else fits
    assert refused is None and "validation_batch" not in "\n".join(report)
