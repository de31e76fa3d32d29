"""Ray Train and restarts (issue 38), on the CPU: a local Ray cluster of 2 CPUs, started once for the module, runs
launch/ray_train.py with 2 workers on the tiny model. A Ray run whose main worker is killed (SIGKILL) after a
checkpoint, and a torchrun run with --max-restarts whose main process is killed the same way, both train the LoRA of a
plain 2-process torchrun, bit for bit. (The killed Ray run is also the test of an ordinary Ray run: its first attempt
is one, from scratch to the kill, and its last one trains to the end and exits 0; a Ray run costs about 50 s here,
most of it the workers' start-up.) A bad flag, FSDP, a relative --output_dir on a cluster and
more GPUs than the cluster has are refused on the driver (exit 2, the script's message, no worker started);
the launcher's own bad flags before Ray starts, without the cluster."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, SCRIPT, base_args, free_port, launch

pytest.importorskip("ray.train")  # tests/requirements.txt installs it; users only need it for the launcher
LAUNCHER = ROOT / "launch" / "ray_train.py"
LORA = "pytorch_lora_weights.safetensors"
# a kill after checkpoint 10 lands before the end (the test checks it did); dropout makes every random draw count
COMMON = ("--max_train_steps", "40", "--checkpointing_steps", "10", "--lora_dropout", "0.1")
ENV = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    """A local Ray cluster (2 CPUs), the images, and the reference LoRA of a plain 2-process torchrun."""
    from tests.tiny_flux2 import make_images

    root = tmp_path_factory.mktemp("ray")
    make_images(str(root / "images"))
    port = free_port()
    short = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's sockets live here: a Unix socket path is <= 107 bytes
    env = {**os.environ, **ENV, "RAY_TMPDIR": short}
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    started = subprocess.run([*ray, "start", "--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard",
                              "false", "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    # the 2-process run forked from the zygote with the environment torchrun gives each rank (torchrun's own agent
    # is the last test's subject): the same two gloo processes, a fresh interpreter's imports saved
    launch(base_args(tiny_model, root / "images", root / "reference", *COMMON), num_processes=2)
    yield {"root": root, "address": "auto", "env": env, "model": tiny_model,
           "reference": load_file(str(root / "reference" / LORA))}
    subprocess.run([*ray, "stop", "--force"], env=env, capture_output=True, timeout=300)
    shutil.rmtree(short, ignore_errors=True)


def _flags(world, out, *extra):
    return base_args(world["model"], world["root"] / "images", world["root"] / out, *COMMON, *extra)


def _ray(world, out, *launcher_flags, extra=(), address=True):
    return [sys.executable, str(LAUNCHER), "--num_workers", "2", *(["--address", world["address"]] * address),
            *launcher_flags, "--", *_flags(world, out, *extra)]


def _same_lora(world, out):
    lora = load_file(str(world["root"] / out / LORA))
    return lora.keys() == world["reference"].keys() and all(torch.equal(lora[k], world["reference"][k]) for k in lora)


def _kill_main_after(folder, proc, step=10):
    """SIGKILL the run's main process once checkpoint `step` is complete: its pid is in the output lock."""
    deadline = time.time() + 300
    while not (folder / f"checkpoint-{step}" / "trainer_state.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.02)
    pid = int(re.search(r"the run of process (\d+) ", (folder / ".run.lock").read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    assert not (folder / LORA).exists()  # killed mid-run, not after it
    return pid


@pytest.fixture(scope="module")
def killed(world):
    """One Ray run of the module's LoRA whose main worker is SIGKILLed once checkpoint 10 is written (its first
    attempt: an uninterrupted Ray run until then) and which Ray restarts once: its exit code and stderr."""
    out = world["root"] / "killed"
    proc = subprocess.Popen(_ray(world, "killed", "--max_failures", "1"), cwd=ROOT, env=world["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _kill_main_after(out, proc)
    _, stderr = proc.communicate(timeout=600)
    return proc.returncode, stderr


@pytest.mark.slow
def test_a_ray_run_trains_the_lora_of_torchrun(world, killed):
    """The first attempt started from scratch, and the run (its last attempt) ended with torchrun's LoRA, exit 0."""
    returncode, stderr = killed
    assert returncode == 0, stderr[-4000:]
    assert _same_lora(world, "killed")
    assert "no checkpoint in" in stderr  # every attempt runs with --resume_from_checkpoint latest


@pytest.mark.slow
def test_a_killed_ray_worker_restarts_the_group_which_resumes_to_the_same_lora(world, killed):
    returncode, stderr = killed
    assert returncode == 0, stderr[-4000:]
    assert re.search(r"resum\w+ from .*checkpoint-\d+", stderr), stderr[-4000:]  # the second attempt resumed
    assert _same_lora(world, "killed")


@pytest.mark.slow
def test_a_killed_torchrun_process_restarts_with_max_restarts_and_resumes_to_the_same_lora(world):
    """What docs/multinode.md documents without Ray: torchrun --max-restarts with c10d rendezvous (the default static
    one does not restart after a kill), TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (with the rendezvous store shared, a
    restarted group can read the killed attempt's addresses and hang: pytorch/pytorch#135712; 2 of 3 restarts here)
    and --resume_from_checkpoint latest."""
    out = world["root"] / "torchrun"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts",
                             "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(SCRIPT),
                             *_flags(world, "torchrun", "--resume_from_checkpoint", "latest")], cwd=ROOT,
                            env={**world["env"], "ACCELERATE_USE_CPU": "true",
                                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _kill_main_after(out, proc)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    assert re.search(r"resum\w+ from .*checkpoint-\d+", stderr), stderr[-4000:]
    assert _same_lora(world, "torchrun")


@pytest.mark.parametrize("flags, message", [
    (["--num_workers", "0"], "--num_workers 0: expected an integer >= 1"),  # was Ray's local mode, in the driver
    (["--num_workers", "-1"], "--num_workers -1: expected an integer >= 1"),  # was a traceback from ScalingConfig
    (["--num_workers", "2", "--max_failures", "-2"], "--max_failures -2: expected an integer >= -1"),
])
def test_launcher_flags_are_refused_before_ray_starts(flags, message, capsys):
    """The launcher's own flags, checked before the script's (none given here) and before Ray starts."""
    import ray

    sys.path.insert(0, str(LAUNCHER.parent))
    import ray_train

    assert ray_train.main([*flags, "--"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n" and not ray.is_initialized()


def test_the_resources_a_worker_group_lacks_are_named():
    """What the driver compares before starting the group (the cluster test above: GPUs; here CPUs, and enough)."""
    sys.path.insert(0, str(LAUNCHER.parent))
    import ray_train

    offered = {"CPU": 2.0, "memory": 1e9, "node:127.0.0.1": 1.0}
    assert ray_train.short_of({"CPU": 3.0}, offered) == "the workers need 3 CPU; the cluster has 2 CPU"
    assert ray_train.short_of({"CPU": 2.0}, offered) is None


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bad flag", "fsdp", "relative output", "no gpu"])
def test_bad_input_is_refused_on_the_driver_before_any_worker(case, world, tmp_path):
    """No GPU on the cluster: Ray would wait for the GPUs, time the group out after a minute and retry, forever."""
    env, cwd = dict(world["env"]), ROOT
    if case == "bad flag":
        command, message = _ray(world, "refused", extra=("--learning_rate", "-1")), "error: --learning_rate -1: "
    elif case == "no gpu":  # and -1, restarts without limit, said once
        command = _ray(world, "refused", "--use_gpu", "--max_failures", "-1")
        message = "error: --num_workers 2 --use_gpu: the workers need 2 GPU; the cluster has 0 GPU"
    elif case == "fsdp":
        (tmp_path / "fsdp.yaml").write_text("distributed_type: FSDP\nmixed_precision: bf16\n")
        command = _ray(world, "refused", "--accelerate_config", str(tmp_path / "fsdp.yaml"))
        message = "FSDP is not supported under Ray Train here"
    else:
        command = [sys.executable, str(LAUNCHER), "--num_workers", "2", "--address", world["address"], "--",
                   *base_args(world["model"], world["root"] / "images", "relative-out", *COMMON)]
        cwd, message = tmp_path, "--output_dir relative-out: on a cluster, give an absolute path"
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "RayTrainWorker" not in proc.stderr and "Traceback" not in proc.stderr
    assert ("--max_failures -1: the worker group is started again after every failure, without limit" in proc.stderr
            ) == (case == "no gpu")
    assert not (world["root"] / "refused").exists() and not (tmp_path / "relative-out").exists()


@pytest.mark.slow
def test_bad_data_found_by_the_workers_exits_2_once_without_a_retry(world, tmp_path):
    """An images folder without images passes the driver's checks (the flags are fine) and is refused by the
    script in every worker: the launcher exits 2 with its message, and Ray does not start the group again."""
    (tmp_path / "empty").mkdir()
    command = [sys.executable, str(LAUNCHER), "--num_workers", "2", "--address", world["address"], "--max_failures",
               "1", "--", *base_args(world["model"], tmp_path / "empty", tmp_path / "out", *COMMON)]
    proc = subprocess.run(command, cwd=ROOT, env=world["env"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"^error: --instance_data_dir \S+: no images found", proc.stderr, flags=re.M), proc.stderr[-3000:]
    assert proc.stderr.count("Started training worker group") == 1  # no second attempt
