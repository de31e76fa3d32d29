"""--transformer_file (issue 60): the transformer from one .safetensors file in BFL's or ComfyUI's layout, the rest of
the checkpoint from --pretrained_model_name_or_path.

- tests/tiny_flux2.to_bfl, the inverse of diffusers' converter, loads back through diffusers' from_single_file to the
  same weights; a run from the file trains the LoRA a run from a folder of the same weights trains, bit for bit (and
  not the folder's own: the file's weights are a fine-tune's); config.yaml and the model card name the file and its
  SHA-256; class images are made with the file's transformer.
- fp8 files (plain, and ComfyUI's scaled ones with its prefix) load in the run's precision; a Hub URL is read from
  the Hub's cache.
- A file of another family, shape or format is refused before any model loads, naming the file and what differs.
- The memory plan counts the file loaded whole in host memory (quantised too).
"""

import hashlib
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch, make_images
from tests.tiny_flux2 import (KLEIN_JOINT_ATTENTION_DIM, _build_transformer, to_bfl,
                              write_bfl_transformer)


def _weights(folder):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_pretrained(folder, subfolder="transformer").state_dict()


@pytest.fixture(scope="module")
def tuned(tiny_model, tmp_path_factory):
    """A fine-tune of the tiny [dev] (its transformer's weights moved): its folder and its BFL-layout file."""
    from diffusers import Flux2Transformer2DModel

    root = tmp_path_factory.mktemp("tuned")
    folder = shutil.copytree(tiny_model, root / "tuned-folder")
    model = Flux2Transformer2DModel.from_pretrained(tiny_model, subfolder="transformer")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder / "transformer")
    return folder, write_bfl_transformer(folder, root / "tuned-bfl.safetensors")


def test_the_bfl_writer_is_the_inverse_of_diffusers_converter(tuned):
    from diffusers import Flux2Transformer2DModel

    folder, path = tuned
    names = set(load_file(str(path)))
    assert {"img_in.weight", "double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight",
            "final_layer.adaLN_modulation.1.weight", "guidance_in.in_layer.weight"} <= names
    loaded = Flux2Transformer2DModel.from_single_file(str(path), config=str(folder), subfolder="transformer")
    expected = _weights(folder)
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.fixture(scope="module")
def runs(tiny_model, tuned, tmp_path_factory):
    """The same tiny run from the fine-tune's folder and from the base folder with the fine-tune's file."""
    root = tmp_path_factory.mktemp("transformer-file-runs")
    make_images(str(root / "images"))
    folder, path = tuned
    flags = ("--max_train_steps", "3", "--learning_rate", "0.05", "--cache_latents", "--validation_prompt", "a dog",
             "--num_validation_images", "1", "--validation_epochs", "1000")
    return root, {"folder": launch(base_args(folder, root / "images", root / "folder", *flags)),
                  "file": launch(base_args(tiny_model, root / "images", root / "file", *flags,
                                           "--transformer_file", path))}


def test_a_run_from_the_file_trains_the_lora_of_a_run_from_a_folder_of_its_weights(runs, tuned):
    import yaml

    root, procs = runs
    lora = {name: load_file(str(root / name / T.LORA_WEIGHTS_NAME)) for name in procs}
    assert lora["file"].keys() == lora["folder"].keys() and lora["file"]
    for name, tensor in lora["file"].items():  # bit for bit
        assert torch.equal(tensor, lora["folder"][name]), name
    assert f"loading the transformer from {tuned[1]}" in procs["file"].stderr
    digest = hashlib.sha256(tuned[1].read_bytes()).hexdigest()
    config = yaml.safe_load((root / "file" / "config.yaml").read_text())
    assert config["transformer_file"] == str(tuned[1]) and config["transformer_file_sha256"] == digest
    card = (root / "file" / "README.md").read_text()
    assert f"`{tuned[1]}` (SHA-256 `{digest}`)" in card and "Flux2Transformer2DModel.from_single_file(" in card
    assert "transformer_file_sha256" not in (root / "folder" / "config.yaml").read_text()
    T.config_tokens(["--config", str(root / "file" / "config.yaml")])  # config.yaml repeats the run: its SHA is no flag


def _args(model, path, **extra):
    return SimpleNamespace(pretrained_model_name_or_path=str(model), transformer_file=str(path), cache_dir=None,
                           revision=None, **extra)


