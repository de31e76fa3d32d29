"""Several machines: the real script as two nodes of one process each on localhost (`torchrun --nnodes 2 --node_rank
{0,1} --master_addr 127.0.0.1`, gloo on the CPU), in the two layouts a cluster gives: one output and cache folder
that both nodes share, and one of each per node (the default cache, `$XDG_CACHE_HOME`, is node-local).

Every run trains the same 30 steps as a one-node, two-process run (the reference): the LoRAs are compared tensor by
tensor (the file's metadata lists the targets in set order) and must be equal bit for bit: the two ranks are the same
two gloo processes in both cases, adding the same two gradients in the same order.

What is tested: (1) both layouts end with the reference LoRA, and with a folder per node only node 0's receives the
LoRA, checkpoints (every rank's RNG state in them), validation images, card and manifest, while each node's cache is
filled once; (2) resume on two nodes and on one node of two processes equals the straight run, and a checkpoint of
another number of processes, or one only some nodes can see, is refused with exit 2; (3) SIGTERM to one node's
training process, or to every process of that node as Slurm sends it (torchrun forwards a second copy), stops every
rank at one step with one whole checkpoint; node-local caches: an eviction on one node does not break the next run
(nor hang it), and a rerun reuses each node's entries without rewriting them; class images generated into a folder
per node are refused.

The runs the tests share are made once per session, even with several pytest-xdist workers (`once`), and never
changed afterwards: what a test checks about them is recorded when they end. A node pair that does not end within
NODE_TIMEOUT is killed (a collective that one node never joins would otherwise wait gloo's 30 minutes).

Where torchrun's agents are not what is tested (the runs that must end with exit 0 and the reference LoRA), each
node's training process is forked from the pytest worker's zygote (conftest.Zygote) with the environment its agent
gives it (`forked_nodes`; one-node runs through conftest.launch): the same script in the same two gloo processes,
without two agents and two fresh interpreters (about 10 s of imports each, a third of this module's time). The
signals (forwarded by an agent, or aimed at a training process it started) and the refusals (each node's own exit
code, as torchrun reports it) run under torchrun itself. A forked pair that does not end in NODE_TIMEOUT (once in CI)
warns with each rank's stacks and runs again under torchrun.

FLUX2_SCRIPT=path runs another copy of the script (planting a bug in a copy checks that a test catches it)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, SCRIPT, Zygote, base_args, free_port, launch, torchrun_env
from tests.tiny_flux2 import build_tiny_flux2, make_images

pytestmark = pytest.mark.slow  # every test here runs the script: not in `make test-fast`

SCRIPT_UNDER_TEST = Path(os.environ.get("FLUX2_SCRIPT", SCRIPT))
LORA = "pytorch_lora_weights.safetensors"
STEPS = 30  # 10 epochs of 3 batches per rank
# LoRA dropout draws from the global generator (seeded and drawn alike on every rank): a resume is exact only if the
# checkpoint's RNG state is restored
COMMON = ["--max_train_steps", str(STEPS), "--checkpointing_steps", "10", "--cache_latents", "--lora_dropout", "0.1"]
VALIDATION = ["--validation_prompt", "a dog", "--num_validation_images", "1", "--validation_steps", "10"]
NODE_TIMEOUT = 300  # a run takes about 12 s; CI machines have been seen 10x slower than this one, never 25x
# PYTHONFAULTHANDLER: a timed-out run's ranks get SIGABRT before they are killed and print where each thread was
ENV = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONFAULTHANDLER": "1"}
SLOW_STEPS = """
import time
import torch.optim
_step = torch.optim.AdamW.step
def slow_step(self, *args, **kwargs):  # 50 ms more per optimizer step, nothing else changed: time to signal mid-run
    time.sleep(0.05)
    return _step(self, *args, **kwargs)
