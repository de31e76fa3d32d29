"""Runs you can share and repeat (issue 39): a run given as a --config file (YAML, TOML, JSON) whose values meet the
same checks as the command line, the resolved config every run writes beside its LoRA and into each checkpoint (it
repeats the run bit for bit), --print_config, and LoKr and LoHa files that carry their trained strength in the
diffusers layout too (ComfyUI reads no alpha from its metadata)."""

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch

LORA = T.LORA_WEIGHTS_NAME


def _write(path, data):
    if path.suffix == ".json":
        path.write_text(json.dumps(data))
    elif path.suffix == ".toml":
        lines = [f"{k} = {json.dumps(v)}" for k, v in data.items()]  # the JSON of these values is TOML too
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_a_config_file_gives_flags_and_the_command_line_wins(suffix, tmp_path):
    config = _write(tmp_path / f"run{suffix}", {
        "pretrained_model_name_or_path": "some/model", "--instance_prompt": "a photo of sks dog", "rank": 8,
        "learning-rate": 2e-4, "gradient_checkpointing": True, "random_flip": False, "text_encoder_out_layers": [1, 2],
        "resolution": "512,768", "validation_lora_scales": [0.5, 1], "timestep_shift": "auto", "logit_mean": -0.5})
    args = T.parse_args(["--config", str(config), "--rank", "16"])
    assert (args.pretrained_model_name_or_path, args.instance_prompt, args.rank) == ("some/model", "a photo of sks dog", 16)
    assert args.learning_rate == 2e-4 and args.gradient_checkpointing and not args.random_flip
    assert args.text_encoder_out_layers == [1, 2] and args.resolutions == (512, 768)
    assert args.validation_lora_scales == [0.5, 1.0] and args.timestep_shift == "auto" and args.logit_mean == -0.5


def test_a_switch_a_config_file_turns_on_is_turned_off_by_the_command_line(tmp_path):
    """Switches went into the tokens bare: `--use_aspect_ratio_buckets false` was an unrecognized argument."""
    config = _write(tmp_path / "run.yaml", {"pretrained_model_name_or_path": "m", "use_aspect_ratio_buckets": True,
                                            "random_flip": True, "cache_latents": True})
    args = T.parse_args(["--config", str(config), "--use_aspect_ratio_buckets", "false", "--random_flip=no",
                         "--center_crop", "true"])
    assert (args.use_aspect_ratio_buckets, args.random_flip, args.cache_latents, args.center_crop) == (False, False,
                                                                                                        True, True)
    with pytest.raises(T.UsageError, match=r"^--center_crop maybe: expected nothing \(on\), true or false$"):
        T.parse_args(["--config", str(config), "--center_crop", "maybe"])


def test_an_option_the_command_line_turns_off_drops_the_config_files_settings_of_it(tmp_path):
    """--memory_plan off over a config with --gpu_memory was refused ("has no effect without --memory_plan"): the
    command line wins, the file's setting is dropped with a warning; the same setting on the command line is refused."""
    config = _write(tmp_path / "run.yaml", {"pretrained_model_name_or_path": "m", "instance_data_dir": str(tmp_path),
                                            "instance_prompt": "p", "memory_plan": "auto", "gpu_memory": "16GB"})
    args = T.parse_args(["--config", str(config), "--memory_plan", "off"])
    T.validate_args(args)
    assert args.gpu_memory is None and args.memory_plan == "off"
    assert T.surprising_values(args) == [f"--config {config}: ignored --gpu_memory (settings of an option now off)"]
    with pytest.raises(T.UsageError, match="^--host_memory has no effect without --memory_plan auto$"):
        T.validate_args(T.parse_args(["--config", str(config), "--memory_plan", "off", "--host_memory", "8GB"]))
    with pytest.raises(T.UsageError, match="^--gpu_memory has no effect without --memory_plan auto$"):
        T.validate_args(T.parse_args(["--config", str(config), "--memory_plan", "off", "--gpu_memory", "16GB"]))


