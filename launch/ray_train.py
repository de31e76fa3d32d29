"""Train on a Ray cluster: train_dreambooth_lora_flux2.py's main in every worker of a Ray Train TorchTrainer, and the
worker group restarted after a failure, each attempt resuming from the last checkpoint.

    pip install "ray[train]"
    python launch/ray_train.py --num_workers 8 --use_gpu --address auto --max_failures 3 -- <the script's flags>

Ray sets up the process group and the rank variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR),
so the script's Accelerator() works unchanged inside a worker; this launcher sets first what `accelerate launch`
would have set from an accelerate config (its mixed precision; ACCELERATE_USE_CPU on CPU workers, without which
each would believe it is alone). The flags are parsed and checked here, on the driver, before any worker starts: a
bad one exits 2 with the script's own message, and so does a cluster without the GPUs (--use_gpu) or CPUs that
--num_workers need (its nodes up at the start: Ray would wait for them, time out and retry forever). Every attempt
runs with --resume_from_checkpoint latest (the first finds none and starts from scratch), so a restarted group
continues at the last checkpoint exactly; the number of workers stays fixed (the script refuses a checkpoint of
another number of processes). --output_dir must be storage every worker sees (NFS or similar), given as an absolute
path on a cluster. Each checkpoint's step and the loss of its last step are reported to Ray (its dashboard shows
them). The exit code is the script's: 0, 2 for bad input (found on a worker: the data; not retried), 1 when the
failures outnumber --max_failures (-1: restarts without limit, said at the start).

FSDP is refused: a hang of FSDP2 under Ray Train is reported upstream (ray-project/ray#57860), and it has not been
verified here; use `accelerate launch` with an FSDP config for it. docs/multinode.md, "Ray cluster", has the rest.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SCRIPT_EXIT = ".ray_exit.json"  # in --output_dir: a worker's bad-input refusal, for the driver to exit with


def parse(argv):
    """-> (the launcher's flags, the script's flags after `--`). A bad value is the script's one-line UsageError."""
    import train_dreambooth_lora_flux2 as T

    argv = list(sys.argv[1:] if argv is None else argv)
    ours, script = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = T._Parser(description=__doc__.split("\n\n")[0],
                  usage="%(prog)s --num_workers N [options] -- <train_dreambooth_lora_flux2.py flags>")
    p.add_argument("--num_workers", type=T.integer(1), required=True,  # 0 would run Ray's local mode in the driver
                   help="training processes (one per GPU with --use_gpu)")
    p.add_argument("--use_gpu", action="store_true", help="a GPU per worker (default: CPU workers)")
    p.add_argument("--address", help="the cluster: 'auto' (the one `ray start` made here) or ray://HOST:10001; "
                   "default: a local Ray started for this run")
    p.add_argument("--max_failures", type=T.integer(-1), default=3,
                   help="restarts of the worker group after a failure; -1: without limit")
    p.add_argument("--accelerate_config", help="an accelerate config file: its mixed precision (FSDP is refused)")
    p.add_argument("--storage_path", help="where Ray keeps its run records (default: <--output_dir>/ray)")
    return p.parse_args(ours), script


