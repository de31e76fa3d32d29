"""Paths no run of the tiny model takes on its own: Prodigy and its flags, --scale_lr, --push_to_hub (the Hub faked),
--report_to with a missing tracker, class-image steps per family, the stop and NaN agreement across processes, and
--offload's moves (on a CPU there is nowhere to move to, so a spy records them)."""

import logging
import signal
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import train_dreambooth_lora_flux2 as T
from tests.conftest import base_args, launch, step_loss


def _args(*extra):
    return T.parse_args(["--pretrained_model_name_or_path", "m", "--instance_prompt", "p", "--instance_data_dir", ".",
                         *extra])


def _cpu(processes=1):
    from accelerate.utils import DistributedType

    return SimpleNamespace(num_processes=processes, device=torch.device("cpu"), distributed_type=DistributedType.NO)


@pytest.fixture
def fake_prodigy(monkeypatch):
    made = []

    class Prodigy(torch.optim.SGD):
        def __init__(self, params, lr, **options):
            made.append(dict(lr=lr, **options))
            super().__init__(params, lr=lr)

    monkeypatch.setitem(sys.modules, "prodigyopt", types.SimpleNamespace(Prodigy=Prodigy))
    real = T.importlib.util.find_spec
    monkeypatch.setattr(T.importlib.util, "find_spec", lambda name, *a: object() if name == "prodigyopt" else real(name, *a))
    return made


def test_prodigy_gets_its_flags_parsed_as_booleans(fake_prodigy):
    args = _args("--optimizer", "Prodigy", "--learning_rate", "1.0", "--adam_beta1", "0.8", "--prodigy_beta3", "0.5",
                 "--prodigy_decouple", "false", "--prodigy_use_bias_correction", "no", "--prodigy_safeguard_warmup", "0")
    T.validate_args(args)
    T.setup_optimizer(args, [torch.nn.Parameter(torch.zeros(2))], _cpu())
    assert fake_prodigy == [dict(lr=1.0, betas=(0.8, 0.999), beta3=0.5, weight_decay=1e-4, eps=1e-8, decouple=False,
                                 use_bias_correction=False, safeguard_warmup=False)]


def test_prodigy_without_its_package_is_refused_before_anything_loads(monkeypatch):
    real = T.importlib.util.find_spec
    monkeypatch.setattr(T.importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else real(name, *a))
    with pytest.raises(T.UsageError, match="--optimizer prodigy needs the prodigyopt package"):
        T.validate_args(_args("--optimizer", "prodigy", "--learning_rate", "1"))


@pytest.mark.parametrize("extra, processes, lr", [
    ([], 2, 1e-4),
    (["--scale_lr"], 1, 1e-4 * 3 * 2),
    (["--scale_lr"], 4, 1e-4 * 3 * 2 * 4),
])
def test_scale_lr_multiplies_by_batch_accumulation_and_processes(extra, processes, lr):
    args = _args("--train_batch_size", "3", "--gradient_accumulation_steps", "2", *extra)
    optimizer = T.setup_optimizer(args, [torch.nn.Parameter(torch.zeros(2))], _cpu(processes))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr)


def test_push_to_hub_uploads_the_lora_card_images_and_best_never_checkpoints_logs_paths_or_the_lock(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    out = tmp_path / "my-dog-lora"
    files = ["pytorch_lora_weights.safetensors", "README.md", "validation/final-0.png", "validation/progress-0.png",
             "checkpoint-500/training.safetensors", "checkpoint-500/trainer_state.json", "logs/run/events.out.tfevents.1",
             T.MANIFEST_NAME, "config.yaml", T.RUN_LOCK, "validation/scored/step-4/pytorch_lora_weights.safetensors",
             "best/pytorch_lora_weights.safetensors"]
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    calls = {}
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, exist_ok, token: calls.update(
        create=(repo_id, exist_ok, token)) or SimpleNamespace(repo_id=f"someone/{repo_id}"))
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: calls.update(upload=kw))
    monkeypatch.setattr(T, "logger", logging.getLogger("test"))
    args = _args("--output_dir", str(out), "--push_to_hub", "--hub_token", "hf_x")
    hub = T.Hub(args)
    assert hub.repository(False) is None and "create" not in calls  # a stopped run uploads nothing
    assert hub.repository(True) == "someone/my-dog-lora"
    assert calls["create"] == ("my-dog-lora", True, "hf_x")
    hub.publish("someone/my-dog-lora")
    upload = calls["upload"]
    assert upload["repo_id"] == "someone/my-dog-lora" and upload["folder_path"] == str(out) and upload["token"] == "hf_x"
    sent = set(filter_repo_objects(files, ignore_patterns=upload["ignore_patterns"]))
    assert sent == {"pytorch_lora_weights.safetensors", "README.md", "validation/final-0.png", "validation/progress-0.png",
                    "best/pytorch_lora_weights.safetensors"}  # config.yaml names local paths, .run.lock this machine