@pytest.mark.parametrize("data, message", [
    ({"learning_rat": 1e-4}, r"'learning_rat' is not a flag \(did you mean --learning_rate\?\)"),
    ({"rank": 0}, r"--rank 0: expected an integer >= 1"),
    ({"lr_scheduler": "cosin"}, r"argument --lr_scheduler: invalid choice: 'cosin'"),
    ({"gradient_checkpointing": "yes"}, r"--gradient_checkpointing 'yes': expected true or false"),
    ({"config": "other.yaml"}, r"'config' is not a flag"),
    # a list for a flag of one value was joined with commas ('a,b'), a mapping became its repr as the prompt
    ({"validation_prompt": ["a", "b"]}, r"validation_prompt: a list \(\['a', 'b'\]\) for --validation_prompt, which "
                                        r"takes one value"),
    ({"validation_prompt": {"text": "a dog"}}, r"validation_prompt: \{'text': 'a dog'\} is a mapping or nested list; "
                                               r"--validation_prompt takes a value as on the command line"),
    ({"text_encoder_out_layers": [[1, 2]]}, r"text_encoder_out_layers: \[\[1, 2\]\] is a mapping or nested list"),
    # YAML reads an unquoted no as false: a flag of words takes it back as its word, or says why it cannot
    ({"lr_scheduler": False}, r"lr_scheduler: YAML reads false \(or yes/no, on/off\) as a boolean, not one of linear, "
                              r"cosine, .*; quote the word"),
])
def test_a_bad_key_or_value_in_a_config_file_is_refused_naming_the_file(data, message, tmp_path):
    config = _write(tmp_path / "run.yaml", {"pretrained_model_name_or_path": "m", **data})
    with pytest.raises(T.UsageError, match=rf"^--config {re.escape(str(config))}: {message}"):
        T.parse_args(["--config", str(config)])


@pytest.mark.parametrize("name, text, line, key", [
    ("run.yaml", "rank: 4\nlearning_rate: 1e-4\nrank: 8\n", 3, "rank"),
    ("run.yaml", "datasets:\n- folder: R3\n  folder: R1\n", 3, "folder"),  # the second entry's dash forgotten
    ("run.toml", "rank = 4\nlearning_rate = 1e-4\nrank = 8\n", 3, "rank"),
    ("run.toml", "[[datasets]]\nfolder = 'R3'\nfolder = 'R1'\n", 3, "folder"),
    ("run.json", '{"rank": 4,\n "rank": 8}', 2, "rank"),
    ("run.json", '{"validation_prompt": "a {dog}: \\"x\\"", "datasets": [{"folder": "R3",\n  "folder": "R1"}]}', 2,
     "folder"),
])
def test_a_key_given_twice_in_a_config_file_is_refused_naming_the_file_the_key_and_its_line(name, text, line, key,
                                                                                           tmp_path):
    """YAML and JSON keep a mapping's last value: a folder was dropped without a word (issue 59 item 5)."""
    (tmp_path / name).write_text(text)
    with pytest.raises(T.UsageError, match=rf"^--config {re.escape(str(tmp_path / name))}: line {line}: '{key}' is "
                                           "given twice in one mapping$"):
        T.parse_args(["--config", str(tmp_path / name)])


def test_the_same_key_in_other_mappings_of_a_config_file_is_not_twice(tmp_path):
    for name in ("R1", "R3"):
        (tmp_path / name).mkdir()
    entries = [{"folder": str(tmp_path / "R3"), "repeats": 2}, {"folder": str(tmp_path / "R1"), "repeats": 1}]
    data = {"pretrained_model_name_or_path": "m", "validation_prompt": 'a {"folder": 1, "folder": 2} dog',
            "datasets": entries}
    for suffix in (".yaml", ".json"):
        args = T.parse_args(["--config", str(_write(tmp_path / f"run{suffix}", data))])
        assert args.datasets == entries and args.validation_prompt == data["validation_prompt"]


def test_yaml_booleans_are_read_back_as_the_words_a_flag_of_choices_takes(tmp_path):
    (tmp_path / "run.yaml").write_text("pretrained_model_name_or_path: m\nmixed_precision: no\nlatent_sampling: mode\n")
    assert T.parse_args(["--config", str(tmp_path / "run.yaml")]).mixed_precision == "no"


def test_two_config_files_are_refused_naming_both(tmp_path):
    """The first was dropped without a word."""
    first, second = (_write(tmp_path / f"{n}.yaml", {"pretrained_model_name_or_path": "m"}) for n in ("a", "b"))
    with pytest.raises(T.UsageError, match=rf"^--config given 2 times \({re.escape(str(first))}, "
                                           rf"{re.escape(str(second))}\): one file a run"):
        T.parse_args(["--config", str(first), f"--config={second}"])


