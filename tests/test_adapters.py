"""Adapters users bring and take: --init_lora (ours, ai-toolkit/BFL and kohya files, through diffusers' own reader),
DoRA, LoKr and LoHa (train, checkpoint, resume bit for bit, EMA, caches, two processes), the ComfyUI file (read back
by diffusers' own converter: the fused weights equal our diffusers file's, for every --lora_layers preset), our
diffusers file as ComfyUI's loader applies it (its key map restated from ComfyUI's source), LyCORIS files reloaded
through PEFT, and validation at several prompts and strengths."""

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch

# what lora_state_dict and save_lora need of an accelerator: one process
PLAIN = SimpleNamespace(unwrap_model=lambda model: model, distributed_type=None)
INPUTS = dict(hidden_states=torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(5)),
              encoder_hidden_states=torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(6)),
              timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
              img_ids=torch.zeros(16, 4), txt_ids=torch.zeros(8, 4))


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _args(model, *extra):
    return T.parse_args(["--pretrained_model_name_or_path", str(model), "--instance_data_dir", ".", "--instance_prompt",
                         "p", "--text_encoder_out_layers", "1", "2", *map(str, extra)])


def _adapted(model, accelerator, *extra, seed=1):
    """The tiny transformer as the script prepares it (prepare_transformer), its adapter weights drawn at random
    (a fresh LoRA's B, or LoKr's w1, is zero: nothing would show)."""
    args = _args(model, *extra)
    transformer = T.prepare_transformer(args, accelerator, T.load_transformer(args, torch.float32))
    g = torch.Generator().manual_seed(seed)
    for name, param in transformer.named_parameters():
        if param.requires_grad:
            param.data = param.data * (1 + 0.2 * torch.rand(param.shape, generator=g)) if "magnitude" in name else \
                0.2 * torch.randn(param.shape, generator=g)
    return args, transformer.eval()


def _write(args, transformer, folder):
    """The final LoRA files of `transformer` as finish() writes them (--lora_format's options included)."""
    hooks = T.Hooks(args)
    T.write_lora_files(PLAIN, transformer, T.lora_state_dict(PLAIN, transformer, hooks), folder, torch.float32, hooks)


def _out(transformer):
    with torch.no_grad():
        return transformer(**INPUTS, return_dict=False)[0]


def _fresh(model):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_pretrained(model, subfolder="transformer").eval()


def _diffusers_load(model, path):
    """What Flux2Pipeline.load_lora_weights does, on a fresh transformer: diffusers' reader, then its loader."""
    from diffusers import Flux2Pipeline

    transformer = _fresh(model)
    state, meta = Flux2Pipeline.lora_state_dict(str(path), return_lora_metadata=True)
    Flux2Pipeline.load_lora_into_transformer(state, transformer=transformer, metadata=meta)
    return transformer


