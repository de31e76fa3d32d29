"""--blocks_to_swap on the CPU: the schedule (which block is on the device, when) as a pure helper, training with
swapping equal to training without (the swapper's evicted blocks hold empty weights, so a schedule that ran a block
that is not in would fail), the whole script with validation, checkpoints and resume, and the refusals."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args
from tests.test_speed import _args, _train
from tests.tiny_flux2 import JOINT_ATTENTION_DIM


def _run_pass(schedule, n, training, recompute, trace, backward=True):
    """The events of one pass over n blocks (a training step: forward, then backward in reverse with each block
    recomputed under gradient checkpointing; backward=False: a step abandoned after its forward), applied to a model
    of the device; asserts that every block is on the device when it computes and that at most two swapped blocks
    ever are."""
    on = trace.setdefault("on", set())

    def apply(actions):
        for action, i in actions:
            assert i in schedule.swapped
            if action == "load":
                assert i not in on
                on.add(i)
            elif action == "evict":
                assert i in on
                on.remove(i)
            else:
                assert action == "wait" and i in on
            trace["log"].append((action, i))
        assert len(on) <= 2
        trace["peak"] = max(trace.get("peak", 0), len(on))

    def compute(i, what):
        assert i not in schedule.swapped or i in on, f"block {i} computes its {what} while not on the device"
        trace["log"].append((what, i))

    apply(schedule.begin_pass())
    for i in range(n):
        apply(schedule.before_block(i))
        compute(i, "forward")
        apply(schedule.after_block(i, training))
    if training and backward:
        for i in reversed(range(n)):
            apply(schedule.before_backward(i))
            if recompute:
                apply(schedule.before_block(i))
                compute(i, "recompute")
                apply(schedule.after_block(i, True))
            compute(i, "backward")


@pytest.mark.parametrize("recompute", [True, False], ids=["checkpointed", "plain"])
def test_every_block_is_in_when_it_runs_and_at_most_two_are(recompute):
    for n in range(1, 7):
        for swap in range(n + 1):
            schedule = T.SwapSchedule(n, swap)
            trace = {"log": []}
            # steps, validation passes and a step abandoned after its forward, mixed
            for training, backward in ((True, True), (True, True), (False, True), (True, False), (True, True),
                                       (False, True), (False, True)):
                _run_pass(schedule, n, training, recompute, trace, backward)
            assert trace["peak"] <= 2
            if swap >= 2:
                assert trace["peak"] == 2


def _count_resident(swapper):
    """Counts the swapped blocks on the device as the swapper carries out its schedule -> a function: the peak."""
    resident, peak, carry_out = set(), [0], swapper.carry_out

    def counting(actions):
        for action, i in actions:
            resident.add(i) if action == "load" else resident.discard(i) if action == "evict" else None
        peak[0] = max(peak[0], len(resident))
        return carry_out(actions)

    swapper.carry_out = counting  # the hooks call it through the instance
    return lambda: peak[0]


def test_training_step_copies_ahead_and_evicts_behind():
    """4 blocks, the last 2 swapped, a steady-state step: block 3 is copied while block 2 computes, block 2 is
    copied while block 3's backward runs, each leaves when done, and block 2 stays for the next step."""
    schedule = T.SwapSchedule(4, 2)
    first = {"log": []}
    _run_pass(schedule, 4, True, True, first)
    steady = {"log": [], "on": first["on"]}
    _run_pass(schedule, 4, True, True, steady)
    assert steady["log"] == [
        ("forward", 0), ("forward", 1),
        ("wait", 2), ("load", 3), ("forward", 2), ("evict", 2),
        ("wait", 3), ("forward", 3),
        ("wait", 3), ("load", 2), ("wait", 3), ("recompute", 3), ("backward", 3),
        ("evict", 3), ("wait", 2), ("wait", 2), ("recompute", 2), ("backward", 2),
        ("recompute", 1), ("backward", 1), ("recompute", 0), ("backward", 0),
    ]
    assert steady["on"] == {2}
    # 2 swapped blocks cost 2 * 2 - 2 copies a step: block 2 once (kept between steps), block 3 once (kept
    # from its forward to its backward)
    assert [a for a, _ in steady["log"]].count("load") == 2