torch.optim.AdamW.step = slow_step
"""


# ----------------------------------------------------------------------------------------------------------------
# Launching nodes


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _local_rank(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    return env.get(b"LOCAL_RANK")


def _dump_stacks(pid):
    """SIGABRT to every training process under launcher `pid`: with PYTHONFAULTHANDLER each prints its threads' Python
    stacks to its stderr (where a hang is) and dies."""
    try:
        os.kill(pid, signal.SIGSTOP)  # torchrun would stop the other ranks as soon as the first one dies
    except ProcessLookupError:  # the launcher has ended (and been reaped): so have its ranks
        return
    ranks, stack = [], [pid]
    while stack:
        p = stack.pop()
        stack += _children(p)
        ranks += [p] if _local_rank(p) is not None else []
    for p in ranks:
        try:
            os.kill(p, signal.SIGABRT)
            time.sleep(1)  # one rank at a time: their stacks would interleave on the shared stderr
        except ProcessLookupError:
            pass


def _kill_tree(pid):
    """SIGKILL a launcher and everything under it (torchrun starts its workers in their own sessions)."""
    stack, found = [pid], []
    while stack:
        p = stack.pop()
        found.append(p)
        stack += _children(p)
    for p in reversed(found):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Ran:
    """A finished node: its rank, its launcher's exit status and output (what a run's record keeps)."""

    def __init__(self, rank, returncode, output):
        self.rank, self.returncode, self.output = rank, returncode, output

    @property
    def worker_exit(self):
        """The training process's exit status: 0 when torchrun succeeded, else the one torchrun reports (None when
        torchrun was signalled itself: it then reports nothing)."""
        if self.returncode == 0:
            return 0
        found = re.findall(r"exitcode\s*:\s*(-?\d+)", self.output)
        return int(found[0]) if found else None

    def record(self):
        return {"rank": self.rank, "returncode": self.returncode, "output": self.output}


class Node:
    """One node's launcher, `torchrun --nnodes 2 --nproc_per_node 1 --node_rank K`; its output is read in a thread,
    so a test can watch it while the node runs."""

    def __init__(self, rank, port, args, env=None):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
               str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port), str(SCRIPT_UNDER_TEST),
               *map(str, args)]
        self.rank, self.lines = rank, []
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **ENV, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self):
        return "".join(self.lines)

    def worker(self):
        """The training process: torchrun's child with a LOCAL_RANK."""
        deadline = time.time() + 60
        while not (found := [c for c in _children(self.proc.pid) if _local_rank(c) is not None]):
            assert time.time() < deadline and self.proc.poll() is None, self.output[-3000:]
            time.sleep(0.05)
        return found[0]

    def finished(self):
        return Ran(self.rank, self.proc.returncode, self.output)


def _report(nodes):
    alive = lambda pid: Path(f"/proc/{pid}").exists()  # noqa: E731
    state = lambda n: "running" if n.proc.poll() is None else f"exit {n.proc.returncode}"  # noqa: E731
    return "\n".join(f"--- node {n.rank} (launcher {state(n)}, workers running: "
                     f"{[c for c in _children(n.proc.pid) if alive(c)]})\n{n.output[-6000:]}" for n in nodes)


def _kill(nodes, stacks=True):
    """Kill both nodes -> their output, with every live rank's Python stacks first unless not `stacks`."""
    for n in nodes:
        if stacks and n.proc.poll() is None:
            _dump_stacks(n.proc.pid)
    report = _report(nodes)
    for n in nodes:
        _kill_tree(n.proc.pid)
    for n in nodes:
        n.proc.wait()
        n.reader.join(5)
    return report


def wait_all(nodes, timeout=NODE_TIMEOUT):
    """-> [Ran] once both nodes ended; both killed (and an AssertionError) after `timeout` seconds."""
    deadline = time.time() + timeout
    for node in nodes:
        try:
            node.proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the nodes did not end within {timeout} s (a collective one node never joined?)\n"
                                 + _kill(nodes)) from None
    for node in nodes:
        node.reader.join(10)
    return [node.finished() for node in nodes]


def start_nodes(args_of, env_of=lambda rank: None):
    """Start both nodes on a free port; once both training processes run, return them. The port is free when chosen,
    not necessarily when node 0's launcher binds it (another process may take it in between): then node 0 fails at
    once (EADDRINUSE) and node 1 would wait for it forever, so both are stopped and started again on another port."""
    for _ in range(3):
        port = free_port()
        nodes = [Node(rank, port, args_of(rank), env_of(rank)) for rank in (0, 1)]
        deadline = time.time() + NODE_TIMEOUT
        while time.time() < deadline and not all(any(_local_rank(c) for c in _children(n.proc.pid)) for n in nodes):
            if any(n.proc.poll() is not None for n in nodes):
                break
            time.sleep(0.05)
        if nodes[0].proc.poll() is not None:
            nodes[0].reader.join(10)
        if nodes[0].proc.poll() is None or "EADDRINUSE" not in nodes[0].output:
            return nodes
        _kill(nodes, stacks=False)  # a lost port race, not a hang
    raise AssertionError(f"no free port for the rendezvous after 3 tries\n{_report(nodes)}")