def _merged(transformer):
    """Every Linear's effective weight, adapters merged into it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in transformer.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {n.removesuffix(".base_layer"): m.weight.detach().clone() for n, m in transformer.named_modules()
            if isinstance(m, torch.nn.Linear) and ".lora_" not in n}


# ---------------------------------------------------------------------------------------------------------------
# The ComfyUI file


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["attention", "default", "all-linear"])
def test_the_comfyui_file_read_by_diffusers_converter_gives_the_diffusers_files_weights(preset, tiny_model, accelerator,
                                                                                         tmp_path):
    args, transformer = _adapted(tiny_model, accelerator, "--lora_layers", preset, "--lora_format", "both", "--rank",
                                 "3", "--lora_alpha", "6")
    _write(args, transformer, tmp_path)
    comfy = load_file(str(tmp_path / T.COMFYUI_WEIGHTS_NAME))
    assert comfy and all(k.startswith("diffusion_model.") and not k.endswith(".alpha") for k in comfy)
    assert any(".img_attn.qkv." in k for k in comfy)  # q, k and v fused, as ComfyUI's model holds them
    assert (preset == "all-linear") == any(".img_mlp." in k or ".txt_mlp." in k for k in comfy)
    ours = _merged(_diffusers_load(tiny_model, tmp_path / T.LORA_WEIGHTS_NAME))
    theirs = _merged(_diffusers_load(tiny_model, tmp_path / T.COMFYUI_WEIGHTS_NAME))
    trained = _merged(transformer)
    base = _merged(_fresh(tiny_model))
    changed = [n for n in trained if not torch.equal(trained[n], base[n])]
    assert len(changed) >= 4
    for name in trained:
        torch.testing.assert_close(ours[name], trained[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(theirs[name], trained[name], rtol=1e-5, atol=1e-6)


# ComfyUI's LoRA loader, restated from its source (the facts, not its code) as the oracle of the README's ComfyUI
# column. comfy/lora.py at 17358c8f73b5 (model_lora_keys_unet): on a Flux model, FLUX.2's class included, a file's
# "transformer.<diffusers name>" patches the weight that comfy/utils.py's flux_to_diffusers at 09708eae709a gives that
# name; a key no entry names is skipped ("lora key not loaded"). Its q, k and v are row blocks of the fused qkv, and
# norm_out.linear's update goes in with its halves swapped (swap_scale_shift: BFL holds shift, scale).
COMFYUI_DOUBLE = {"attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
                  "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
                  "attn.add_v_proj": ("txt_attn.qkv", 2), "attn.to_out.0": ("img_attn.proj", None),
                  "attn.to_add_out": ("txt_attn.proj", None), "ff.linear_in": ("img_mlp.0", None),
                  "ff.linear_out": ("img_mlp.2", None), "ff_context.linear_in": ("txt_mlp.0", None),
                  "ff_context.linear_out": ("txt_mlp.2", None)}
COMFYUI_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}  # marked "# Flux 2" there
# its global names are FLUX.1's: FLUX.2's time_guidance_embed.* and *_modulation.linear have no entry
COMFYUI_GLOBAL = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
                  "norm_out.linear": "final_layer.adaLN_modulation.1"}


def _comfyui_target(module):
    """diffusers module name -> (the BFL weight ComfyUI patches, its row block of a fused qkv or None), or None."""
    m = re.fullmatch(r"(single_)?transformer_blocks\.(\d+)\.(.+)", module)
    if m and m[1]:
        return (f"single_blocks.{m[2]}.{COMFYUI_SINGLE[m[3]]}", None) if m[3] in COMFYUI_SINGLE else None
    if m:
        return (f"double_blocks.{m[2]}.{COMFYUI_DOUBLE[m[3]][0]}", COMFYUI_DOUBLE[m[3]][1]) if m[3] in COMFYUI_DOUBLE \
            else None
    return (COMFYUI_GLOBAL[module], None) if module in COMFYUI_GLOBAL else None


def _comfyui_applies(path, hidden):
    """Our diffusers-layout file as ComfyUI's loader applies it to FLUX.2 (hidden: its width) at strength 1 -> (the
    updates it makes, in diffusers' names by diffusers' own converter of BFL checkpoints; the modules it skips)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    modules = {}
    for key, value in load_file(str(path)).items():
        module, part = re.fullmatch(r"transformer\.(.+?)\.(lora_[AB]\.weight|alpha|lokr_\w+|hada_\w+)", key).groups()
        modules.setdefault(module, {})[part] = value
    bfl, skipped = {}, set()
    for module, parts in modules.items():
        target = _comfyui_target(module)
        if target is None:
            skipped.add(module)
            continue
        (name, block), delta = target, _comfyui_delta(parts)
        if name == "final_layer.adaLN_modulation.1":
            delta = torch.cat(delta.chunk(2)[::-1])
        if block is None:
            bfl[name] = delta
        else:  # rows [block * hidden, (block + 1) * hidden) of the fused [3 * hidden, in] weight
            assert delta.shape[0] == hidden
            fused = bfl.setdefault(name, delta.new_zeros(3 * hidden, delta.shape[1]))
            fused[block * hidden:(block + 1) * hidden] += delta
    return convert_flux2_transformer_checkpoint_to_diffusers({f"{k}.weight": v for k, v in bfl.items()}), skipped


UNMAPPED = ("time_guidance_embed.timestep_embedder.linear_1", "double_stream_modulation_img.linear",
            "single_stream_modulation.linear")


@pytest.mark.slow
@pytest.mark.parametrize("extra, skipped", [
    (("--lora_layers", "attention"), ()), (("--lora_layers", "default"), ()), (("--lora_layers", "all-linear"), ()),
    (("--adapter", "lokr", "--lora_layers", "all-linear"), ()),
    (("--adapter", "loha", "--lora_layers", "all-linear"), ()),
    (("--lora_layers", "attention,x_embedder,context_embedder,proj_out,norm_out.linear"), ()),
    (("--lora_layers", ",".join(("attention", *UNMAPPED))), UNMAPPED)],
    ids=["attention", "default", "all-linear", "lokr", "loha", "global-layers", "time-and-modulation"])