@pytest.fixture(scope="module")
def deep_model(tiny_model, tmp_path_factory):
    """The tiny pipeline with a transformer of 2 double-stream and 3 single-stream blocks."""
    from diffusers import Flux2Transformer2DModel

    path = tmp_path_factory.mktemp("deep") / "tiny-flux2-deep"
    path.mkdir()
    for entry in Path(tiny_model).iterdir():
        if entry.name != "transformer":
            os.symlink(entry, path / entry.name)
    config = dict(Flux2Transformer2DModel.load_config(Path(tiny_model) / "transformer"))
    config.update(num_layers=2, num_single_layers=3)
    torch.manual_seed(0)
    Flux2Transformer2DModel.from_config(config).save_pretrained(path / "transformer")
    return str(path)


def test_training_with_swapped_blocks_equals_training_without(deep_model, images, tmp_path, monkeypatch):
    """The last 3 of 5 blocks swapped, gradient checkpointing (swapping needs it), three buckets of two steps: the
    same losses and LoRA bit for bit, with the copies the schedule promises (2 * 3 - 2 a step once running)."""
    shapes = [(4, 4), (4, 6), (6, 4)]
    plain_losses, plain_lora = _train(_args(deep_model, images, tmp_path, "--gradient_checkpointing"), deep_model, shapes)
    moves, carry_out = [], T.BlockSwapper.carry_out
    monkeypatch.setattr(T.BlockSwapper, "carry_out", lambda self, actions: (
        moves.extend((a, i) for a, i in actions if a != "wait") or carry_out(self, actions)))
    args = _args(deep_model, images, tmp_path, "--gradient_checkpointing", "--blocks_to_swap", "3")
    swapped_losses, swapped_lora = _train(args, deep_model, shapes)
    # forward: 3 comes while 2 runs, 4 while 3 runs; backward in reverse; each block leaves once its work is done
    step = [("load", 3), ("evict", 2), ("load", 4), ("evict", 3), ("load", 3), ("evict", 4), ("load", 2), ("evict", 3)]
    assert moves == [("load", 2)] + step * 6
    assert swapped_losses == plain_losses
    assert swapped_lora.keys() == plain_lora.keys()
    assert all(torch.equal(swapped_lora[k], plain_lora[k]) for k in plain_lora)


def test_output_preservation_with_swapped_blocks_equals_it_without(deep_model, images, tmp_path):
    """--output_preservation adds a forward without gradients (adapters off) before the trained one: the swapper
    serves it as any pass, and training is the same bit for bit."""
    shapes = [(4, 4), (4, 6)]
    plain = _train(_args(deep_model, images, tmp_path, "--gradient_checkpointing"), deep_model, shapes, preservation=1.0)
    args = _args(deep_model, images, tmp_path, "--gradient_checkpointing", "--blocks_to_swap", "3")
    swapped = _train(args, deep_model, shapes, preservation=1.0)
    assert swapped[0] == plain[0] and all(torch.equal(swapped[1][k], plain[1][k]) for k in plain[1])
    assert plain[0] != _train(_args(deep_model, images, tmp_path, "--gradient_checkpointing"), deep_model, shapes)[0]


def test_fp8_weights_swap_like_bf16_ones(deep_model, images, tmp_path):
    """--do_fp8_training (torchao float8 matmuls, which run on the CPU too) with 3 blocks swapped: the swapped
    blocks' layers are float8 ones, and training equals fp8 training without swapping bit for bit."""
    from torchao.float8.float8_linear import Float8Linear

    shapes = [(4, 4), (4, 6)]
    flags = ("--gradient_checkpointing", "--do_fp8_training")
    plain = _train(_args(deep_model, images, tmp_path, *flags), deep_model, shapes)
    args = _args(deep_model, images, tmp_path, *flags, "--blocks_to_swap", "3")
    swapped = _train(args, deep_model, shapes)
    assert swapped[0] == plain[0] and all(torch.equal(swapped[1][k], plain[1][k]) for k in plain[1])
    transformer = T.prepare_transformer(args, __import__("accelerate").Accelerator(cpu=True),
                                        T.load_transformer(args, torch.float32))
    last = T.transformer_blocks(transformer)[-1]
    assert any(isinstance(m, Float8Linear) for m in last.modules())
    assert all(p.numel() == 0 for p in last.parameters() if not p.requires_grad)  # evicted, as bf16 ones are