def test_a_config_file_that_is_not_one_is_refused(tmp_path):
    (tmp_path / "list.yaml").write_text("- rank\n- 4\n")
    (tmp_path / "broken.json").write_text("{rank: 4")
    for name, message in (("list.yaml", "expected a mapping of flag names to values"), ("broken.json", "JSONDecodeError")):
        with pytest.raises(T.UsageError, match=f"--config .*{name}: {message}"):
            T.parse_args(["--config", str(tmp_path / name), "--pretrained_model_name_or_path", "m"])


def test_sizes_in_a_resolved_config_read_back_as_the_same_bytes(tmp_path):
    """config.yaml recorded --gpu_memory in bytes, which the flag read back as GiB (25769803776.0 GiB)."""
    given = ["--pretrained_model_name_or_path", "m", "--memory_plan", "auto", "--gpu_memory", "24.3GB",
             "--host_memory", "64GB"]
    args = T.parse_args(given)
    config = _write(tmp_path / "config.yaml", T.resolved_config(args, 0, SimpleNamespace(mixed_precision="no")))
    assert "host_memory: 64GiB" in config.read_text()
    again = T.parse_args(["--config", str(config)])
    assert (again.gpu_memory, again.host_memory) == (args.gpu_memory, args.host_memory) == (int(24.3 * 2**30), 64 * 2**30)


@pytest.fixture(scope="module")
def configured(tiny_model, tmp_path_factory):
    """A run given as a config file, without --seed (drawn), then repeated from the config it wrote."""
    from tests.tiny_flux2 import make_images

    root = tmp_path_factory.mktemp("configured")
    make_images(str(root / "images"))
    flags = base_args(tiny_model, root / "images", root / "first", "--max_train_steps", "4", "--checkpointing_steps", "2",
                      "--use_aspect_ratio_buckets", "--random_flip", "--lora_dropout", "0.1")
    at = flags.index("--seed")
    flags = flags[:at] + flags[at + 2:]
    data, i = {}, 0
    while i < len(flags):  # the command line as a config file
        values = []
        while i + 1 + len(values) < len(flags) and not flags[i + 1 + len(values)].startswith("--"):
            values.append(flags[i + 1 + len(values)])
        data[flags[i][2:]] = True if not values else values if len(values) > 1 else values[0]
        i += 1 + len(values)
    config = _write(root / "run.yaml", data)
    first = launch(["--config", str(config)])
    second = launch(["--config", str(root / "first" / "config.yaml"), "--output_dir", str(root / "second")])
    printed = launch(["--config", str(config), "--output_dir", str(root / "printed"), "--print_config"])
    return SimpleNamespace(root=root, first=first, second=second, printed=printed)