def accelerate_env(config_path, use_gpu):
    """The variables `accelerate launch` would set from the config: mixed precision; CPU workers made a group."""
    import yaml

    import train_dreambooth_lora_flux2 as T

    env = {} if use_gpu else {"ACCELERATE_USE_CPU": "true"}
    if config_path:
        try:
            config = yaml.safe_load(Path(config_path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise T.UsageError(f"--accelerate_config {config_path}: {e}") from None
        if config.get("distributed_type") == "FSDP" or config.get("fsdp_config"):
            raise T.UsageError(f"--accelerate_config {config_path}: FSDP is not supported under Ray Train here (a "
                               "hang of FSDP2 under Ray Train is reported upstream); use accelerate launch with it")
        if config.get("mixed_precision"):
            env["ACCELERATE_MIXED_PRECISION"] = str(config["mixed_precision"])
    return env


def check_on_driver(flags, num_workers, address):
    """The script's own parsing and checks, with the workers' process count -> the flags every attempt runs with."""
    import train_dreambooth_lora_flux2 as T

    args = T.parse_args(flags)
    os.environ["WORLD_SIZE"] = str(num_workers)  # the checks that depend on the process count read it
    T.validate_args(args)
    if address and not Path(args.output_dir).is_absolute():
        raise T.UsageError(f"--output_dir {args.output_dir}: on a cluster, give an absolute path to storage every "
                           "worker sees (NFS or similar)")
    if args.resume_from_checkpoint is None:
        flags = [*flags, "--resume_from_checkpoint", "latest"]
    return args, flags


def worker(config):
    """One Ray Train worker: the script's main, reporting each checkpoint to Ray."""
    import ray.train

    os.environ.update(config["env"])
    os.chdir(config["cwd"])
    import train_dreambooth_lora_flux2 as T

    last = {}
    log_step, save_checkpoint = T.log_step, T.save_checkpoint

    def remember_loss(args, accelerator, run, bar, global_step, loss, *rest):
        last["loss"] = float(loss)
        return log_step(args, accelerator, run, bar, global_step, loss, *rest)

    def save_and_report(args, accelerator, run, global_step):
        saved = save_checkpoint(args, accelerator, run, global_step)
        ray.train.report({"step": global_step, "loss": last.get("loss")})  # every worker, as Ray Train requires
        return saved

    T.log_step, T.save_checkpoint = remember_loss, save_and_report
    try:
        T.main(config["argv"])
    except T.UsageError as error:  # bad data, found by every worker alike: said once, and not retried
        if ray.train.get_context().get_world_rank() == 0:
            Path(config["output_dir"], SCRIPT_EXIT).write_text(json.dumps({"code": 2, "error": str(error)}))


def short_of(needed, offered):
    """What the worker group needs (ScalingConfig.total_resources) and the cluster lacks -> a message, or None.
    Ray would wait for them, time the group out after a minute and start it again, forever."""
    if all(offered.get(name, 0) >= amount for name, amount in needed.items()):
        return None
    return (f"the workers need {', '.join(f'{amount:g} {name}' for name, amount in needed.items())}; the cluster has "
            f"{', '.join(f'{offered.get(name, 0):g} {name}' for name in needed)}")


def main(argv=None):
    import train_dreambooth_lora_flux2 as T

    try:
        ours, flags = parse(argv)
        env = accelerate_env(ours.accelerate_config, ours.use_gpu)
        if T.fsdp_requested():
            raise T.UsageError("ACCELERATE_USE_FSDP is set: FSDP is not supported under Ray Train here")
        args, flags = check_on_driver(flags, ours.num_workers, ours.address)
    except T.UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if ours.max_failures == -1:
        print("ray_train: --max_failures -1: the worker group is started again after every failure, without limit",
              file=sys.stderr)
    ray.init(address=ours.address, log_to_driver=True)
    scaling = ScalingConfig(num_workers=ours.num_workers, use_gpu=ours.use_gpu)
    short = short_of(scaling.total_resources, ray.cluster_resources())  # the nodes up now: an autoscaler's are not
    if short:
        print(f"error: --num_workers {ours.num_workers}{' --use_gpu' * ours.use_gpu}: {short}", file=sys.stderr)
        return 2
    output_dir = Path(args.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / SCRIPT_EXIT).unlink(missing_ok=True)
    trainer = TorchTrainer(
        worker, train_loop_config=dict(argv=flags, env=env, cwd=os.getcwd(), output_dir=str(output_dir)),
        scaling_config=scaling,
        run_config=RunConfig(name=output_dir.name, storage_path=ours.storage_path or str(output_dir / "ray"),
                             failure_config=FailureConfig(max_failures=ours.max_failures)))
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 - Ray's TrainingFailedError and the like: the failures ran out
        print(f"error: the run failed after {ours.max_failures} restart(s): {error}", file=sys.stderr)
        return 1
    refused = output_dir / SCRIPT_EXIT
    if refused.exists():
        print(f"error: {json.loads(refused.read_text())['error']}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
