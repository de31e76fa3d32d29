"""FSDP (v2) with the README's FLUX.2 wrapping, on two CPU processes.

accelerate only enables FSDP on accelerators: on a CPU (MULTI_CPU) it silently falls back to DDP. The test turns
FSDP back on after the Accelerator is built, from a sitecustomize that exists only in this test, so the script's
FSDP code paths (gathering the LoRA and optimizer state, sharded checkpoint load, validation on every process)
really run. The runs are forked from the zygote, which runs that file first (conftest.launch's `site`; a fresh
interpreter would find it on PYTHONPATH): three torchrun starts saved. Verified on GPU: no (see README)."""

import textwrap

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import base_args, launch

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "Flux2TransformerBlock,Flux2SingleTransformerBlock",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "FSDP_OFFLOAD_PARAMS": "false", "FSDP_USE_ORIG_PARAMS": "true",
}

FORCE_FSDP = textwrap.dedent("""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    _init = accelerate.Accelerator.__init__

    def __init__(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables
        self.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    accelerate.Accelerator.__init__ = __init__
""")


def _force(tmp_path):
    """FORCE_FSDP as a sitecustomize.py of its own folder."""
    (tmp_path / "force").mkdir()
    (tmp_path / "force" / "sitecustomize.py").write_text(FORCE_FSDP)
    return tmp_path / "force" / "sitecustomize.py"