def test_swapped_blocks_leave_the_device_and_keep_their_weights(deep_model, images, tmp_path):
    from accelerate import Accelerator

    args = _args(deep_model, images, tmp_path, "--gradient_checkpointing", "--blocks_to_swap", "3")
    reference = T.load_transformer(args, torch.float32)
    original = {n: p.detach().clone() for n, p in reference.named_parameters()}
    transformer = T.prepare_transformer(args, Accelerator(cpu=True), reference)
    swapper = transformer.block_swapper
    blocks = T.transformer_blocks(transformer)
    assert list(swapper.schedule.swapped) == [2, 3, 4]
    peak = _count_resident(swapper)

    def empty_frozen(i):
        return [p.numel() == 0 for p in blocks[i].parameters() if not p.requires_grad]

    assert all(all(empty_frozen(i)) if i in (2, 3, 4) else not any(empty_frozen(i)) for i in range(5))  # never all in
    with torch.no_grad():  # a sampling step, as validation runs it
        transformer(hidden_states=torch.randn(1, 16, 4), encoder_hidden_states=torch.randn(1, 8, JOINT_ATTENTION_DIM),
                    timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 4),
                    txt_ids=torch.zeros(8, 4))
    assert peak() == 2
    for i, block in enumerate(blocks):
        frozen = [(n, p) for n, p in block.named_parameters() if not p.requires_grad]
        lora = [p for n, p in block.named_parameters() if p.requires_grad]
        assert lora and all(p.numel() > 0 for p in lora)  # adapters never move
        empty = [p.numel() == 0 for _, p in frozen]
        assert all(empty) if i in (2, 3, 4) else not any(empty)  # a sampling pass leaves none of them in
    # the host copies are the checkpoint's weights (names as PEFT wraps them: base_layer)
    host = {id(p): h for weights in swapper.weights.values() for p, _, h, _ in weights}
    named = dict(transformer.named_parameters())
    for name, param in named.items():
        if id(param) in host:
            torch.testing.assert_close(host[id(param)], original[name.replace(".base_layer", "")], rtol=0, atol=0)
    # one host buffer a block (the pinned allocator rounds each allocation up to a power of two), none shared
    buffers = [{h.untyped_storage().data_ptr() for *_, h, _ in swapper.weights[i]} for i in (2, 3, 4)]
    assert all(len(b) == 1 for b in buffers) and len(set.union(*buffers)) == 3
    assert sum(len(weights) for weights in swapper.weights.values()) == len(host) > 3


def test_weights_a_layer_keeps_for_backward_leave_memory_and_come_back(deep_model, images, tmp_path):
    """A layer that keeps its weight for the backward pass outside autograd's saved tensors (bitsandbytes' 4-bit
    matmul does: checkpointing cannot drop it) still frees a swapped block's memory on eviction, and sees the weight
    again once the block is back for its backward pass: the slot's storage is emptied and refilled in place."""
    from accelerate import Accelerator

    args = _args(deep_model, images, tmp_path, "--gradient_checkpointing", "--blocks_to_swap", "3")
    transformer = T.prepare_transformer(args, Accelerator(cpu=True), T.load_transformer(args, torch.float32))
    transformer.train()
    swapper, blocks = transformer.block_swapper, T.transformer_blocks(transformer)
    kept, runs = {}, []  # block -> views of its weights from its first run, as a layer would keep them

    def keep(module, args, i):  # runs after the swapper's hook: the block is in
        kept.setdefault(i, [p.t() for p in module.parameters() if p.dim() == 2 and not p.requires_grad])
        runs.append((i, all(v.untyped_storage().nbytes() > 0 for v in kept[i])))

    for i in (2, 3, 4):
        blocks[i].register_forward_pre_hook(lambda module, args, i=i: keep(module, args, i))
    out = transformer(hidden_states=torch.randn(1, 16, 4), encoder_hidden_states=torch.randn(1, 8, JOINT_ATTENTION_DIM),
                      timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 4),
                      txt_ids=torch.zeros(8, 4), return_dict=False)[0]
    # after the forward pass only the last swapped block is in (it runs first backwards): the others' kept views
    # hold no memory
    assert {i: all(v.untyped_storage().nbytes() > 0 for v in kept[i]) for i in (2, 3, 4)} == {2: False, 3: False, 4: True}
    host = {id(p): h for weights in swapper.weights.values() for p, _, h, _ in weights}
    out.float().pow(2).mean().backward()
    # forward, then the recomputation in backward (in reverse): each time the views from the first run are full
    assert runs == [(2, True), (3, True), (4, True), (4, True), (3, True), (2, True)]
    # 4 and 3 evicted again after their backward; 2, the first swapped block, stays in for the next step
    assert {i: all(v.untyped_storage().nbytes() > 0 for v in kept[i]) for i in (2, 3, 4)} == {2: True, 3: False, 4: False}
    for weights in swapper.weights.values():  # and refilled with the same values each time
        assert all(slot.untyped_storage().nbytes() == 0 or torch.equal(slot, host[id(p)]) for p, _, _, slot in weights)