def forked_nodes(args_of, env_of=lambda rank: None):
    """Both nodes' training processes forked from the zygote, each with the environment `torchrun --nnodes 2
    --nproc_per_node 1 --node_rank K` gives it, to their end -> [Ran] (each with the exit code of the process that
    failed first), or None where the zygote cannot serve this environment (another thread count, PYTHONPATH...)."""
    env = {**os.environ, **{k: v for k, v in ENV.items() if k != "PYTHONFAULTHANDLER"}}  # no stacks to dump here
    if not Zygote.serves(env):
        return None
    ranks = [{**rank, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(k), "GROUP_WORLD_SIZE": "2",
              **(env_of(k) or {})} for k, rank in enumerate(torchrun_env(2, free_port()))]
    commands = [[sys.executable, str(SCRIPT_UNDER_TEST), *map(str, args_of(k))] for k in (0, 1)]
    try:
        proc = Zygote.run(commands[0], env, NODE_TIMEOUT, ranks, commands)
    except subprocess.TimeoutExpired as e:  # seen once in CI, never here in 40 runs under load: its stacks, then torchrun
        warnings.warn(f"two forked nodes did not end within {NODE_TIMEOUT} s; running them under torchrun instead. "
                      "Each rank's output, its stacks last:\n" + "\n".join(
                          f"--- rank {k}\n{out[-2000:]}\n{err[-6000:]}" for k, (out, err) in enumerate(e.ranks)))
        for k in (0, 1):  # what the killed run left (checkpoints, leases) would change the next run
            args = [str(a) for a in args_of(k)]
            folders = [args[args.index(flag) + 1] for flag in ("--output_dir", "--precompute_cache_dir") if flag in args]
            for folder in folders + [(env_of(k) or {}).get("XDG_CACHE_HOME")]:
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)
        return None
    return [Ran(k, proc.returncode, stdout + stderr) for k, (stdout, stderr) in enumerate(proc.ranks)]


def run_nodes(args_of, env_of=lambda rank: None, check=True):
    """Both nodes, to their end: forked from the zygote where both must succeed and it can, else under torchrun.
    -> [Ran]"""
    nodes = check and forked_nodes(args_of, env_of) or wait_all(start_nodes(args_of, env_of))
    if check:
        for n in nodes:
            assert n.returncode == 0, f"node {n.rank} exit {n.returncode}\n{n.output[-6000:]}"
    return nodes


def signalled_run(args_of, env_of, signal_node_1):
    """Start two nodes; once node 1's rank has trained 3 micro-batches, `signal_node_1(node)`; -> [Ran]."""
    nodes = start_nodes(args_of, env_of)
    log = Path(args_of(1)[args_of(1).index("--output_dir") + 1]) / "logs" / "samples-1.jsonl"
    deadline = time.time() + NODE_TIMEOUT
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        if time.time() > deadline or any(n.proc.poll() is not None for n in nodes):
            raise AssertionError(_kill(nodes))
        time.sleep(0.02)
    signal_node_1(nodes[1])
    return wait_all(nodes)


def one_node(args, processes, check=True):
    """One node: the script directly (one process) or under torchrun (several); one process, or several that must
    succeed (`check`), forked from the zygote where it can (conftest.launch)."""
    if check or processes == 1:
        return launch(args, processes, env={k: v for k, v in ENV.items() if k != "PYTHONFAULTHANDLER"},
                      check=check, timeout=NODE_TIMEOUT, script=SCRIPT_UNDER_TEST)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
           str(free_port())]  # its report of the worker's exit code is what a refusal test reads
    proc = subprocess.Popen([*cmd, str(SCRIPT_UNDER_TEST), *map(str, args)], cwd=ROOT, env={**os.environ, **ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=NODE_TIMEOUT)
    except subprocess.TimeoutExpired:
        _dump_stacks(proc.pid)
        _kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the run did not end within {NODE_TIMEOUT} s; its ranks' stacks and output:\n"
                             f"{stderr[-12000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


# ----------------------------------------------------------------------------------------------------------------
# What the tests look at


def lora(folder):
    return load_file(str(Path(folder) / LORA))


def assert_same_lora(a, b):
    assert a.keys() == b.keys() and a
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[0]}"