@pytest.mark.slow
def test_a_pushed_runs_card_loads_the_lora_from_the_repository_it_was_pushed_to(tiny_model, images, tmp_path,
                                                                                   monkeypatch, fresh_accelerate):
    """Without --hub_model_id the repository is the output folder's name under the token's account, known only once
    it is made: the card uploaded with the LoRA must load it from there, never from this machine's folder."""
    import huggingface_hub

    out, uploaded = tmp_path / "my-dog-lora", []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, exist_ok, token: SimpleNamespace(
        repo_id=f"someone/{repo_id}"))
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: uploaded.append(
        (kw["repo_id"], (out / "README.md").read_text())))
    T.main(base_args(tiny_model, images, out, "--max_train_steps", "1", "--push_to_hub"))
    (repo, card), = uploaded
    assert repo == "someone/my-dog-lora" and "pipe.load_lora_weights('someone/my-dog-lora'," in card
    assert str(out) not in card


@pytest.mark.parametrize("report_to, kept", [("wandb", []), ("all", ["tensorboard"]), ("tensorboard", ["tensorboard"])])
def test_a_tracker_that_is_not_installed_is_skipped_with_a_warning(report_to, kept, tmp_path, monkeypatch, caplog):
    import accelerate.utils
    from accelerate import PartialState

    PartialState()  # the script's logger needs it; the Accelerator itself is faked
    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)
    made = {}
    monkeypatch.setattr(T, "Accelerator", lambda **kw: made.update(kw) or SimpleNamespace(**kw))
    with caplog.at_level(logging.WARNING):
        T.setup_accelerator(_args("--report_to", report_to, "--output_dir", str(tmp_path)))
    assert (made["log_with"] or []) == kept
    assert ("--report_to wandb: not installed, not reporting to it" in caplog.text) == (report_to != "tensorboard")


@pytest.mark.parametrize("family, steps", [
    (T.Family("FLUX.2 [dev]", "Flux2Pipeline", "Mistral3ForConditionalGeneration"), 50),
    (T.Family("FLUX.2 [klein]", "Flux2KleinPipeline", "Qwen3ForCausalLM"), 50),
    (T.Family("FLUX.2 [klein]", "Flux2KleinPipeline", "Qwen3ForCausalLM", distilled=True), 4),
])
def test_class_images_use_the_pipelines_steps_and_distilled_klein_its_four(family, steps, tmp_path, monkeypatch):
    """The README's promise: the pipeline's default steps, except distilled [klein] (its validation steps, 4)."""
    import inspect

    import diffusers
    from PIL import Image

    seen = []

    class FakePipeline:
        def __call__(self, prompt, num_inference_steps=None, **kw):
            default = inspect.signature(getattr(diffusers, family.pipeline).__call__).parameters["num_inference_steps"]
            seen.append(num_inference_steps or default.default)
            return SimpleNamespace(images=[Image.new("RGB", (16, 16))] * len(prompt))

        components = {}
        to = set_progress_bar_config = lambda self, *a, **k: None  # noqa: E731

    monkeypatch.setattr(getattr(diffusers, family.pipeline), "from_pretrained", lambda *a, **k: FakePipeline())
    monkeypatch.setattr(T, "load_pipeline_tokenizer", lambda args: None)
    monkeypatch.setattr(T, "logger", logging.getLogger("test"))
    args = _args("--with_prior_preservation", "--class_prompt", "a dog", "--class_data_dir", str(tmp_path),
                 "--num_class_images", "2", "--text_encoder_out_layers", "1", "2")
    T.resolve_family_defaults(args, family)
    accelerator = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1,
                                  is_local_main_process=False, wait_for_everyone=lambda: None)
    T.generate_class_images(args, accelerator, 0, 0, family)
    assert seen == [steps] and len(list(tmp_path.glob("class-*.png"))) == 2


GB = 10**9


@pytest.mark.parametrize("sizes, free, offload, expected", [
    ([64 * GB, 48 * GB, 0.2 * GB], None, False, "device"),  # no GPU: stays put
    ([8 * GB, 8 * GB, 0.2 * GB], 80 * GB, False, "device"),  # [klein] 4B on 80 GB
    ([8 * GB, 8 * GB, 0.2 * GB], 80 * GB, True, "model"),  # asked for
    ([64 * GB, 48 * GB, 0.2 * GB], 80 * GB, False, "model"),  # [dev] on 80 GB: 112 GB in all, 64 GB the largest
    ([64 * GB, 48 * GB, 0.2 * GB], 24 * GB, False, "sequential"),  # [dev] on 24 GB: not even one model fits
    ([8 * GB, 8 * GB, 0.2 * GB], 18.5 * GB, False, "model"),  # 16.2 GB would fit, not with room for activations
])
def test_class_image_pipeline_placement(sizes, free, offload, expected):
    assert T.pipeline_placement(sizes, free, offload) == expected