def test_comfyui_applies_the_diffusers_file_as_trained(extra, skipped, tiny_model, accelerator, tmp_path):
    """The default file in ComfyUI: every layer of the presets (single-stream blocks and feed-forwards included), for
    LoRA, LoKr and LoHa, gets the update it trained; only the time embedder and the shared modulation are skipped."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    args, transformer = _adapted(tiny_model, accelerator, "--rank", "2", "--lora_alpha", "6", *extra)
    _write(args, transformer, tmp_path)
    config = transformer.config
    applied, left_out = _comfyui_applies(tmp_path / T.LORA_WEIGHTS_NAME,
                                         config.num_attention_heads * config.attention_head_dim)
    assert left_out == set(skipped)
    layers = {n: m for n, m in transformer.named_modules() if isinstance(m, BaseTunerLayer)}
    assert len(layers) >= 4
    for name, layer in layers.items():
        if name not in skipped:
            torch.testing.assert_close(applied.pop(f"{name}.weight"), layer.get_delta_weight("default"), rtol=1e-5,
                                       atol=1e-6)
    assert not applied  # no other weight changes


def test_comfyui_refuses_a_layer_without_an_exact_comfyui_name(tiny_model):
    args = _args(tiny_model, "--lora_layers", "attention,norm_out.linear", "--lora_format", "comfyui")
    with pytest.raises(T.UsageError, match="--lora_format comfyui: norm_out.linear: no exact ComfyUI .BFL. name"):
        T.check_model_fit(args)


# ---------------------------------------------------------------------------------------------------------------
# LoKr and LoHa files (LyCORIS layout) reload through PEFT; DoRA through diffusers


def _from_lycoris(state, config):
    """A LyCORIS file as to_lycoris writes it -> PEFT names: lycoris_<name with _> and diffusion_model.<BFL name>
    decoded, a LoKr's alpha / r taken back out of lokr_w1 where its file has no .alpha."""
    bfl_to_diffusers = {}
    for n in range(4):
        for sub, (bfl, block) in T.BFL_DOUBLE.items():
            if block is None:
                bfl_to_diffusers[f"double_blocks.{n}.{bfl}"] = f"transformer_blocks.{n}.{sub}"
        for sub, bfl in T.BFL_SINGLE.items():
            bfl_to_diffusers[f"single_blocks.{n}.{bfl}"] = f"single_transformer_blocks.{n}.{sub}"
    out, modules = {}, {}
    for key, value in state.items():
        prefix, _, part = key.rpartition(".")
        if prefix.startswith("diffusion_model."):
            module = bfl_to_diffusers[prefix.removeprefix("diffusion_model.")]
        else:
            module = re.sub(r"^lycoris_(single_transformer_blocks|transformer_blocks)_(\d+)_attn_",
                            r"\1.\2.attn.", prefix)
        modules.setdefault(module, {})[part] = value
    for module, parts in modules.items():
        if "alpha" not in parts and "lokr_w1" in parts:
            parts["lokr_w1"] = parts["lokr_w1"] / (config.alpha / config.r)
        out.update({f"{module}.{p}": v for p, v in parts.items() if p != "alpha"})
    return out