@pytest.mark.slow
def test_the_resolved_config_repeats_the_run_bit_for_bit(configured):
    prints = [re.findall(r"LoRA fingerprint (\w+)", p.stderr) for p in (configured.first, configured.second)]
    assert prints[0] == prints[1] != []
    a, b = (load_file(str(configured.root / out / LORA)) for out in ("first", "second"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resolved = yaml.safe_load((configured.root / "first" / "config.yaml").read_text())
    assert re.search(rf"no --seed given; drew seed {resolved['seed']} ", configured.first.stderr)  # the seed used
    assert resolved["validation_guidance_scale"] == 4.0  # not a flag given: the [dev] pipeline's, as resolved
    assert resolved["max_train_steps"] == 4 and resolved["version"] == T.VERSION and "hub_token" not in resolved
    checkpoint = yaml.safe_load((configured.root / "first" / "checkpoint-2" / "config.yaml").read_text())
    state = json.loads((configured.root / "first" / "checkpoint-2" / "trainer_state.json").read_text())
    assert checkpoint["run"] == state["run"] and {**checkpoint, "run": None} == {**resolved, "run": None}


@pytest.mark.slow
def test_print_config_prints_the_resolved_flags_before_any_model_loads(configured):
    printed = yaml.safe_load(configured.printed.stdout)
    assert printed["text_encoder_out_layers"] == [1, 2] and printed["max_train_steps"] == 4
    assert isinstance(printed["seed"], int) and printed["output_dir"].endswith("printed")
    assert "loading the" not in configured.printed.stderr and not (configured.root / "printed" / LORA).exists()


def test_the_resolved_config_records_the_precision_accelerate_gave(tiny_model, images, tmp_path):
    """Without --mixed_precision the Accelerator takes accelerate's (its config, ACCELERATE_MIXED_PRECISION): the
    config recorded null, and a run repeated from it trained in float32."""
    printed = launch([*base_args(tiny_model, images, tmp_path / "out"), "--print_config"],
                     env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert yaml.safe_load(printed.stdout)["mixed_precision"] == "bf16"


@pytest.mark.parametrize("printing", [["--print_config"], ["--memory_plan", "auto", "--gpu_memory", "24", "--plan_only"]])
def test_print_config_and_plan_only_work_in_a_finished_output_folder(printing, tmp_path):
    """Both only print: an earlier run's LoRA or checkpoints in --output_dir refused them as if they trained."""
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / T.TRAINER_STATE_NAME).write_text("{}")
    (out / LORA).write_bytes(b"an earlier run's")
    argv = ["--pretrained_model_name_or_path", "m", "--instance_data_dir", str(tmp_path), "--instance_prompt", "p",
            "--output_dir", str(out)]
    for extra in ([], printing):  # a run is refused; printing is not
        args = T.parse_args(argv + extra)
        if extra:
            T.validate_args(args)
            assert T.find_resume_checkpoint(args, T.Hooks(args).flag("prints_only")) is None
        else:
            with pytest.raises(T.UsageError, match="already holds a finished LoRA"):
                T.validate_args(args)


@pytest.mark.slow
def test_a_resume_says_the_folders_edited_config_is_not_what_it_trains(configured, tmp_path):
    """config.yaml edited by hand (rank 4 -> 8), resumed with the same flags: it trained rank 4 and wrote config.yaml
    back without a word."""
    out = tmp_path / "first"
    shutil.copytree(configured.root / "first", out)
    edited = yaml.safe_load((out / "config.yaml").read_text())
    edited["rank"] = 8
    (out / "config.yaml").write_text(yaml.safe_dump(edited))
    resumed = launch(["--config", str(configured.root / "run.yaml"), "--output_dir", str(out),
                      "--resume_from_checkpoint", "latest"])
    assert (f"{out / 'config.yaml'} differs from {out / 'checkpoint-4' / 'config.yaml'} (rank: 8 there, 4 in the "
            "checkpoint): this run follows its command line and the checkpoint's flags") in resumed.stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["rank"] == 4
    assert "differs from" not in configured.second.stderr  # a fresh run in a fresh folder: nothing to compare


@pytest.mark.slow
def test_a_checkpoint_whose_config_another_run_wrote_is_refused(configured, tmp_path):
    mixed = tmp_path / "checkpoint-2"
    shutil.copytree(configured.root / "first" / "checkpoint-2", mixed)
    shutil.copy(configured.root / "second" / "checkpoint-2" / "config.yaml", mixed / "config.yaml")
    assert T.checkpoint_problem(mixed) == "config.yaml was written by another run than trainer_state.json (files of two runs)"


@pytest.mark.slow
def test_a_checkpoint_whose_run_identity_is_all_digits_is_whole(configured, tmp_path):
    """YAML writes an all-digit identity quoted (run: '8267997486895876'): one run in about 2,000 drew one, and its
    own next checkpoint was refused as "files of two runs" (seen once in CI, on the FSDP resume)."""
    digits, folder = "8267997486895876", tmp_path / "checkpoint-2"
    shutil.copytree(configured.root / "first" / "checkpoint-2", folder)
    for path in folder.glob("*.json"):
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "run": digits}))
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            metadata = {**f.metadata(), "run": digits}
        save_file(load_file(str(path)), str(path), metadata=metadata)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    (folder / "config.yaml").write_text(yaml.safe_dump({**config, "run": digits}, sort_keys=False))
    assert f"run: '{digits}'" in (folder / "config.yaml").read_text()  # quoted: the case
    assert T.checkpoint_problem(folder) is None


# ---------------------------------------------------------------------------------------------------------------
# LoKr and LoHa files carry their strength in both layouts