def entries(cache):
    """Cache entries (relative path -> inode): a rewritten entry gets a new inode (written aside, then renamed)."""
    return {p.relative_to(cache).as_posix(): p.stat().st_ino for p in Path(cache).glob("*/??/*.safetensors")}


def files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())


def checkpoints(out):
    return sorted((p.name for p in Path(out).glob("checkpoint-*")), key=lambda n: (len(n), n))


def assert_whole_checkpoint(folder, ranks=2):
    assert (folder / "trainer_state.json").is_file() and (folder / "training.safetensors").is_file()
    assert sorted(p.name for p in folder.glob("rng-*.json")) == [f"rng-{r}.json" for r in range(ranks)]


def sample_log(out, rank):
    path = Path(out) / "logs" / f"samples-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def node_cache(root, rank):
    """Node K's default cache folder: $XDG_CACHE_HOME/train_dreambooth_lora_flux2, a folder of its own."""
    return Path(root) / f"node{rank}-home" / ".cache" / "train_dreambooth_lora_flux2"


def node_env(root, extra=None):
    return lambda rank: {"XDG_CACHE_HOME": str(node_cache(root, rank).parent), **(extra or {})}


def slowed(root):
    """Environment whose processes take 50 ms more per optimizer step (SLOW_STEPS), nothing else changed."""
    folder = Path(root) / "slow-steps"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SLOW_STEPS)
    return {"PYTHONPATH": f"{folder}:{ROOT}"}