def test_whole_run_with_swapped_blocks_validates_checkpoints_and_resumes(tiny_model, images, tmp_path, monkeypatch):
    """The script end to end (the CUDA requirement lifted for the CPU): the same LoRA and validation images as without
    swapping, and a resume from its checkpoint ends where the uninterrupted run did."""
    monkeypatch.setattr(T.BlockSwapping, "check", lambda self: None)
    common = ["--max_train_steps", "4", "--checkpointing_steps", "2", "--gradient_checkpointing",
              "--validation_prompt", "a dog", "--num_validation_images", "1", "--validation_steps", "2"]
    plain, swapped, resumed = tmp_path / "plain", tmp_path / "swapped", tmp_path / "resumed"
    T.main(base_args(tiny_model, images, plain, *common))
    T.main(base_args(tiny_model, images, swapped, *common, "--blocks_to_swap", "2"))
    resumed.mkdir()
    shutil.copytree(swapped / "checkpoint-2", resumed / "checkpoint-2")
    T.main(base_args(tiny_model, images, resumed, *common, "--blocks_to_swap", "2", "--resume_from_checkpoint", "latest"))
    reference = load_file(str(plain / T.LORA_WEIGHTS_NAME))
    for out in (swapped, resumed):
        ours = load_file(str(out / T.LORA_WEIGHTS_NAME))
        assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    from PIL import Image

    for name in ("final-0.png", "step-000002-0.png"):
        expected = np.asarray(Image.open(plain / "validation" / name))
        assert (np.asarray(Image.open(swapped / "validation" / name)) == expected).all(), name


def test_block_swap_refusals(tiny_model, images, tmp_path, monkeypatch):
    args = T.parse_args(base_args(tiny_model, images, tmp_path, "--blocks_to_swap", "2", "--gradient_checkpointing"))
    option = T.BlockSwapping(args)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(T.UsageError, match="needs a CUDA GPU"):
        option.check()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(T.UsageError, match="under FSDP"):
        option.check()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    option.check()
    args.gradient_checkpointing = False
    with pytest.raises(T.UsageError, match="needs --gradient_checkpointing"):
        option.check()
    monkeypatch.undo()
    args.blocks_to_swap = 3  # the tiny transformer has 1 + 1 blocks
    with pytest.raises(T.UsageError, match=r"--blocks_to_swap 3: this transformer has 2 blocks \(1 double-stream, 1 single"):
        T.check_model_fit(args)
    args.blocks_to_swap = 2
    T.check_model_fit(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_block_swap_without_cuda_is_refused_before_anything_loads(tiny_model, images, tmp_path):
    args = T.parse_args(base_args(tiny_model, images, tmp_path, "--blocks_to_swap", "2", "--gradient_checkpointing"))
    with pytest.raises(T.UsageError, match="--blocks_to_swap needs a CUDA GPU"):
        T.validate_args(args)