def _comfyui_delta(parts):
    """A module's update as ComfyUI computes it (comfy/weight_adapter/lokr.py, loha.py): LoHa scaled by alpha / rank
    and LoKr by alpha / dim (a factor decomposed) when an `.alpha` tensor is there, else by 1."""
    alpha = parts.get("alpha")
    if "hada_w1_a" in parts:
        delta = (parts["hada_w1_a"] @ parts["hada_w1_b"]) * (parts["hada_w2_a"] @ parts["hada_w2_b"])
        return delta * (alpha / parts["hada_w1_b"].shape[0] if alpha is not None else 1.0)
    w1 = parts["lokr_w1"] if "lokr_w1" in parts else parts["lokr_w1_a"] @ parts["lokr_w1_b"]
    w2 = parts["lokr_w2"] if "lokr_w2" in parts else parts["lokr_w2_a"] @ parts["lokr_w2_b"]
    dim = parts["lokr_w2_b"].shape[0] if "lokr_w2_b" in parts else parts["lokr_w1_b"].shape[0] if "lokr_w1_b" in parts \
        else None
    return torch.kron(w1, w2) * (alpha / dim if dim is not None and alpha is not None else 1.0)


@pytest.mark.parametrize("adapter, extra", [("lokr", ()), ("lokr", ("--lokr_decompose_both",)), ("loha", ())])
def test_a_lokr_or_loha_diffusers_file_loads_at_its_trained_strength(adapter, extra, tiny_model, tmp_path):
    """--lora_alpha 6 at rank 2 (scale 3): the diffusers-layout file, read by PEFT with the config in its metadata,
    by diffusers' load_lora_weights (LoKr) and by ComfyUI's formulas (which read no metadata), gives each layer the
    update it trained."""
    from accelerate import Accelerator
    from diffusers import Flux2Transformer2DModel
    from peft import LoHaConfig, LoKrConfig, set_peft_model_state_dict
    from peft.tuners.tuners_utils import BaseTunerLayer

    args = T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--adapter", adapter, "--rank", "2",
                         "--lora_alpha", "6", "--lora_layers", "attention", "--text_encoder_out_layers", "1", "2", *extra])
    model = T.prepare_transformer(args, Accelerator(cpu=True), T.load_transformer(args, torch.float32)).eval()
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.data = 0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name)))
    plain = SimpleNamespace(unwrap_model=lambda m: m, distributed_type=None)
    hooks = T.Hooks(args)
    T.write_lora_files(plain, model, T.lora_state_dict(plain, model, hooks), tmp_path, torch.float32, hooks)
    with safe_open(str(tmp_path / LORA), "pt") as f:
        written, meta = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["lora_adapter_metadata"])
    layers = {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}
    assert layers and not any(k.endswith(".alpha") for k in written)
    for name, layer in layers.items():  # ComfyUI: the file's factors, no alpha
        parts = {k.rsplit(".", 1)[1]: v for k, v in written.items() if k.rsplit(".", 1)[0] == f"transformer.{name}"}
        torch.testing.assert_close(_comfyui_delta(parts), layer.get_delta_weight("default"), rtol=1e-5, atol=1e-7)
    config = {k.removeprefix("transformer."): v for k, v in meta.items()}  # PEFT: the config the metadata holds
    fresh = Flux2Transformer2DModel.from_pretrained(tiny_model, subfolder="transformer").eval()
    fields = {"r", "alpha", "target_modules", "rank_pattern", "alpha_pattern"} | (
        {"decompose_both", "decompose_factor"} if adapter == "lokr" else set())
    fresh.add_adapter((LoKrConfig if adapter == "lokr" else LoHaConfig)(**{k: config[k] for k in fields}))
    result = set_peft_model_state_dict(fresh, {k.removeprefix("transformer."): v for k, v in written.items()},
                                       adapter_name="default")
    assert not result.unexpected_keys
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(5)),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(6)),
                  timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 4),
                  txt_ids=torch.zeros(8, 4), return_dict=False)
    with torch.no_grad():
        torch.testing.assert_close(fresh(**inputs)[0], model(**inputs)[0], rtol=1e-5, atol=1e-6)
    if adapter == "lokr":  # diffusers' load_lora_weights reads a LoKr file too (README: outputs)
        from diffusers import Flux2Pipeline

        pipe = Flux2Pipeline.from_pretrained(tiny_model, tokenizer=None)
        pipe.load_lora_weights(str(tmp_path))
        with torch.no_grad():
            torch.testing.assert_close(pipe.transformer.eval()(**inputs)[0], model(**inputs)[0], rtol=1e-5, atol=1e-6)