@pytest.mark.slow
def test_fsdp_trains_checkpoints_and_resumes_like_ddp_and_the_sharded_text_encoder_encodes_alike(tiny_model, images,
                                                                                                  tmp_path):
    """The same LoRA as DDP, loading lean (cpu_ram_efficient_loading) or not (the resumed run), and resuming with
    compiled blocks (--compile under FSDP: rtol 1e-4, inductor reorders float32 sums). The FSDP run also encodes its
    prompts with --fsdp_text_encoder (each process holding half of the text encoder; 7 unique prompts over 2
    processes, so the padding that keeps the shards in step is exercised): the same cache entries as DDP's unsharded
    encoder. One test, so that these two-process runs are started once (each start costs more than its training)."""
    force = _force(tmp_path)
    common = ["--max_train_steps", "4", "--checkpointing_steps", "2", "--validation_prompt", "a dog",
              "--num_validation_images", "1"]
    ddp, fsdp, resumed = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "resumed"
    proc = launch(base_args(tiny_model, images, ddp, *common, "--precompute_cache_dir", tmp_path / "cache-plain"),
                  num_processes=2)
    assert "data parallel (every process a full copy, gradients averaged) over 2 processes" in proc.stderr
    # lean loading: process 1 builds an empty model and receives process 0's weights (and LoRA) while sharding
    proc = launch(base_args(tiny_model, images, fsdp, *common, "--fsdp_text_encoder", "--precompute_cache_dir",
                            tmp_path / "cache-sharded"), num_processes=2,
                  env={**FSDP_ENV, "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}, site=force)
    assert "FSDP (each process holds a shard of the model) over 2 processes" in proc.stderr
    assert "process 1: an empty transformer" in proc.stderr and "process 0: an empty" not in proc.stderr
    assert "text encoder sharded over 2 processes" in proc.stderr
    assert "[RANK 0] encoded 4 of 7 missing prompts" in proc.stderr and "[RANK 1] encoded 3 of 7" in proc.stderr
    plain, sharded = ({p.name: load_file(str(p))["value"] for p in (tmp_path / cache / "prompts").rglob("*.safetensors")}
                      for cache in ("cache-plain", "cache-sharded"))
    assert plain.keys() == sharded.keys() and len(plain) == 7
    assert all(torch.allclose(plain[k], sharded[k], atol=1e-6) for k in plain)
    resumed.mkdir()
    import shutil

    shutil.copytree(fsdp / "checkpoint-2", resumed / "checkpoint-2")
    proc = launch(base_args(tiny_model, images, resumed, *common, "--resume_from_checkpoint", "latest", "--compile"),
                  num_processes=2, env=FSDP_ENV, site=force)
    assert "--compile: 2 blocks compile" in proc.stderr
    reference = load_file(str(ddp / "pytorch_lora_weights.safetensors"))
    for out, rtol in ((fsdp, 1e-5), (resumed, 1e-4)):
        ours = load_file(str(out / "pytorch_lora_weights.safetensors"))
        assert ours.keys() == reference.keys()
        assert all(torch.allclose(ours[k], reference[k], rtol=rtol, atol=1e-6) for k in ours)
        assert all((out / "validation" / name).is_file() for name in ("final-0.png", "base-0.png", "progress-0.png"))
    ckpt = load_file(str(fsdp / "checkpoint-2" / "pytorch_lora_weights.safetensors"))
    assert all(v.shape == load_file(str(ddp / "checkpoint-2" / "pytorch_lora_weights.safetensors"))[k].shape
               for k, v in ckpt.items())  # full tensors, not shards


def test_fsdp_leaves_the_transformer_for_accelerate_to_shard_and_other_ranks_load_nothing(tiny_model, monkeypatch):
    """Under FSDP no process moves the whole transformer to its device (accelerate shards it one block at a time);
    without FSDP it is moved. With cpu_ram_efficient_loading, only process 0 reads weights: the others get an empty
    model whose parameters (LoRA included) have distinct storage, as accelerate's optimizer hand-over needs."""
    from types import SimpleNamespace

    from accelerate import PartialState
    from accelerate.utils import DistributedType

    import train_dreambooth_lora_flux2 as T

    PartialState(cpu=True)  # for the logger
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate's FSDP config sets: the FSDP option is on
    args = T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--instance_prompt", "x", "--rank", "2"])
    option = T.FSDP(args)
    assert [type(o) for o in T.Hooks(args).options] == [T.FSDP]

    def accelerator(kind, main=True, lean=False):  # "meta" stands in for the GPU: a move there is visible
        plugin = SimpleNamespace(cpu_ram_efficient_loading=lean)
        return SimpleNamespace(device=torch.device("meta"), distributed_type=kind, is_main_process=main,
                               process_index=0 if main else 1, state=SimpleNamespace(fsdp_plugin=plugin))

    def moves(kind):
        transformer, calls = T.load_transformer(args, torch.float32), []
        transformer.to = lambda *a, **k: calls.append((a, k)) or torch.nn.Module.to(transformer, *a, **k)
        T.prepare_transformer(args, accelerator(kind), transformer)
        return calls

    assert moves(DistributedType.MULTI_CPU) == [((torch.device("meta"),), {})]
    assert moves(DistributedType.FSDP) == []

    def empty(*how):  # what the option loads instead of the weights (None: the weights are loaded)
        return option.load_transformer(accelerator(*how), torch.float32)

    assert empty(DistributedType.FSDP, False, True) is not None
    assert empty(DistributedType.FSDP, True, True) is None
    assert empty(DistributedType.FSDP, False, False) is None
    assert empty(DistributedType.MULTI_CPU, False, True) is None
    quantized = T.FSDP(T.parse_args(["--pretrained_model_name_or_path", str(tiny_model), "--bnb_quantization_config_path",
                                     __file__]))
    assert quantized.load_transformer(accelerator(DistributedType.FSDP, False, True), torch.float32) is None
    empty = T.prepare_transformer(args, accelerator(DistributedType.FSDP, main=False, lean=True),
                                  empty(DistributedType.FSDP, False, True))
    params = list(empty.parameters())
    assert {p.device.type for p in params} == {"cpu"} and any(p.requires_grad for p in params)
    assert len({p.data_ptr() for p in params}) == len(params)


@pytest.mark.slow
def test_output_preservation_under_fsdp_trains_like_ddp(tiny_model, images, tmp_path):
    """--output_preservation's base prediction switches the adapters off on the sharded model and runs a forward
    without gradients before the trained one: FSDP2 gathers for both and gives DDP's LoRA."""
    common = ["--max_train_steps", "3", "--trigger_word", "sks", "--output_preservation", "--class_word", "dog",
              "--output_preservation_weight", "5"]
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    launch(base_args(tiny_model, images, ddp, *common), num_processes=2)
    proc = launch(base_args(tiny_model, images, fsdp, *common), num_processes=2, env=FSDP_ENV, site=_force(tmp_path))
    assert "FSDP (each process holds a shard of the model) over 2 processes" in proc.stderr
    reference, ours = (load_file(str(out / "pytorch_lora_weights.safetensors")) for out in (ddp, fsdp))
    assert ours.keys() == reference.keys()
    assert all(torch.allclose(ours[k], reference[k], rtol=1e-5, atol=1e-6) for k in ours)
