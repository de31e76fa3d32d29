"""Shared fixtures: a tiny random FLUX.2 [dev] checkpoint on disk and a way to run the real script."""

import argparse
import atexit
import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in the tests may reach the Hub
# The disk cache is on by default, in $XDG_CACHE_HOME: never the user's, and (fixture below) a fresh one per test,
# so no test reuses another's entries. This session-wide folder covers fixtures wider than one test.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="flux2-tests-xdg-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
# torch.compile's kernel cache, fresh for each session and shared by its workers (they inherit it from the process
# that starts them), as on a CI machine: the user's warm one (/tmp/torchinductor_$USER) made the compile tests here
# about 3 CPU-minutes faster than on CI, and the suite's time a false promise
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="flux2-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)
# pytest-xdist workers share the cores: each (and every script it launches) gets its share of math threads, where
# each would otherwise start one per core (4 busy threads on 2 cores: slower than 2, the suite took 2 min longer)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
SESSION_ENV = dict(os.environ)  # what every launched run starts from, unless a test changes it (Zygote below)
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "train_dreambooth_lora_flux2.py"
sys.path.insert(0, str(ROOT))

from tests.tiny_flux2 import (MAX_SEQUENCE_LENGTH, TEXT_ENCODER_OUT_LAYERS, build_tiny_flux2,  # noqa: E402
                               build_tiny_flux2_klein, make_images)


# `make test` runs `pytest -n 2 --dist loadgroup`: each test goes to whichever worker is free, except the tests of
# these modules, which share module-scoped runs and go to one worker together (each worker would otherwise build
# them again: about 40 s of the multinode runs alone).
SHARED_RUN_MODULES = ("test_adapters.py", "test_captions_preservation.py", "test_config.py", "test_copy_runs.py",
                      "test_int8.py", "test_memory.py", "test_metrics.py", "test_multinode.py", "test_parts.py",
                      "test_plan.py", "test_ray.py", "test_reliability.py", "test_swap.py")
# The longest tests start first, so that the last minute is not one worker finishing a proof while the other waits
# (seconds on 2 cores, `--durations`): longest-first is the usual cure for an idle tail.
LONGEST_FIRST = ("test_ray.py::",  # 150 s, one Ray cluster for the module
                 "test_fsdp.py::test_fsdp_trains_checkpoints_and_resumes_like_ddp",  # 95 s (inductor's cache cold)
                 "test_speed.py::test_gpu_benchmark_tiny_mode_runs_the_script_step",  # 95 s (the same)
                 "test_preservation.py::",  # about 90 s since its base model ships as data (tests/data/learning)
                 "test_speed.py::test_compile_trains_like_eager_with_bounded_recompiles",  # 58 s
                 "test_edit_learning.py::",  # about 45 s (500 steps, the shipped base model)
                 "test_learning.py::test_a_default_run_learns_the_subject")  # about 35 s (the same)


def pytest_configure(config):
    """`make test-fast`'s marker (slow) and the summary the suite ends with: tests/tiers.py."""
    config.pluginmanager.import_plugin("tests.tiers")


@pytest.hookimpl(tryfirst=True)  # the markers first: xdist's own hook reads them
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SHARED_RUN_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))

    def rank(item):
        where = f"{item.path.name}::{item.name}"
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if where.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: everything else keeps its order


def pytest_collection_finish(session):
    """The libraries, the script and the tests are imported: frozen, the garbage collections of the runs a test makes
    in this process (the script's own gc.collect() at its end, and Python's full passes) skip their objects, as the
    Zygote's children do (tests/zygote.py)."""
    gc.freeze()


@pytest.fixture(autouse=True)
def own_cache_folder(tmp_path, monkeypatch):
    """A per-test XDG_CACHE_HOME (the default --precompute_cache_dir's parent); launched scripts inherit it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return tmp_path / "xdg-cache" / "train_dreambooth_lora_flux2"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_flux2(str(tmp_path_factory.mktemp("model") / "tiny-flux2"))


@pytest.fixture(scope="session", params=[False, True], ids=["klein-base", "klein-distilled"])
def tiny_klein(request, tmp_path_factory):
    return build_tiny_flux2_klein(str(tmp_path_factory.mktemp("klein") / "tiny-flux2-klein"), distilled=request.param)


@pytest.fixture
def fresh_accelerate():
    """main() in this process (with --mixed_precision bf16, say): accelerate's state (a singleton) is reset before and after,
    since another test of this worker may have made it with another precision."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def images(tmp_path):
    """Six mixed-aspect images, five with a .txt caption, plus a non-image file."""
    folder = tmp_path / "images"
    make_images(str(folder))
    return folder


