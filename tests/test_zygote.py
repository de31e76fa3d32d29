"""The tests' fork server (tests/zygote.py, conftest.Zygote): a run forked from it behaves as `python SCRIPT ARGS` in a
fresh interpreter would, as far as the tests can tell: argv, working folder, environment, output, exit code, a
signal's death, fresh random seeds, a timeout that kills it (its stacks printed first); and a changed import-time
environment is not served."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, SESSION_ENV, Zygote

pytestmark = pytest.mark.slow  # every test here runs the script: not in `make test-fast`

PROBE = """
import os, random, sys
import numpy
print(sys.argv[1:], os.getcwd(), os.environ.get("PROBE"), __name__, sys.path[0], flush=True)
print(random.random(), numpy.random.rand(), file=sys.stderr, flush=True)
if sys.argv[1] == "signal":
    os.kill(os.getpid(), 15)
if sys.argv[1] == "sleep":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


def test_a_forked_run_is_the_fresh_process_it_stands_for(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**SESSION_ENV, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(tmp_path)}
    assert Zygote.serves(env)
    runs = [Zygote.run([sys.executable, script, "3", "x y"], {**env, "PROBE": "yes"}, 60) for _ in range(2)]
    fresh = subprocess.run([sys.executable, str(script), "3", "x y"], cwd=ROOT, env={**env, "PROBE": "yes"},
                           capture_output=True, text=True)
    assert [r.returncode for r in (*runs, fresh)] == [3, 3, 3]
    assert runs[0].stdout == runs[1].stdout == fresh.stdout
    assert f"['3', 'x y'] {ROOT} yes __main__ {tmp_path}" in fresh.stdout
    assert len({r.stderr for r in (*runs, fresh)}) == 3  # each its own Python and NumPy seeds
    assert Zygote.run([sys.executable, script, "signal"], env, 60).returncode == -15
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        Zygote.run([sys.executable, script, "sleep"], env, 2)
    assert f'File "{script}", line 10 in <module>' in timed_out.value.stderr  # where it hung, printed before the kill
    assert Zygote.run([sys.executable, script, "0"], env, 60).returncode == 0  # still serving
    # a test's sitecustomize.py (which a fresh interpreter runs from PYTHONPATH) runs in the child first
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['PROBE'] = 'patched'\n")
    patched = Zygote.run([sys.executable, script, "0"], env, 60, site=tmp_path / "sitecustomize.py")
    assert f"['0'] {ROOT} patched __main__" in patched.stdout
    assert f"['0'] {ROOT} None __main__" in Zygote.run([sys.executable, script, "0"], env, 60).stdout  # only there
    assert not Zygote.serves({**env, "PYTHONPATH": str(tmp_path)})  # read at start-up: a fresh interpreter
    assert not Zygote.serves({**env, "OMP_NUM_THREADS": "7"})
    assert Zygote.serves({**env, "XDG_CACHE_HOME": "/elsewhere", "ACCELERATE_USE_CPU": "true"})
    assert os.environ.get("PROBE") is None
    # the zygote compiles a script once while its file is unchanged: an edit runs, a syntax error fails as Python's
    script.write_text(PROBE.replace("import numpy\n", "import numpy\nprint('edited')\n"))
    assert Zygote.run([sys.executable, script, "0"], env, 60).stdout.startswith("edited\n")
    script.write_text("def broken(:\n")
    broken = Zygote.run([sys.executable, script, "0"], env, 60)
    assert broken.returncode == 1 and "SyntaxError" in broken.stderr, broken.stderr


RANKS_PROBE = """
import os, sys, time
import torch
import torch.distributed as dist
rank = int(os.environ["RANK"])
print(sys.argv[1:], file=sys.stderr)
if sys.argv[1] == "group":  # a process group from torchrun's variables alone, as accelerate makes it
    dist.init_process_group("gloo")
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"rank {rank} of {dist.get_world_size()} (local {os.environ['LOCAL_RANK']}): {total.item()}", flush=True)
    dist.destroy_process_group()
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(5)
if sys.argv[1] == "fail":
    time.sleep(60)  # stopped by the zygote (SIGTERM) once rank 1 failed
"""


def test_forked_ranks_form_a_gloo_group_and_a_failed_rank_stops_the_others(tmp_path):
    """launch()'s several processes: one forked child per rank with torchrun's variables, their outputs in rank order;
    a rank's failure is the run's exit code and stops the others, as torchrun's agent does."""
    import time

    from tests.conftest import free_port, torchrun_env

    script = tmp_path / "ranks.py"
    script.write_text(RANKS_PROBE)
    env = {**SESSION_ENV, "PYTHONUNBUFFERED": "1"}
    assert Zygote.serves(env)
    run = Zygote.run([sys.executable, script, "group"], env, 60, torchrun_env(3, free_port()))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"rank {r} of 3 (local {r}): 6.0" for r in range(3)]
    assert [out for out, _ in run.ranks] == [f"rank {r} of 3 (local {r}): 6.0\n" for r in range(3)]  # each its own
    # each rank with a command of its own (two nodes' flags): argv and output per rank
    run = Zygote.run([sys.executable, script, "0"], env, 60, torchrun_env(2, free_port()),
                     [[sys.executable, script, f"node{r}"] for r in range(2)])
    assert run.returncode == 0 and [err for _, err in run.ranks] == ["['node0']\n", "['node1']\n"], run.stderr
    start = time.monotonic()
    run = Zygote.run([sys.executable, script, "fail"], env, 60, torchrun_env(2, free_port()))
    assert run.returncode == 5 and time.monotonic() - start < 8  # SIGTERM at once, not the SIGKILL 10 s later
    assert Zygote.run([sys.executable, script, "0"], env, 60, torchrun_env(2, free_port())).returncode == 0