def test_class_images_choose_offload_when_the_pipeline_does_not_fit(tmp_path, monkeypatch, caplog):
    import diffusers
    from PIL import Image

    calls = []

    class FakePipeline:
        components = {"transformer": torch.nn.Linear(1000, 1000), "text_encoder": torch.nn.Linear(1000, 1000),
                      "vae": torch.nn.Linear(10, 10), "scheduler": object()}

        def __call__(self, prompt, **kw):
            return SimpleNamespace(images=[Image.new("RGB", (16, 16))] * len(prompt))

        def to(self, device):
            calls.append(("to", str(device)))

        def enable_model_cpu_offload(self, device):
            calls.append(("model", str(device)))

        set_progress_bar_config = lambda self, *a, **k: None  # noqa: E731

    monkeypatch.setattr(diffusers.Flux2Pipeline, "from_pretrained", lambda *a, **k: FakePipeline())
    monkeypatch.setattr(T, "load_pipeline_tokenizer", lambda args: None)
    monkeypatch.setattr(T, "logger", logging.getLogger("test"))
    # two 4 MB models with the margin (2 GiB + a fifth) do not fit 2 GiB + 6 MB free; each alone does
    monkeypatch.setattr(T, "free_gpu_bytes", lambda device: 2 * 2**30 + 6 * 10**6)
    args = _args("--with_prior_preservation", "--class_prompt", "a dog", "--class_data_dir", str(tmp_path),
                 "--num_class_images", "1", "--text_encoder_out_layers", "1", "2")
    family = T.Family("FLUX.2 [dev]", "Flux2Pipeline", "Mistral3ForConditionalGeneration")
    accelerator = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1,
                                  is_local_main_process=False, wait_for_everyone=lambda: None)
    with caplog.at_level(logging.INFO, logger="test"):
        T.generate_class_images(args, accelerator, 0, 0, family)
    assert calls == [("model", "cpu")]
    assert "does not fit 2.2 GB free on the GPU: model CPU offload" in caplog.text
    monkeypatch.setattr(T, "free_gpu_bytes", lambda device: 80 * GB)
    calls.clear()
    args.num_class_images = 2
    T.generate_class_images(args, accelerator, 0, 1, family)
    assert calls == [("to", "cpu")]


@pytest.mark.parametrize("stage", ["prepare_data", "precompute", "setup_training"])
def test_out_of_memory_in_any_stage_gives_the_advice(stage, tiny_model, images, tmp_path, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 GiB")

    monkeypatch.setattr(T, stage, oom)
    with pytest.raises(T.TrainingStopped) as stopped:
        T.main(base_args(tiny_model, images, tmp_path / "out", "--max_train_steps", "1"))
    assert stopped.value.code == 1 and str(stopped.value) == T.OOM_ADVICE


# --------------------------------------------------------------------------------------------- several processes


class TwoRanks:
    """accelerator.gather between this process and another whose flags are `other` ([signal, loss not finite])."""

    num_processes, device = 2, torch.device("cpu")

    def __init__(self, other):
        self.other = torch.tensor(other)

    def gather(self, flags):  # [1, n] on each process -> [2, n]
        return torch.cat([flags, self.other[None]])


@pytest.mark.parametrize("mine, other, expected", [
    ((0, True), (0, 0), (0, True)),  # nobody signalled, every loss finite: go on
    ((0, True), (int(signal.SIGTERM), 0), (signal.SIGTERM, True)),  # the other process was signalled: stop here too
    ((int(signal.SIGINT), True), (0, 0), (signal.SIGINT, True)),
    ((0, True), (0, 1), (0, False)),  # NaN on the other process only: every process stops before the update
    ((0, False), (0, 0), (0, False)),
])
def test_a_signal_or_a_nan_on_one_process_stops_every_process(mine, other, expected):
    with T.StopRequest("after this step") as stop:
        stop.signum = mine[0]
        signum, bad = stop.agreed(TwoRanks(other), (~torch.tensor(mine[1])).long())
        assert (signum, not bad) == expected


def test_a_process_the_signal_has_not_reached_stops_with_the_others_at_the_final_join():
    """The end of a run is a collective: a stop signal one process got (or met in the final validation) stops all,
    each with its message, and the copy that reaches a process late is the same request, not a kill (a rank whose
    signal came after the card died by the default handler, message unprinted: the final-validation signal test)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(T.TrainingStopped), T.StopRequest("once the model card is written") as stop:
            assert stop.join(TwoRanks([int(signal.SIGTERM)])) == signal.SIGTERM  # the other process was signalled
            raise T.TrainingStopped("stopped by SIGTERM at the end", 143)
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        stop._handle(signal.SIGTERM, None)  # its own copy, late: the same request
        with T.StopRequest("once the model card is written") as stop:
            assert stop.join(TwoRanks([0]), signal.SIGINT) == signal.SIGINT  # met in the final validation
        with T.StopRequest("once the model card is written") as stop:
            assert stop.join(TwoRanks([0])) == 0 and stop.signum == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert {sig: signal.getsignal(sig) for sig in saved} == saved


# each rank reports how many DDP models are alive (not freed, garbage or not) as accelerate destroys the process group;
# rank 0 is preempted after its second backward pass
TEARDOWN_SITE = """
import gc, os, signal, sys
import accelerate, torch
_backward, _end, passes = accelerate.Accelerator.backward, accelerate.Accelerator.end_training, []
def backward(self, *args, **kwargs):
    passes.append(1)
    if len(passes) == 2 and os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGTERM)
    return _backward(self, *args, **kwargs)