def test_fp8_files_load_in_the_runs_precision_comfyuis_scaled_ones_too(tiny_model, tmp_path):
    """A plain fp8 file (every tensor e4m3), and ComfyUI's scaled fp8 with its prefix: 2-D weights stored as
    weight / scale in e4m3 beside their scale, its quantisation records, the rest in bf16."""
    import json

    from accelerate import PartialState

    PartialState()  # the script's logger

    state = to_bfl(_weights(tiny_model))
    plain, scaled = tmp_path / "plain-fp8.safetensors", tmp_path / "comfy-fp8-scaled.safetensors"
    save_file({n: t.to(torch.float8_e4m3fn) for n, t in state.items()}, str(plain))
    comfy, expected = {}, {}
    for name, tensor in state.items():
        key = "model.diffusion_model." + name
        if tensor.ndim == 2:
            scale = tensor.abs().max() / 448
            comfy[key] = (tensor / scale).to(torch.float8_e4m3fn)
            comfy[key.removesuffix("weight") + "weight_scale"] = scale.reshape(())
            comfy[key.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
            comfy[key.removesuffix("weight") + "comfy_quant"] = torch.tensor(list(json.dumps(
                {"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
            expected[name] = comfy[key].float() * scale
        else:
            comfy[key] = tensor.to(torch.bfloat16)
            expected[name] = comfy[key].float()
    save_file(comfy, str(scaled))
    for path, want in ((plain, {n: t.to(torch.float8_e4m3fn).float() for n, t in state.items()}), (scaled, expected)):
        assert T.file_problem(T.safetensors_header(path), T.empty_transformer(_args(tiny_model, path))) is None
        loaded = to_bfl(T.load_transformer_file(_args(tiny_model, path), torch.float32).state_dict())
        assert loaded.keys() == want.keys()
        for name, tensor in loaded.items():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, want[name]), (path.name, name)
    model = T.load_transformer_file(_args(tiny_model, plain), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _refusal(model, path):
    from accelerate import PartialState

    PartialState()
    args = T.parse_args(["--pretrained_model_name_or_path", str(model), "--instance_data_dir", ".", "--instance_prompt",
                         "p", "--text_encoder_out_layers", "1", "2", "--transformer_file", str(path)])
    hooks = T.Hooks(args)
    T.validate_args(args, hooks)
    with pytest.raises(T.UsageError) as error:
        T.resolve_model_flags(args, hooks)
    assert str(error.value).startswith(f"--transformer_file {path}: "), error.value
    return str(error.value)


def test_a_file_of_another_family_shape_or_format_is_refused_before_any_model_loads(tiny_model, images, tmp_path):
    state = to_bfl(_weights(tiny_model))
    klein = tmp_path / "klein.safetensors"  # [klein]'s: no guidance embedding, another text width
    save_file(to_bfl(_build_transformer(KLEIN_JOINT_ATTENTION_DIM, guidance_embeds=False).state_dict()), str(klein))
    assert ("its transformer has 1 double- and 1 single-stream blocks of width 32, no guidance embedding, where the "
            "checkpoint's has 1 double- and 1 single-stream blocks of width 32, a guidance embedding") in _refusal(
        tiny_model, klein)
    from tests.test_learning import empty_transformer as real  # the real families' shapes, on the meta device

    header = {n: {"dtype": "BF16", "shape": list(t.shape)} for n, t in to_bfl(real("klein-4b").state_dict()).items()}
    assert T.file_problem(header, real("dev")) == (
        "its transformer has 5 double- and 20 single-stream blocks of width 3072, no guidance embedding, where the "
        "checkpoint's has 8 double- and 48 single-stream blocks of width 6144, a guidance embedding")
    narrow = tmp_path / "narrow.safetensors"
    save_file({**state, "txt_in.weight": state["txt_in.weight"][:, :16].contiguous()}, str(narrow))
    assert ("tensors that differ from the checkpoint's transformer's: 1, e.g. context_embedder.weight: (32, 16) in the "
            "file, (32, 32) expected") in _refusal(tiny_model, narrow)
    other = tmp_path / "sdxl.safetensors"
    save_file({"conv_in.weight": torch.zeros(4, 4)}, str(other))
    assert "not a FLUX.2 transformer in BFL, ComfyUI or diffusers layout" in _refusal(tiny_model, other)
    packed = tmp_path / "nvfp4.safetensors"  # ComfyUI's 4-bit: packed bytes
    save_file({**state, "img_in.weight": state["img_in.weight"].to(torch.uint8)}, str(packed))
    assert "it stores tensors as U8, a quantised format not read here" in _refusal(tiny_model, packed)
    text = tmp_path / "notes.safetensors"
    text.write_text("not a safetensors file")
    assert "cannot read it (ValueError: not a safetensors file" in _refusal(tiny_model, text)
    proc = launch(base_args(tiny_model, images, tmp_path / "out", "--transformer_file", klein), check=False)
    assert proc.returncode == 2 and f"error: --transformer_file {klein}: its transformer has" in proc.stderr
    assert "loading the text encoder" not in proc.stderr


def test_a_hub_url_is_read_from_the_hub_cache(tiny_model, tuned, tmp_path):
    """https://huggingface.co/OWNER/NAME/blob/REV/FILE: downloaded into --cache_dir (here already there: offline);
    its SHA-256 is its blob's name there."""
    from accelerate import PartialState

    data = tuned[1].read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    repo, commit = tmp_path / "hub" / "models--someone--tuned", "0" * 40
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / digest).write_bytes(data)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "dev").mkdir(parents=True)
    (repo / "snapshots" / commit / "dev" / "bfl.safetensors").symlink_to(repo / "blobs" / digest)
    url = "https://huggingface.co/someone/tuned/blob/main/dev/bfl.safetensors"
    args = T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--instance_data_dir", ".",
                         "--instance_prompt", "p", "--transformer_file", url, "--cache_dir", str(tmp_path / "hub")])
    option = T.TransformerFile(args)
    option.check_model(T.empty_transformer(args))
    option.resolved(0, 1, PartialState())
    assert args.transformer_sha256 == digest
    loaded = T.load_transformer_file(args, torch.float32).state_dict()
    assert all(torch.equal(t, _weights(tuned[0])[n]) for n, t in loaded.items())
    with pytest.raises(T.UsageError, match="--transformer_file https://example.com/x.safetensors: expected a "
                                           ".safetensors file, or a Hub URL to one"):
        T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--transformer_file",
                      "https://example.com/x.safetensors"])