def _comfyui_delta(parts):
    """A module's update as ComfyUI computes it (comfy/weight_adapter/lora.py, lokr.py, loha.py), alpha read only
    from an `.alpha` tensor: a LoRA's B @ A and a LoHa's product scaled by alpha / rank, a LoKr's by alpha / dim only
    when a factor is decomposed (dim: that factor's rank); without `.alpha`, by 1."""
    alpha = parts.get("alpha")
    if "lora_A.weight" in parts:
        return (parts["lora_B.weight"] @ parts["lora_A.weight"]) * (
            alpha / parts["lora_A.weight"].shape[0] if alpha is not None else 1.0)
    if "hada_w1_a" in parts:
        delta = (parts["hada_w1_a"] @ parts["hada_w1_b"]) * (parts["hada_w2_a"] @ parts["hada_w2_b"])
        return delta * (alpha / parts["hada_w1_b"].shape[0] if alpha is not None else 1.0)
    w1 = parts["lokr_w1"] if "lokr_w1" in parts else parts["lokr_w1_a"] @ parts["lokr_w1_b"]
    w2 = parts["lokr_w2"] if "lokr_w2" in parts else parts["lokr_w2_a"] @ parts["lokr_w2_b"]
    dim = parts["lokr_w2_b"].shape[0] if "lokr_w2_b" in parts else \
        parts["lokr_w1_b"].shape[0] if "lokr_w1_b" in parts else None
    return torch.kron(w1, w2) * (alpha / dim if dim is not None and alpha is not None else 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("adapter, rank, extra", [("lokr", 2, ()), ("lokr", 8, ()),  # rank 8: both factors full
                                                  ("lokr", 2, ("--lokr_decompose_both", "--lokr_factor", "4")),
                                                  ("loha", 2, ())])
def test_a_lycoris_file_reloads_through_peft_to_the_trained_outputs(adapter, rank, extra, tiny_model, accelerator,
                                                                     tmp_path):
    from peft import set_peft_model_state_dict
    from peft.tuners.tuners_utils import BaseTunerLayer

    args, transformer = _adapted(tiny_model, accelerator, "--adapter", adapter, "--lora_format", "comfyui",
                                 "--lora_layers", "all-linear", "--rank", rank, "--lora_alpha", "3", *extra)
    _write(args, transformer, tmp_path)
    written = load_file(str(tmp_path / T.LORA_WEIGHTS_NAME))
    assert any(k.startswith("lycoris_transformer_blocks_0_attn_to_q.") for k in written)  # a row slice in ComfyUI
    assert any(k.startswith("diffusion_model.single_blocks.0.linear1.") for k in written)
    config = transformer.peft_config["default"]
    fresh = _fresh(tiny_model)
    fresh.add_adapter(config)
    result = set_peft_model_state_dict(fresh, _from_lycoris(written, config), adapter_name="default")
    assert not result.unexpected_keys
    assert not torch.allclose(_out(transformer), _out(_fresh(tiny_model)), atol=1e-4)  # the adapter changes things
    torch.testing.assert_close(_out(fresh), _out(transformer), rtol=1e-5, atol=1e-6)
    # what ComfyUI applies from the file is the update PEFT trained, module by module
    groups = {}
    for key, value in written.items():
        prefix, _, part = key.rpartition(".")
        groups.setdefault(prefix, {})[part] = value
    layers = {n: m for n, m in transformer.named_modules() if isinstance(m, BaseTunerLayer)}
    for name, layer in layers.items():
        bfl, block = T.bfl_name(name)  # q, k, v: row slices of the fused qkv in ComfyUI; the rest by BFL name
        prefix = f"lycoris_{name.replace('.', '_')}" if block is not None else f"diffusion_model.{bfl}"
        torch.testing.assert_close(_comfyui_delta(groups[prefix]), layer.get_delta_weight("default"), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_dora_file_loads_with_diffusers_and_gives_the_trained_outputs(tiny_model, accelerator, tmp_path):
    args, transformer = _adapted(tiny_model, accelerator, "--use_dora", "--rank", "3", "--lora_alpha", "6")
    _write(args, transformer, tmp_path)
    assert any("lora_magnitude_vector" in k for k in load_file(str(tmp_path / T.LORA_WEIGHTS_NAME)))
    loaded = _diffusers_load(tiny_model, tmp_path / T.LORA_WEIGHTS_NAME)
    assert not torch.allclose(_out(transformer), _out(_fresh(tiny_model)), atol=1e-4)
    torch.testing.assert_close(_out(loaded), _out(transformer), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra, message", [
    (["--adapter", "lokr", "--use_dora"], "--adapter lokr takes no --use_dora"),
    (["--adapter", "loha", "--lora_dropout", "0.1"], "--adapter loha takes no"),
    (["--use_dora", "--lora_format", "both"], "no ComfyUI file is exact"),
    (["--adapter", "lokr", "--do_fp8_training"], "LoKr .--use_dora, --adapter. is not verified with --do_fp8_training"),
])
def test_adapter_combinations_that_cannot_work_are_refused(extra, message, tmp_path):
    args = T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_data_dir", ".", "--instance_prompt", "p",
                         "--output_dir", str(tmp_path), *extra])
    with pytest.raises(T.UsageError, match=message):
        T.Adapters(args).check()
    if "--do_fp8_training" not in extra:
        with pytest.raises(T.UsageError, match=message):
            T.validate_args(args)


# ---------------------------------------------------------------------------------------------------------------
# --init_lora


def _kohya(bfl_state, alpha):
    """A kohya file of the same update: lora_unet_<BFL name with _>.lora_down / lora_up, and an alpha (its scale
    alpha / rank taken out of lora_up)."""
    out = {}
    for key, value in bfl_state.items():
        module, _, part = key.removeprefix("diffusion_model.").rpartition(".lora_")
        name = "lora_unet_" + module.replace(".", "_")
        if part == "A.weight":
            out[f"{name}.lora_down.weight"] = value
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
        else:
            out[f"{name}.lora_up.weight"] = value / (alpha / value.shape[1])
    return out