def base_args(model, images, output_dir, *extra, layers=TEXT_ENCODER_OUT_LAYERS):
    """Flags every tiny run needs: small sizes, the tiny text encoder's layers, captions kept visible."""
    return [
        "--pretrained_model_name_or_path", str(model), "--instance_data_dir", str(images),
        "--instance_prompt", "a photo of sks dog", "--output_dir", str(output_dir),
        "--resolution", "32", "--train_batch_size", "1", "--learning_rate", "1e-3",
        "--text_encoder_out_layers", *map(str, layers),
        "--max_sequence_length", str(MAX_SEQUENCE_LENGTH), "--seed", "0", "--report_to", "none",
        "--validation_inference_steps", "2", *map(str, extra),
    ]


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Zygote:
    """launch()'s single-process runs fork a process that has imported the script's libraries (tests/zygote.py), each
    child running the script as `python SCRIPT ARGS` would: that import is 5 s of a tiny run's 8, and the suite makes
    about a hundred such runs. One per pytest worker, started at its first run. A run whose environment differs from
    the zygote's in anything read at import time (PYTHONPATH, thread counts, the Hub's flags, ...) starts afresh."""

    process = None
    env = None
    PER_RUN = ("XDG_CACHE_HOME", "PYTEST_", "ACCELERATE_", "FSDP_", "RAY_")  # read as the script runs, or not at all

    @classmethod
    def fixed(cls, env):
        return {k: v for k, v in env.items() if not k.startswith(cls.PER_RUN)}

    @classmethod
    def serves(cls, env):
        if cls.process is None:
            cls.env = cls.fixed({**SESSION_ENV, "PYTHONUNBUFFERED": "1"})
            cls.process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], cwd=ROOT, env=cls.env,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                           text=True, bufsize=1)
            atexit.register(cls.process.kill)
        return cls.process.poll() is None and cls.fixed(env) == cls.env

    @classmethod
    def run(cls, cmd, env, timeout, ranks=None, commands=None, site=None):
        """One run of `cmd`; with `ranks` (each rank's extra environment) one forked process per rank, their outputs
        joined in rank order (each rank's (stdout, stderr) in the result's `ranks`), and the exit code of the rank
        that failed first. `commands`: each rank's own command in place of `cmd` (nodes with flags of their own).
        `site`: a sitecustomize.py each child runs before the script (see launch)."""
        with tempfile.TemporaryDirectory() as out:
            names = ("stdout", "stderr")
            outputs = [{name: os.path.join(out, f"{name}-{i}") for name in names} for i in range(len(ranks or [0]))]
            request = dict(argv=[str(a) for a in cmd[1:]], env=env, cwd=str(ROOT), site=site and str(site),
                           **outputs[0])
            if ranks:
                request["ranks"] = [dict(env={**env, **extra}, **paths) for extra, paths in zip(ranks, outputs)]
                for rank, command in zip(request["ranks"], commands or []):
                    rank["argv"] = [str(a) for a in command[1:]]
            cls.process.stdin.write(json.dumps(request) + "\n")
            reply = json.loads(cls.process.stdout.readline())
            pids = reply.get("pids") or [reply["pid"]]
            fired = threading.Event()

            def kill():  # each child leads its own process group; first each prints its threads' stacks (zygote.py)
                fired.set()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR1)
                time.sleep(2)
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, 9)

            timer = threading.Timer(timeout, kill)
            timer.start()
            reply = json.loads(cls.process.stdout.readline())
            timer.cancel()
            per_rank = [tuple(Path(paths[name]).read_text(errors="replace") for name in names) for paths in outputs]
            stdout, stderr = ("".join(rank[i] for rank in per_rank) for i in range(len(names)))
        if fired.is_set():
            timed_out = subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
            timed_out.ranks = per_rank
            raise timed_out
        proc = subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)
        proc.ranks = per_rank
        return proc


def torchrun_env(num_processes, port):
    """What `torchrun --nproc_per_node N` sets for each rank of one node (its agent's store aside: rank 0's process
    group makes the store, as under `accelerate launch` on one machine)."""
    n = str(num_processes)
    return [{"RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "GROUP_RANK": "0",
             "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(i), "ROLE_NAME": "default", "ROLE_WORLD_SIZE": n,
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
             "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"} for i in range(num_processes)]


