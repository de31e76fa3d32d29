"""A fork server for the tests' single-process runs of the script (conftest.launch): started once per pytest worker,
it imports the script's libraries (about 5 s of a tiny run's 8: torch, diffusers, transformers, bitsandbytes through
diffusers' quantisers) and nothing else, so no thread or RNG has been used; each request forks it, and the child runs
the script as `python SCRIPT ARGS` would (`__main__`, sys.argv, sys.path[0], cwd, environment, fresh Python and NumPy
seeds, output to files), exiting the way that process would (atexit, exit code, signals). The libraries' objects are
frozen for the garbage collector, and a script is compiled once while its file is unchanged.

Protocol, one JSON line each way: request {"argv", "env", "cwd", "stdout", "stderr", "site"} ("site": a test's
sitecustomize.py, None or a path, run before the script); reply {"pid"} when forked, then {"returncode"} (as
subprocess reports it: -N for signal N) when it ended. A request with "ranks" (a list of {"env", "stdout", "stderr"}
and optionally "argv", each rank's environment as torchrun would set it) forks one child per rank: reply {"pids"},
then {"returncode"} (the first failure's) once all ended; when one fails the others are stopped (SIGTERM, SIGKILL
10 s later), as torchrun stops a failed group."""

import contextlib
import faulthandler
import gc
import json
import os
import signal
import sys
import time
import types

import accelerate  # noqa: F401
import diffusers  # noqa: F401
import peft  # noqa: F401
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
from diffusers import AutoencoderKLFlux2, Flux2Pipeline, Flux2Transformer2DModel  # noqa: F401
from PIL import Image  # noqa: F401

# The libraries' objects live as long as the zygote: frozen, a child's garbage collections never scan them (as
# Python's documentation advises before fork()). Scanned, each full collection of a run took 0.25 s and copied the
# pages the children share: a forked tiny run took 2.6 s, and 1.2 s frozen.
gc.freeze()


def compiled(path, codes={}):
    """The script's code, compiled once while its file is unchanged (0.11 s, a tenth of a tiny run, in each child);
    None where it cannot be: the child's runpy then fails as Python would."""
    try:
        stat = os.stat(path)
        if codes.get(path, (None,))[0] != (stat.st_mtime_ns, stat.st_size):
            with open(path, "rb") as f:
                codes[path] = (stat.st_mtime_ns, stat.st_size), compile(f.read(), path, "exec")
        return codes[path][1]
    except (OSError, SyntaxError, ValueError):
        return None


def serve():
    """Answer requests until stdin closes; in a forked child, return its request (one rank's, for "ranks") and the
    script's code."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        ranks = [{**request, **rank} for rank in request.get("ranks", [{}])]
        pids = []
        for rank in ranks:
            code = compiled(os.path.join(rank["cwd"], rank["argv"][0]))
            pid = os.fork()
            if pid == 0:
                replies.close()
                return rank, code
            pids.append(pid)
        replies.write(json.dumps({"pids": pids} if "ranks" in request else {"pid": pids[0]}) + "\n")
        replies.write(json.dumps({"returncode": wait_all(pids)}) + "\n")
    sys.exit(0)


def wait_all(pids):
    """The first failing child's exit code (0 when none failed); that failure stops the others (each leads its own
    process group)."""
    codes, deadline, first = {}, None, 0
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline else os.waitpid(-1, 0)
        if pid == 0:  # stopping the others: wait for them, SIGKILL at the deadline
            if time.monotonic() > deadline:
                for other in set(pids) - set(codes):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(other, signal.SIGKILL)
            time.sleep(0.05)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        first = first or codes[pid]
        if codes[pid] != 0 and deadline is None and len(codes) < len(pids):
            deadline = time.monotonic() + 10
            for other in set(pids) - set(codes):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(other, signal.SIGTERM)
    return first


request, code = serve()  # the zygote never gets past this line; each child does
os.setsid()  # its own process group: a timeout kills the run and anything it started
for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                       (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    opened = os.open(path, mode)
    os.dup2(opened, fd)
    os.close(opened)
sys.stdin = open(os.devnull)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a timed-out run prints its threads' stacks (conftest.Zygote)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
sys.argv = request["argv"]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
import runpy  # noqa: E402  (Python's and NumPy's global generators reseed themselves in a forked child)

if request.get("site"):  # a test's sitecustomize.py, which a fresh interpreter would run at start-up from PYTHONPATH
    runpy.run_path(request["site"], run_name="sitecustomize")
if code is None:
    runpy.run_path(sys.argv[0], run_name="__main__")
else:  # what runpy.run_path(sys.argv[0], run_name="__main__") does, with the code compiled already
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=sys.argv[0], __cached__=None, __loader__=None, __package__="", __spec__=None)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)
sys.exit(0)