@pytest.fixture(scope="module")
def lora_files(tiny_model, accelerator, tmp_path_factory):
    """One update in three layouts: ours (rank 3, alpha 6: the scale folded in), ai-toolkit/BFL, kohya."""
    folder = tmp_path_factory.mktemp("loras")
    args, transformer = _adapted(tiny_model, accelerator, "--rank", "3", "--lora_alpha", "6", "--lora_format", "both",
                                 "--lora_layers", "attention,to_qkv_mlp_proj,ff.linear_in")
    _write(args, transformer, folder)
    (folder / "ours").mkdir()
    (folder / T.LORA_WEIGHTS_NAME).rename(folder / "ours" / T.LORA_WEIGHTS_NAME)
    bfl = load_file(str(folder / T.COMFYUI_WEIGHTS_NAME))
    save_file(_kohya(bfl, alpha=2.0), str(folder / "kohya.safetensors"))
    return {"ours": folder / "ours", "bfl": folder / T.COMFYUI_WEIGHTS_NAME, "kohya": folder / "kohya.safetensors"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ours", "bfl", "kohya"])
def test_init_lora_starts_from_the_model_that_load_lora_weights_makes(layout, lora_files, tiny_model, accelerator):
    from accelerate import PartialState
    from diffusers import Flux2Pipeline
    from transformers import AutoTokenizer

    PartialState()
    args = _args(tiny_model, "--init_lora", lora_files[layout], "--lora_alpha", "5")  # a scale of its own: rescaled
    T.resolve_model_flags(args, T.Hooks(args))  # reads the file: its rank and layers become the run's
    assert args.rank == 3 and set(T.read_init_lora(str(lora_files[layout])).ranks.values()) == {3}  # as trained
    ours = T.prepare_transformer(args, accelerator, T.load_transformer(args, torch.float32)).eval()
    pipe = Flux2Pipeline.from_pretrained(tiny_model, tokenizer=None)
    pipe.tokenizer = AutoTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    pipe.load_lora_weights(str(lora_files[layout]))
    expected = _out(pipe.transformer.eval())
    assert not torch.allclose(expected, _out(_fresh(tiny_model)), atol=1e-4)
    torch.testing.assert_close(_out(ours), expected, rtol=1e-5, atol=1e-6)


def _resolve(args):
    return T.resolve_model_flags(args, T.Hooks(args))


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["--rank", "8"], r"--rank 8 conflicts with --init_lora .* which has rank 3"),
    (["--lora_layers", "attention"], r"--lora_layers attention names other layers than --init_lora"),
    (["--use_dora"], r"--use_dora conflicts with --init_lora .*, a plain LoRA"),
])
def test_init_lora_conflicts_are_refused_naming_both(extra, message, lora_files, tiny_model):
    from accelerate import PartialState

    PartialState()
    with pytest.raises(T.UsageError, match=message):
        _resolve(_args(tiny_model, "--init_lora", lora_files["ours"], *extra))
    _resolve(_args(tiny_model, "--init_lora", lora_files["ours"], "--rank", "3"))  # the same: fine