def launch(args, num_processes=1, env=None, check=True, timeout=600, via_accelerate=False, torchrun=False,
           script=SCRIPT, site=None):
    """Run the real script (or `script`, a trimmed copy of it) on the CPU; returns the CompletedProcess. One process
    runs it directly (what `accelerate launch` does for one process, without a second interpreter's start-up; forked
    from the Zygote where the environment allows), or under `accelerate launch` with via_accelerate. Several processes
    talk over gloo (what accelerate uses on GPUs): each forked from the Zygote with the environment torchrun gives its
    rank, or under torchrun itself with `torchrun` (its agent's own behaviour: signals, restarts, its exit code) or
    where the Zygote cannot serve. `site`: a file named sitecustomize.py (a test's patch of a library) that the run
    executes before the script: a fresh interpreter finds it on PYTHONPATH at start-up, a forked one runs it first."""
    if num_processes == 1 and via_accelerate:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--cpu"]
    elif num_processes == 1:
        cmd = [sys.executable]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes),
               "--master_port", str(free_port())]
        env = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    cmd += [str(script), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if num_processes == 1 and not via_accelerate and Zygote.serves(full_env):
        proc = Zygote.run(cmd, full_env, timeout, site=site)
    elif num_processes > 1 and not torchrun and Zygote.serves(full_env):
        ranks = torchrun_env(num_processes, free_port())
        proc = Zygote.run([sys.executable, str(script), *args], full_env, timeout, ranks, site=site)
    else:
        if site:
            assert Path(site).name == "sitecustomize.py", site
            full_env["PYTHONPATH"] = f"{Path(site).parent}{os.pathsep}{ROOT}"
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


@pytest.fixture(autouse=True)
def learning_runs_forked(monkeypatch):
    """tests/learning.py's quiet training runs (the learning, edit-learning and preservation tests: six runs, most of
    500 to 1,000 steps) go through launch(): the same command and environment, forked from the zygote instead of a fresh
    interpreter that imports the script's libraries again."""
    from tests import learning

    monkeypatch.setattr(learning, "QUIET_LAUNCH", lambda args: launch(args, check=False, timeout=1800))


@pytest.fixture
def checkpoint_run(tiny_model):
    """What save_checkpoint needs: an accelerator and a run with a LoRA transformer, optimizer and schedule."""
    import torch
    from accelerate import Accelerator
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig

    import train_dreambooth_lora_flux2 as T

    transformer = Flux2Transformer2DModel.from_pretrained(tiny_model, subfolder="transformer")
    T.add_lora(transformer, LoraConfig(r=2, target_modules=["to_q"]))
    named = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(named.values())
    return Accelerator(cpu=True), T.Run(
        data=T.Data(None, None, 0, None, None, None, hooks=T.Hooks(argparse.Namespace())), caches=None,
        weight_dtype=torch.float32, vae=None, latent_stats=None, transformer=transformer, optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), noise_scheduler=None, sigmas=None,
        named_params=named, guidance=None, shift_steps=50)


STEP_FLAGS = dict(weighting_scheme="none", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, timestep_shift="none",
                  offload=False, latent_sampling="mode", prior_loss_weight=1.0, output_preservation_weight=1.0,
                  gradient_accumulation_steps=1, max_grad_norm=1.0)


def step_loss(transformer, latents, embeds, sigmas, seed=3, num_instance=None, guidance=3.5, shift_steps=50,
              preserve=None, references=(), inputs=None, vae=None, latent_stats=None, **flags):
    """The loss train_dreambooth_lora_flux2.training_step computes and would backpropagate (no update is made) for
    cached latents [B, C, h, w] (or [B, 2, C, h, w]) and prompt embeddings [B, L, D], the first `num_instance` rows
    (default: all) instance rows, `preserve` [P, L, D] output preservation's prompts of the first P, `references` edit
    training's condition latents (R of the latents' shape), or `inputs` (StepInputs) in place of all those; `flags`
    over STEP_FLAGS. Its generator: step_generator."""
    import types

    import torch

    import train_dreambooth_lora_flux2 as T

    rows = len(embeds)
    images = torch.cat([latents, *references]) if inputs is None else None
    inputs = inputs or T.StepInputs(embeds if preserve is None else torch.cat([embeds, preserve]),
                          torch.arange(rows + (0 if preserve is None else len(preserve))), images, torch.arange(len(images)),
                          encoded=True, references=len(references), extra_rows=0 if preserve is None else len(preserve))
    args = types.SimpleNamespace(**{**STEP_FLAGS, **flags})
    run = types.SimpleNamespace(data=types.SimpleNamespace(seed=seed), weight_dtype=embeds.dtype, sigmas=sigmas,
                                guidance=guidance, shift_steps=shift_steps, transformer=transformer, vae=vae,
                                latent_stats=latent_stats)
    backward = []
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), process_index=0, sync_gradients=False,
                                        backward=backward.append)
    rows = len(inputs.embed_rows) - inputs.extra_rows
    batch = {"indices": list(range(rows if num_instance is None else num_instance))}
    T.training_step(args, accelerator, run, 0, batch, inputs, lambda: None, T.StopRequest(""))
    return backward[0]


def step_generator(seed=3):
    """The generator step_loss's step draws from, seeded alike."""
    import torch

    import train_dreambooth_lora_flux2 as T

    return torch.Generator().manual_seed(T.seed_for("step", seed, 0, 0))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Under `--dist loadgroup`, xdist groups a test by renaming its node id (`<id>@<group>`); pytest 9.2 derives the
    node id from a structured id, so the renaming does nothing and the shared runs are silently built on both
    workers (about 2 minutes more). tests/requirements.txt keeps pytest below 9.2; where that fails, every grouped
    test errors with this message before its fixtures are built (raised at collection, xdist showed no message)."""
    if (item.config.getoption("loadgroup", default=False)  # set in xdist workers only
            and item.get_closest_marker("xdist_group") and "@" not in item.nodeid):
        raise pytest.UsageError(f"--dist loadgroup did not group {item.nodeid} (pytest {pytest.__version__} with "
                                "this pytest-xdist): install pytest<9.2 (tests/requirements.txt)")