def test_the_memory_plan_counts_the_file_loaded_whole(tiny_model, tuned):
    """From a file, loading holds the transformer in the run's precision and the file's largest tensor, quantised
    or not (from a folder, quantised weights load shard by shard onto the GPU)."""
    def estimate(*extra):
        args = T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--instance_data_dir", ".",
                             "--instance_prompt", "p", *extra])
        return T.run_estimate(args, torch.bfloat16)

    plain, from_file = estimate(), estimate("--transformer_file", str(tuned[1]))
    largest = max(t.numel() * 4 for t in load_file(str(tuned[1])).values())  # stored in float32
    assert plain.peak(True, 0, "nf4")["load"] == 0
    assert from_file.peak(True, 0, "nf4")["load"] == from_file.peak(True)["load"] == plain.unquantised + largest


def test_class_images_are_made_with_the_files_transformer(tiny_model, tuned, tmp_path, monkeypatch):
    """The class-image pipeline samples with the file's transformer (its call recorded, not run: 50 steps)."""
    from accelerate import Accelerator
    from diffusers import Flux2Pipeline
    from PIL import Image

    used = []
    monkeypatch.setattr(Flux2Pipeline, "__call__", lambda self, prompt, **kw: (used.append(self.transformer), (
        SimpleNamespace(images=[Image.new("RGB", (32, 32))] * len(prompt))))[1])
    args = T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--instance_data_dir", ".",
                         "--instance_prompt", "p", "--class_data_dir", str(tmp_path), "--class_prompt", "a dog",
                         "--num_class_images", "1", "--text_encoder_out_layers", "1", "2",
                         "--transformer_file", str(tuned[1])])
    T.generate_class_images(args, Accelerator(cpu=True), 0, 0, T.detect_family(args))
    expected = _weights(tuned[0])
    assert (tmp_path / "class-00000.png").is_file() and len(used) == 1
    assert all(torch.equal(t, expected[n]) for n, t in used[0].state_dict().items())