def end_training(self):
    alive = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    print(f"rank {os.environ['RANK']}: {alive} DDP models alive", file=sys.stderr)
    return _end(self)
accelerate.Accelerator.backward, accelerate.Accelerator.end_training = backward, end_training
"""


@pytest.mark.slow
def test_the_model_is_freed_before_accelerate_destroys_the_process_group(tiny_model, images, tmp_path):
    """accelerate's end_training destroys the process group; a DDP model still alive then frees the gloo group last:
    at exit, holding the GIL while gloo's worker thread waits for it to free the last gather's tensors (two processes
    hung there, 6 runs in 15 under load), or in the interpreter's teardown, which aborts ("terminate called without
    an active exception", a metrics run now and then). Options hold the run (EMA here), and so do the frames of a
    stop's exception."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(TEARDOWN_SITE)
    proc = launch(base_args(tiny_model, images, tmp_path / "out", "--max_train_steps", "4", "--use_ema"),
                  num_processes=2, check=False, site=tmp_path / "site" / "sitecustomize.py")
    assert proc.returncode in (1, 128 + signal.SIGTERM), proc.stderr[-3000:]  # torchrun's code, or the rank's (forked)
    assert "stopped by SIGTERM at step 2" in proc.stderr, proc.stderr[-3000:]
    assert sorted(line for line in proc.stderr.splitlines() if "DDP models alive" in line) == [
        "rank 0: 0 DDP models alive", "rank 1: 0 DDP models alive"], proc.stderr[-3000:]


# --------------------------------------------------------------------------------------------------------- offload


class Spy(torch.nn.Module):
    def __init__(self, moves):
        super().__init__()
        self.moves = moves

    def to(self, device, *a, **k):
        self.moves.append(str(device))
        return self


def test_offload_brings_a_module_to_the_device_only_while_it_runs():
    moves = []
    vae = Spy(moves)
    with T.on_device(vae, torch.device("cuda", 0), offload=True) as used:  # a torch.device needs no GPU
        assert used is vae and moves == ["cuda:0"]
    assert moves == ["cuda:0", "cpu"]
    with pytest.raises(RuntimeError), T.on_device(vae, torch.device("cuda", 0), offload=True):
        raise RuntimeError("an error while encoding")
    assert moves == ["cuda:0", "cpu"] * 2  # back on the CPU even so
    with T.on_device(vae, torch.device("cuda", 0), offload=False):
        pass
    assert moves == ["cuda:0", "cpu"] * 2  # without --offload nothing moves


def test_uncached_training_encodes_under_offload(monkeypatch):
    """The step passes --offload on: the VAE visits the device for the encode and goes back."""
    moves = []
    vae = Spy(moves)
    monkeypatch.setattr(T, "encode_images", lambda module, pixels, *a: (moves.append("encode"), torch.zeros(len(pixels), 4, 2, 2))[1])
    inputs = T.StepInputs(torch.zeros(1, 3, 2), torch.tensor([0, 0]), torch.zeros(2, 3, 16, 16), torch.arange(2),
                          encoded=False)
    model = lambda hidden_states, **kwargs: (hidden_states.float(),)  # noqa: E731
    stats = (torch.zeros(4), torch.ones(4))
    step_loss(model, None, torch.zeros(2, 3, 2), torch.ones(1), inputs=inputs, vae=vae, latent_stats=stats, offload=True)
    assert moves == ["cpu", "encode", "cpu"]  # to the batch's device (the CPU here), encode, back
    moves.clear()
    step_loss(model, None, torch.zeros(2, 3, 2), torch.ones(1), inputs=inputs, vae=vae, latent_stats=stats)
    assert moves == ["encode"]