@pytest.mark.slow
def test_init_lora_refuses_layers_the_model_lacks(lora_files, tiny_model, tmp_path):
    from accelerate import PartialState

    PartialState()
    state = load_file(str(lora_files["ours"] / T.LORA_WEIGHTS_NAME))
    state = {k.replace("transformer_blocks.0.", "transformer_blocks.7."): v for k, v in state.items()}
    save_file(state, str(tmp_path / "other.safetensors"))
    with pytest.raises(T.UsageError, match="has no linear layer single_transformer_blocks.7.attn.to_qkv_mlp_proj"):
        _resolve(_args(tiny_model, "--init_lora", tmp_path / "other.safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# Whole runs: every adapter trains, checkpoints, resumes bit for bit, with EMA, cached latents and two processes


def _tensors(path):
    return load_file(str(path))


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [["--use_dora"], ["--adapter", "lokr", "--lokr_decompose_both"],
                                     ["--adapter", "loha"], ["--init_lora", "FILE"]],
                         ids=["dora", "lokr", "loha", "init_lora"])
def test_each_adapter_trains_checkpoints_and_resumes_bit_for_bit(adapter, lora_files, tiny_model, images, tmp_path):
    adapter = [str(lora_files["ours"]) if a == "FILE" else a for a in adapter]
    common = ["--max_train_steps", "4", "--checkpointing_steps", "2", "--use_ema", "--cache_latents", "--rank", "3",
              *adapter]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch(base_args(tiny_model, images, straight, *common))
    resumed.mkdir()
    import shutil

    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    launch(base_args(tiny_model, images, resumed, *common, "--resume_from_checkpoint", "latest"))
    for name in (T.LORA_WEIGHTS_NAME, T.RAW_LORA_WEIGHTS_NAME):
        assert _equal(_tensors(straight / name), _tensors(resumed / name)), name
    assert not _equal(_tensors(straight / T.LORA_WEIGHTS_NAME), _tensors(straight / "checkpoint-2" / T.LORA_WEIGHTS_NAME))
    two = launch(base_args(tiny_model, images, tmp_path / "two", *common), num_processes=2)
    prints = re.findall(r"\[RANK (\d)\] LoRA fingerprint (\w+)", two.stderr)
    assert sorted(r for r, _ in prints) == ["0", "1"] and prints[0][1] == prints[1][1], two.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# Validation at several prompts and strengths


def test_validation_prompts_file_syntax(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("# a comment\n\na photo of sks dog\na sks dog on a beach --size 48x32 --seed 3 --steps 2 --guidance 4.5\n")
    specs = T.read_validation_prompts(str(good))
    assert specs == [T.ValidationSpec("a photo of sks dog"),
                     T.ValidationSpec("a sks dog on a beach", height=32, width=48, seed=3, steps=2, guidance=4.5)]
    for line, message in (("a dog --size 40x32", "line 1: --size 40x32: expected --size WxH"),
                          ("a dog --steps 0", "line 1: --steps 0"), ("a dog --colour red", "--colour red"),
                          ("--seed 3", "line 1: no prompt")):
        bad = tmp_path / f"bad{len(message)}.txt"
        bad.write_text(line + "\n")
        with pytest.raises(T.UsageError, match=message):
            T.read_validation_prompts(str(bad))


def test_validation_shows_each_prompt_at_each_strength_beside_the_base_model(tiny_model, images, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a sks dog on a beach --size 48x32 --seed 3\na red car --steps 3\n")
    out = tmp_path / "out"
    launch(base_args(tiny_model, images, out, "--max_train_steps", "4", "--learning_rate", "1e-2",
                     "--validation_prompt", "a photo of sks dog", "--validation_prompts_file", prompts,
                     "--validation_lora_scales", "0,1", "--num_validation_images", "1"))
    folder = out / "validation"
    rows = [np.asarray(Image.open(folder / f"final-{r}.png")) for r in range(6)]  # 3 prompts x 2 strengths
    base = [np.asarray(Image.open(folder / f"base-{r}.png")) for r in range(6)]
    assert not (folder / "final-6.png").exists()
    assert rows[2].shape == (32, 48, 3) and rows[0].shape == (32, 32, 3)  # the second prompt's --size
    for prompt in range(3):
        zero, one = 2 * prompt, 2 * prompt + 1
        assert np.array_equal(rows[zero], base[zero])  # strength 0 is the base model
        assert not np.array_equal(rows[one], base[one])  # strength 1, the trained LoRA
    assert not np.array_equal(base[0], base[4])  # other prompts
    sheet = Image.open(folder / "progress-0.png")
    assert sheet.height > 6 * 32  # a row per prompt and strength
    card = (out / "README.md").read_text()
    assert "validation/final-5.png" in card


@pytest.mark.slow
def test_a_dora_init_lora_meets_doras_refusals(tiny_model, accelerator, tmp_path):
    """--init_lora of a DoRA file makes the run DoRA after the flags were checked: ComfyUI's file (whose DoRA
    convention is not PEFT's) and DoRA's unverified paths are refused then too, not written as a plain LoRA."""
    args, transformer = _adapted(tiny_model, accelerator, "--use_dora", "--rank", "3")
    _write(args, transformer, tmp_path)
    for extra, message in ((["--lora_format", "both"], "no ComfyUI file is exact"),
                           (["--blocks_to_swap", "1"], "DoRA .--use_dora, --adapter. is not verified with")):
        args = _args(tiny_model, "--init_lora", tmp_path / T.LORA_WEIGHTS_NAME, *extra)
        with pytest.raises(T.UsageError, match=message):
            T.resolve_model_flags(args, T.Hooks(args))