# ----------------------------------------------------------------------------------------------------------------
# The runs the tests share


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """One folder for the session: under pytest-xdist, each worker's base folder is in the session's, shared."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "multinode"
    folder.mkdir(exist_ok=True)
    return folder


def once(root, name, make):
    """make(folder) -> a JSON-able record, run once per session even with several pytest-xdist workers (the others
    wait for it and read the record); a failure is reported to every test that needs it."""
    from filelock import FileLock

    record = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not record.exists():
            try:
                record.write_text(json.dumps({"record": make(root / name)}))
            except BaseException as e:
                record.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
                raise
    saved = json.loads(record.read_text())
    if "error" in saved:
        pytest.fail(f"{name} failed (in another test worker):\n{saved['error'][-8000:]}")
    return saved["record"]


@pytest.fixture(scope="module")
def setup(root):
    def make(folder):
        build_tiny_flux2(str(folder / "model"))
        make_images(str(folder / "images"))
        return {}

    once(root, "inputs", make)
    model, images = root / "inputs" / "model", root / "inputs" / "images"
    args = lambda out, *extra: base_args(model, images, out, *COMMON, *extra)  # noqa: E731
    return SimpleNamespace(root=root, model=model, images=images, args=args)


@pytest.fixture(scope="module")
def reference(setup):
    """One node, two processes, one folder: what every two-node run must end with."""
    def make(folder):
        one_node(setup.args(folder / "out", "--precompute_cache_dir", folder / "cache"), 2)
        return {}

    once(setup.root, "reference", make)
    return setup.root / "reference" / "out"


@pytest.fixture(scope="module")
def shared(setup):
    """Two nodes, one output folder and one cache folder for both (a shared file system)."""
    def make(folder):
        nodes = run_nodes(lambda rank: setup.args(folder / "out", "--precompute_cache_dir", folder / "cache"))
        return {"nodes": [n.record() for n in nodes], "leases": files(folder / "cache" / "leases"),
                "entries": len(entries(folder / "cache"))}

    record = once(setup.root, "shared", make)
    folder = setup.root / "shared"
    return SimpleNamespace(out=folder / "out", cache=folder / "cache", nodes=[Ran(**n) for n in record["nodes"]],
                           leases=record["leases"], entries=record["entries"])


@pytest.fixture(scope="module")
def per_node(setup):
    """Two nodes, each with its own output folder and its own default cache; with validation images."""
    def make(folder):
        outs = [folder / f"node{rank}-out" for rank in (0, 1)]
        nodes = run_nodes(lambda rank: setup.args(outs[rank], *VALIDATION), node_env(folder))
        caches = [node_cache(folder, rank) for rank in (0, 1)]
        return {"nodes": [n.record() for n in nodes], "entries": [entries(c) for c in caches],
                "leftovers": [[f for f in files(c) if f.endswith(".tmp") or f.startswith("leases/")] for c in caches],
                "outs": [files(out) for out in outs]}

    record = once(setup.root, "per-node", make)
    folder = setup.root / "per-node"
    return SimpleNamespace(folder=folder, outs=[folder / f"node{rank}-out" for rank in (0, 1)],
                           caches=[node_cache(folder, rank) for rank in (0, 1)],
                           nodes=[Ran(**n) for n in record["nodes"]], entries=record["entries"],
                           leftovers=record["leftovers"], files=record["outs"])


# ----------------------------------------------------------------------------------------------------------------
# 1. Two nodes train the one-node LoRA, in both layouts


def test_two_nodes_sharing_one_folder_train_the_one_node_two_process_lora(reference, shared):
    node0, node1 = (n.output for n in shared.nodes)
    assert "data parallel (every process a full copy, gradients averaged) over 2 processes on 2 machines" in node0
    assert_same_lora(lora(shared.out), lora(reference))
    fingerprints = re.findall(r"\[RANK (\d)\] LoRA fingerprint (\w+)", node0 + node1)
    assert sorted(r for r, _ in fingerprints) == ["0", "1"] and len({f for _, f in fingerprints}) == 1
    assert checkpoints(shared.out) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    for name in checkpoints(shared.out):
        assert_whole_checkpoint(shared.out / name)
    assert not list(shared.out.glob("*.partial"))
    # the work is split over the nodes: each rank encodes half of what is missing, once, into the one folder
    for rank, out in ((0, node0), (1, node1)):
        assert f"[RANK {rank}] encoded 3 of 6 missing prompts" in out
        assert f"[RANK {rank}] encoded 3 of 6 missing images" in out
    assert shared.entries == 12 and "reused 0 entries (0 B), wrote 12" in node0
    assert shared.leases == []  # each node's lease ended with its run
    # the ranks trained disjoint halves of every epoch
    logs = [sample_log(shared.out, rank) for rank in (0, 1)]
    assert len(logs[0]) == len(logs[1]) == STEPS
    for epoch in range(STEPS // 3):
        seen = [i for log in logs for row in log if row["epoch"] == epoch for i in row["indices"]]
        assert sorted(seen) == list(range(6))


def test_two_nodes_with_a_folder_each_train_the_same_lora_and_only_the_main_node_writes_outputs(reference, per_node):
    out0, out1 = per_node.outs
    assert_same_lora(lora(out0), lora(reference))
    # node 1's output folder holds its rank's sample log, nothing else: no LoRA, checkpoint, image, card or manifest
    assert per_node.files[1] == ["logs/samples-1.jsonl"]
    assert {LORA, "README.md", "dataset_manifest.json"} <= set(per_node.files[0])
    assert checkpoints(out0) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    for name in checkpoints(out0):  # every rank's RNG state, in the main node's folder
        assert_whole_checkpoint(out0 / name)
    assert not [f for f in per_node.files[0] if ".partial" in f]
    assert {"validation/base-0.png", "validation/step-000010-0.png", "validation/final-0.png"} <= set(per_node.files[0])
    # each node's own cache holds every entry (6 prompts and the validation prompt, 6 latents), written once there
    assert [len(e) for e in per_node.entries] == [13, 13] and per_node.leftovers == [[], []]
    assert f"precompute cache {per_node.caches[0]}: reused 0 entries (0 B), wrote 13" in per_node.nodes[0].output
    assert per_node.entries[0].keys() == per_node.entries[1].keys()  # the same names: the same inputs, the same model


# ----------------------------------------------------------------------------------------------------------------
# 2. Resume: on two nodes (below, after a stop), on one node with as many processes; refused on another number of
#    processes, or when some node cannot see the checkpoint


def test_a_two_node_checkpoint_resumes_on_one_node_of_two_processes_to_the_same_lora(setup, reference, shared,
                                                                                      tmp_path):
    """The rule: a checkpoint belongs to a number of processes, not of machines (2 nodes x 1 = 1 node x 2)."""
    out = tmp_path / "out"
    shutil.copytree(shared.out / "checkpoint-10", out / "checkpoint-10")
    proc = one_node(setup.args(out, "--resume_from_checkpoint", "latest", "--precompute_cache_dir", shared.cache), 2)
    assert "checkpoint-10 at step 10" in proc.stderr
    assert_same_lora(lora(out), lora(reference))


def test_a_checkpoint_of_two_processes_is_refused_on_one(setup, shared, tmp_path):
    proc = one_node(setup.args(tmp_path / "out", "--resume_from_checkpoint", shared.out / "checkpoint-10",
                               "--precompute_cache_dir", tmp_path / "cache"), 1, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"error: --resume_from_checkpoint: {shared.out / 'checkpoint-10'} was written by 2 processes, this run has "
            "1; resume on 2 (any number of machines), or start a new run") in proc.stderr
    assert "Traceback" not in proc.stderr and "loading the text encoder" not in proc.stderr


def test_a_checkpoint_of_one_process_is_refused_on_two(setup, shared, tmp_path):
    """A one-process checkpoint has one RNG file (rng-0): the only record of how many processes wrote it."""
    out = tmp_path / "out"
    shutil.copytree(shared.out / "checkpoint-10", out / "checkpoint-10")
    for path in (out / "checkpoint-10").glob("rng-1.*"):
        path.unlink()
    proc = one_node(setup.args(out, "--resume_from_checkpoint", "latest", "--precompute_cache_dir", tmp_path / "cache"),
                    2, check=False)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert "was written by 1 process, this run has 2; resume on 1 (any number of machines)" in proc.stderr


def test_nodes_that_find_different_checkpoints_are_refused_instead_of_training_apart(setup, per_node, tmp_path):
    """A folder per node, the checkpoint copied to node 0 only: node 1 would start from step 0 while node 0 goes on
    from step 10, and their collectives would never meet. Both refuse, naming what each found."""
    outs = [tmp_path / f"node{rank}-out" for rank in (0, 1)]
    shutil.copytree(per_node.outs[0] / "checkpoint-10", outs[0] / "checkpoint-10")
    outs[1].mkdir()
    nodes = run_nodes(lambda rank: setup.args(outs[rank], "--resume_from_checkpoint", "latest"), node_env(tmp_path),
                      check=False)
    for node in nodes:
        assert node.worker_exit == 2, node.output[-4000:]
        assert (f"the processes found different checkpoints (process 0: {outs[0] / 'checkpoint-10'}; process 1: none "
                f"in {outs[1]}); every process reads the checkpoint: share --output_dir between machines, or copy "
                "checkpoint-N into each machine's --output_dir") in node.output
        assert "loading the text encoder" not in node.output


# ----------------------------------------------------------------------------------------------------------------
# 3. SIGTERM to one node


def _stop_lines(text):
    return re.findall(r"stopped by SIGTERM at step (\d+); continue with the same command plus "
                      r"--resume_from_checkpoint latest", text)


def _assert_stopped_together(nodes, micro_batches, signalled_agent=False):
    """Both ranks stop at one step with 128 + SIGTERM after as many micro-batches, no rank dies of another cause.
    -> the step."""
    stops = [_stop_lines(n.output) for n in nodes]
    assert all(len(s) == 1 for s in stops) and stops[0] == stops[1], "\n".join(n.output[-4000:] for n in nodes)
    # torchrun exits 1 and reports its worker's status, unless it was signalled itself (then it reports nothing)
    assert [n.worker_exit for n in nodes] == [128 + signal.SIGTERM, None if signalled_agent else 128 + signal.SIGTERM]
    for n in nodes:  # no rank died of a second signal or of its peer's death
        died = re.search(r"\[rank\d\]: (Traceback|KeyboardInterrupt)|Connection closed by peer", n.output)
        assert not died, n.output[-4000:]
    assert micro_batches[0] == micro_batches[1]
    step = int(stops[0][0])
    assert 1 <= step < STEPS
    return step


def _whole(out):
    """What a stopped run left in its main output folder (recorded when it ends)."""
    return {"checkpoints": checkpoints(out), "partial": [p.name for p in Path(out).glob("*.partial")],
            "lora": (Path(out) / LORA).exists()}


@pytest.fixture(scope="module")
def stopped(setup, per_node):
    """SIGTERM to node 1's training process only (`kill PID`, a job's own watchdog): a folder per node, each node's
    cache as the per-node run left it (so this is also that run's rerun), checkpoints only when stopped. Optimizer
    steps are slowed (SLOW_STEPS) so the signal lands long before the last step even on a busy machine."""
    def args_of(folder):
        return lambda rank: setup.args(folder / f"node{rank}-out", "--checkpointing_steps", "1000")

    def make(folder):
        before = [entries(c) for c in per_node.caches]
        nodes = signalled_run(args_of(folder), node_env(per_node.folder, slowed(folder)),
                              lambda node: os.kill(node.worker(), signal.SIGTERM))
        outs = [folder / f"node{rank}-out" for rank in (0, 1)]
        return {"nodes": [n.record() for n in nodes], "before": before, "after": [entries(c) for c in per_node.caches],
                "main": _whole(outs[0]), "node1": checkpoints(outs[1]),
                "micro_batches": [len(sample_log(out, rank)) for rank, out in enumerate(outs)]}

    record = once(setup.root, "stopped", make)
    folder = setup.root / "stopped"
    return SimpleNamespace(outs=[folder / f"node{rank}-out" for rank in (0, 1)], args_of=args_of(folder),
                           nodes=[Ran(**n) for n in record["nodes"]],
                           **{k: record[k] for k in ("before", "after", "main", "node1", "micro_batches")})


def test_sigterm_to_one_node_stops_every_rank_at_one_step_with_one_whole_checkpoint(stopped):
    step = _assert_stopped_together(stopped.nodes, stopped.micro_batches)
    assert "SIGTERM received" in stopped.nodes[1].output and "SIGTERM received" not in stopped.nodes[0].output
    assert stopped.main == {"checkpoints": [f"checkpoint-{step}"], "partial": [], "lora": False}
    assert_whole_checkpoint(stopped.outs[0] / f"checkpoint-{step}")
    assert stopped.node1 == []  # in node 0's folder only


def test_a_rerun_reuses_each_node_cache_without_writing_it(stopped):
    node0, node1 = (n.output for n in stopped.nodes)
    assert "reused 12 entries" in node0 and "wrote 0 (0 B)" in node0  # no validation prompt this time
    for rank, out in ((0, node0), (1, node1)):
        assert f"[RANK {rank}] encoded 0 of 0 missing prompts" in out
    assert stopped.after == stopped.before  # the same entries, none rewritten (same inodes), on both nodes


def test_a_stopped_two_node_run_resumes_on_two_nodes_to_the_straight_lora(setup, reference, per_node, stopped,
                                                                          tmp_path):
    """A folder per node: every process reads the checkpoint, so it goes into both nodes' folders (as the docs say)."""
    (name,) = stopped.main["checkpoints"]
    outs = [tmp_path / f"node{rank}-out" for rank in (0, 1)]
    for out in outs:
        shutil.copytree(stopped.outs[0] / name, out / name)
    resumed = run_nodes(lambda rank: setup.args(outs[rank], "--checkpointing_steps", "1000",
                                                "--resume_from_checkpoint", "latest"), node_env(per_node.folder))
    assert f"{name} at step {name.split('-')[1]}" in resumed[0].output
    assert_same_lora(lora(outs[0]), lora(reference))
    assert not (outs[1] / LORA).exists()


def test_a_scheduler_sigterm_to_every_process_of_one_node_still_checkpoints_once(setup, tmp_path):
    """What Slurm (every process of the job step) or a node shutdown does: the worker receives the signal, and the
    torchrun agent, signalled too, forwards its own copy a moment later. That copy is the same request, not a second
    one ("stop at once"): the run must still stop together with a whole checkpoint. One shared folder; accumulation 8
    keeps the worker in its loop long after the first signal, so the copy lands while it still listens."""
    out = tmp_path / "out"
    args_of = lambda rank: setup.args(out, "--precompute_cache_dir", tmp_path / "cache",  # noqa: E731
                                      "--checkpointing_steps", "1000", "--gradient_accumulation_steps", "8")

    def scheduler(node):
        os.kill(node.worker(), signal.SIGTERM)
        deadline = time.time() + 60
        while "SIGTERM received" not in node.output and time.time() < deadline:
            time.sleep(0.005)
        node.proc.send_signal(signal.SIGTERM)  # the agent forwards it to its worker

    nodes = signalled_run(args_of, lambda rank: None, scheduler)
    assert "Received 15 death signal, shutting down workers" in nodes[1].output  # torchrun forwarded it
    step = _assert_stopped_together(nodes, [len(sample_log(out, rank)) for rank in (0, 1)], signalled_agent=True)
    assert _whole(out) == {"checkpoints": [f"checkpoint-{step}"], "partial": [], "lora": False}
    assert_whole_checkpoint(out / f"checkpoint-{step}")


# ----------------------------------------------------------------------------------------------------------------
# Node-local caches with eviction


def test_an_eviction_on_one_node_does_not_break_the_next_two_node_run(setup, reference, per_node, tmp_path):
    """Node 1's cache loses the run's latents to another run's eviction there (a bound of 0 keeps only that run's own
    entries); node 0's keeps them. The next two-node run must not split precompute by what each node happens to have
    (node 0 would encode nothing and skip the collectives node 1 waits in): it encodes what any node lacks, shares it,
    and trains the same LoRA."""
    for rank in (0, 1):
        shutil.copytree(per_node.caches[rank], node_cache(tmp_path, rank))
    cache1 = node_cache(tmp_path, 1)
    latents = {k for k in entries(cache1) if k.startswith("latents/")}
    evictor = one_node(base_args(setup.model, setup.images, tmp_path / "evictor", "--max_train_steps", "1",
                                 "--cache_latents", "--resolution", "48", "--precompute_cache_max_gb", "0",
                                 "--precompute_cache_dir", cache1), 1)
    assert "least-recently-used entries deleted" in evictor.stderr
    assert not latents & entries(cache1).keys()  # every latent of the two-node run is gone, from node 1 only
    outs = [tmp_path / f"node{rank}-out" for rank in (0, 1)]
    nodes = run_nodes(lambda rank: setup.args(outs[rank]), node_env(tmp_path))
    assert_same_lora(lora(outs[0]), lora(reference))
    for rank, node in enumerate(nodes):
        assert f"[RANK {rank}] encoded 3 of 6 missing images" in node.output, node.output[-3000:]
    assert latents <= entries(cache1).keys()  # node 1's cache is whole again


# ----------------------------------------------------------------------------------------------------------------
# Data each node must see alike


def test_class_images_generated_into_a_folder_per_node_are_refused(setup, tmp_path):
    """Every process generates its share of the missing class images into its --class_data_dir: with a folder per node,
    node 0's holds 2 of the 3 and node 1's the third, so the nodes would train different datasets (it crashed in
    precompute: a cache entry missing on one node). Both refuse, exit 2, naming what each sees; between them the
    folders hold every image once, so copying each into the other's is the remedy the message gives (identical
    folders pass the same check in every other test here)."""
    args_of = lambda rank: base_args(  # noqa: E731
        setup.model, setup.images, tmp_path / f"node{rank}-out", "--max_train_steps", "2", "--cache_latents",
        "--with_prior_preservation", "--class_prompt", "a dog", "--num_class_images", "3",
        "--class_data_dir", tmp_path / f"node{rank}-class")
    for node in run_nodes(args_of, node_env(tmp_path), check=False):
        assert node.worker_exit == 2, node.output[-4000:]
        assert ("the processes see different images or captions (process 0: 6 instance and 2 class "
                "images; process 1: 6 instance and 1 class images)") in node.output and "loading the text encoder" not in node.output
    expected = [["class-00000.png", "class-00002.png"], ["class-00001.png"]]
    assert [files(tmp_path / f"node{rank}-class") for rank in (0, 1)] == expected
