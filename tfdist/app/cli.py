"""The `tfdist` command.

    tfdist train [--config FILE] [--strategy S] [--precision P] [--set KEY=VALUE ...]
    tfdist launch -n N [--ps M] [--max_restarts R] [--grace_seconds S] [--network host]
                  -- COMMAND ...
    tfdist supervise [--grace_seconds S] -- LAUNCHER ...
    tfdist isolate -- COMMAND ...
    tfdist env [--json]

TensorFlow's C++ start-up lines (oneDNN, CPU features, ...) are hidden unless
TF_CPP_MIN_LOG_LEVEL is set or `--verbose` is given (before `--` for launch, whose
processes inherit the setting).

Bad input (a flag, a config value, the environment) prints one line,
`tfdist: error: ...`, to stderr and exits with status 2; a cluster that cannot go on
(a parameter server lost, a peer stuck past the collective timeout) prints one such
line and exits with status 1. A preempted run (SIGTERM) saves and exits with 143.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import sys
from typing import Any, Callable, NoReturn, Sequence

from absl import app, flags, logging

import tfdist
from tfdist import flags as tfdist_flags
from tfdist import quiet
from tfdist.cluster import set_default_environment
from tfdist.config import config_keys, field_help, load_config
from tfdist.errors import MISSING_TENSORFLOW, ClusterError, ConfigError, first_line

_USAGE = """usage: tfdist COMMAND [FLAGS]

commands:
  train   train the reference model with model.fit under the chosen strategy;
          the chief's last line is a JSON object with the result
  launch  run COMMAND as N local workers (and M parameter servers) with TF_CONFIG set:
          tfdist launch -n 2 -- tfdist train --strategy multi_worker
  supervise  run a launcher so that SIGTERM lets the ranks save and ends it with 143:
             tfdist supervise -- mpirun -np 2 tfdist train --strategy horovod
  isolate    run a one-machine launcher in a network of its own, loopback alone, so
             that nothing outside reaches its processes' servers:
             tfdist isolate -- mpirun -np 2 tfdist train --strategy horovod
  env     what tfdist detects here: versions, devices, cluster, what auto chooses
          (--json: the full report, with every patch and its upstream issue)

Run 'tfdist COMMAND --help' for a command's flags; --verbose shows TensorFlow's own log;
'tfdist --version' prints tfdist's version."""


def _no_op() -> None:
    pass


# How `train` and `env` import TensorFlow, once their flags are parsed: quietly unless the
# user asked to see TensorFlow's log (main decides).
_start_tensorflow: Callable[[], None] = _no_op


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `tfdist` console script."""
    global _start_tensorflow
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(_USAGE)
        sys.exit(0 if len(argv) >= 2 else 2)
    if argv[1] in ("--version", "version"):
        print(f"tfdist {tfdist.__version__}")
        sys.exit(0)
    command, rest = argv[1], argv[2:]
    own = rest[:rest.index("--")] if "--" in rest else rest
    if "--verbose" in own:
        rest.remove("--verbose")  # The first one, which is in `own`.
        hide_tensorflow_log = False
    else:
        # Before TensorFlow is imported: its C++ log reads the level once, at start. A
        # level the user set is theirs, and so is every line it lets through.
        hide_tensorflow_log = bool(set_default_environment(quiet.QUIET_TENSORFLOW))
    if command == "launch":
        sys.exit(_launch(rest, hide_tensorflow_log=hide_tensorflow_log))
    if command == "supervise":
        sys.exit(_supervise(rest))
    if command == "isolate":
        _isolate(rest)
    _start_tensorflow = quiet.import_tensorflow if hide_tensorflow_log else _no_op
    if command in ("train", "env") and importlib.util.find_spec("tensorflow") is None:
        _fail(MISSING_TENSORFLOW)
    as_json = command == "env" and "--json" in rest
    if as_json:
        rest.remove("--json")
    commands = {"train": _train, "env": functools.partial(_env, as_json=as_json)}
    if command not in commands:
        _fail(f"unknown command '{command}'; use one of train, launch, supervise, isolate, env "
              f"(tfdist --help). Received: {command}")
    if "--help" in rest or "-h" in rest:
        # absl's own --help lists only __main__'s flags and exits with status 1.
        print(f"usage: tfdist {command} [FLAGS]\n")
        if command == "train":
            print(flags.FLAGS.module_help(tfdist_flags))
            print("\nConfig keys (for --set KEY=VALUE, or a --config file):")
            defaults = load_config().to_dict()
            for key in config_keys():
                default = functools.reduce(lambda section, name: section[name],
                                           key.split("."), defaults)
                print(f"  {key} (default: {default!r}): {field_help(key)}")
        else:
            print("flags:\n  --json: the full report as JSON (every patch, the bfloat16 probe)")
        print("\nAbsl and TensorFlow flags: tfdist " + command + " --helpfull")
        sys.exit(0)
    app.run(_one_line_errors(commands[command]), argv=[f"tfdist {command}", *rest],
            flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        _fail(str(error).replace("\n", " "))


def _one_line_errors(command):
    def run(argv: list[str]) -> None:
        if len(argv) > 1:
            _fail(f"{argv[0]} takes flags only; unexpected arguments: {' '.join(argv[1:])}")
        if not flags.FLAGS["verbosity"].present:
            # absl's app.run shows INFO, which floods the console with TensorFlow's
            # per-variable messages; --verbosity=0 brings them back.
            logging.set_verbosity(logging.WARNING)
        try:
            command()
        except KeyboardInterrupt:
            _fail("interrupted (Ctrl-C); a run with a checkpoint folder resumes from its last "
                  "checkpoint when started again", status=130)
        except ConfigError as error:
            _fail(str(error))
        except ClusterError as error:
            _fail(str(error), status=1)
        except Exception as error:  # noqa: BLE001 - only TensorFlow's peer failures are caught
            message = _peer_failure(error)
            if message is None:
                raise
            _fail(message, status=1)
    return run


def _peer_failure(error: Exception) -> str | None:
    """One line for a collective that timed out or lost a peer; None for anything else."""
    tf = sys.modules.get("tensorflow")
    if tf is None:  # Nothing ran a collective.
        return None

    text = str(error)
    if isinstance(error, tf.errors.DeadlineExceededError) and "Collective has timed out" in text:
        return ("a peer did not join a collective within its timeout (multi_worker."
                "timeout_seconds): it is stuck, much slower than the others, or gone. "
                "Restart the group (tfdist launch --max_restarts, or the cluster's restart "
                "policy) to resume from the last checkpoint. Received: "
                f"{type(error).__name__}: Collective has timed out during execution")
    horovod_shutdown = "Horovod has been shut down" in text or "HorovodInternalError" in \
        type(error).__name__
    if horovod_shutdown:
        return ("Horovod shut down: a rank stopped joining collectives (stuck past "
                "horovod.timeout_seconds, or gone). Restart the job to resume from the last "
                f"checkpoint. Received: {type(error).__name__}: {first_line(error)}")
    return None


def _fail(message: str, status: int = 2) -> NoReturn:
    # A line for each mistake (a config with several has several).
    for line in str(message).splitlines() or [""]:
        print(f"tfdist: error: {line}", file=sys.stderr, flush=True)
    sys.exit(status)


def _train() -> None:
    config = tfdist_flags.config_from_flags()  # Fails fast, before TensorFlow is imported.
    _start_tensorflow()
    from tfdist.app import train
    from tfdist.runner import Runner

    runner = Runner(config)
    if runner.is_chief:
        print(runner.summary(), file=sys.stderr, flush=True)
    result = train.run(runner.config, runner=runner)
    if result.pop("is_chief"):
        print(json.dumps(result), flush=True)


def _launch(argv: list[str], *, hide_tensorflow_log: bool) -> int:
    from tfdist.app import launch

    options = flags.FlagValues()
    flags.DEFINE_integer("num_workers", 1, "Worker processes.", short_name="n",
                         flag_values=options)
    flags.DEFINE_integer("ps", 0, "Parameter servers; with them, a chief coordinates.",
                         flag_values=options)
    flags.DEFINE_integer("max_restarts", 0, "Restarts of the whole group after a failure "
                         "(a preempted run that saved exits with 143 and is restarted too).",
                         flag_values=options)
    flags.DEFINE_float("grace_seconds", 30.0, "After Ctrl-C or SIGTERM to the launcher, or a "
                       "task exiting with 143, how long the tasks have to save and exit "
                       "before they are killed.", flag_values=options)
    flags.DEFINE_enum("network", "private", ["private", "host"],
                      "private: the tasks share a network of their own, loopback alone, so "
                      "their TensorFlow servers (which authenticate no one) are reachable from "
                      "them alone; host: this machine's network, for a task that needs the "
                      "outside (a data set fetched during training, a remote debugger).",
                      flag_values=options)
    command = _command_after_flags(
        "launch", "-n N [--ps M] [--max_restarts R] [--grace_seconds S] [--network host]",
        options, argv)
    if command is None:
        return 0
    try:
        if options.grace_seconds <= 0:
            raise ConfigError(f"tfdist launch --grace_seconds must be > 0. "
                              f"Received: --grace_seconds {options.grace_seconds:g}")
        return launch.launch(command, options.num_workers, options.ps, options.max_restarts,
                             grace_seconds=options.grace_seconds,
                             hide_tensorflow_log=hide_tensorflow_log,
                             network=options.network)
    except ConfigError as error:
        _fail(str(error))


def _supervise(argv: list[str]) -> int:
    from tfdist.app import supervise

    options = flags.FlagValues()
    flags.DEFINE_float("grace_seconds", 30.0, "After SIGTERM or Ctrl-C, how long the ranks "
                       "have to save and the launcher to end before it is stopped (at least "
                       "checkpoint.grace_seconds).", flag_values=options)
    command = _command_after_flags("supervise", "[--grace_seconds S]", options, argv)
    if command is None:
        return 0
    try:
        return supervise.supervise(command, grace_seconds=options.grace_seconds)
    except ConfigError as error:
        _fail(str(error))


def _isolate(argv: list[str]) -> NoReturn:
    """Becomes COMMAND, in a private network (or, where none can be made, says so once)."""
    import shutil

    from tfdist.app import isolation

    options = flags.FlagValues()
    command = _command_after_flags("isolate", "", options, argv)
    if command is None:
        sys.exit(0)
    if not command:
        _fail("tfdist isolate needs a command after '--', such as "
              "tfdist isolate -- mpirun -np 2 tfdist train --strategy horovod")
    if shutil.which(command[0]) is None:
        _fail(f"tfdist isolate: command not found: {command[0]}; give a program on PATH or a "
              f"path to an executable file. Received: {' '.join(command)}")
    try:
        isolation.enter_private_network()
    except isolation.IsolationUnavailable as reason:
        print(f"tfdist isolate: {command[0]}'s processes run on this machine's network, where "
              f"their servers listen on every interface: {reason}. Allow user namespaces (or "
              f"run with CAP_SYS_ADMIN), or keep their ports behind a firewall",
              file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execvp(command[0], command)


def _command_after_flags(name: str, usage: str, options: flags.FlagValues,
                         argv: list[str]) -> list[str] | None:
    """Parses `[FLAGS] -- COMMAND ...` into `options`; returns COMMAND, or None after --help."""
    own, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    if "--help" in own or "-h" in own:
        print(f"usage: tfdist {name} {usage} -- COMMAND ...\n")
        print(options.module_help(__name__).replace(f"{__name__}:", "flags:"))
        return None
    try:
        unparsed = options([f"tfdist {name}", *own])
    except flags.Error as error:
        _fail(str(error).replace("\n", " "))
    if len(unparsed) > 1:
        _fail(f"tfdist {name} takes its flags, then '--', then the command; unexpected: "
              f"{' '.join(unparsed[1:])}")
    return command


def _env(as_json: bool = False) -> None:
    _start_tensorflow()
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist import registry
    from tfdist.cluster import detect_cluster
    from tfdist.precision import resolve_precision
    from tfdist.runner import choose_strategy
    from tfdist.config import Precision

    cluster = detect_cluster()
    strategy, reason = choose_strategy(cluster)
    precision = resolve_precision(Precision.AUTO, strategy=strategy, cluster=cluster)
    report = {
        "versions": {"tfdist": tfdist.__version__, "python": platform.python_version(),
                     "tensorflow": tf.__version__, "keras": keras.__version__},
        # Which tfdist this is, when several trees or installs could be on the path.
        "tfdist_from": os.path.dirname(os.path.abspath(tfdist.__file__)),
        "cluster": cluster.to_dict(),
        "strategies_available": registry.available(),
        "horovod": _horovod_build(),
        "auto": {"strategy": strategy.value, "why": reason,
                 "precision": precision.name, "precision_why": precision.reason},
        "zero_stage": _zero_stages(),
        "model_parallel": _model_parallel(),
        "bfloat16_probe": _bfloat16_probe(cluster),
        "patches": patches_report(),
    }
    print(json.dumps(report, indent=2, default=str) if as_json else _env_summary(report, cluster))


def _env_summary(report: dict, cluster: Any) -> str:
    """`tfdist env`'s few lines for a person; `--json` gives the report itself."""
    versions = report["versions"]
    cpu = f"{cluster.cpu_cores} cores" + (f", {cluster.cpu_model}" if cluster.cpu_model else "")
    if cluster.cpu_bf16:
        cpu += ", bfloat16 instructions"
    gpus = ", ".join(gpu.name for gpu in cluster.gpus) or "none"
    if cluster.tf_config is not None:
        config = cluster.tf_config
        where = (f"TF_CONFIG: {config.task_type}:{config.task_index} of "
                 f"{sum(len(addresses) for addresses in config.cluster.values())} tasks")
    elif cluster.slurm is not None:
        where = f"Slurm job {cluster.slurm.job_id}: task {cluster.slurm.proc_id} of " \
                f"{cluster.slurm.num_tasks}"
    elif cluster.mpi is not None:
        where = f"{cluster.mpi.launcher}: rank {cluster.mpi.rank} of {cluster.mpi.size}"
    else:
        where = "none found (no TF_CONFIG, Slurm job step or MPI rank): one process"
    horovod = report["horovod"]
    if horovod["installed"]:
        built = [name for key, name in (("mpi", "MPI"), ("gloo", "Gloo"), ("nccl", "NCCL"))
                 if horovod[key]]
        horovod_line = f"{horovod['version']} with {', '.join(built)}"
    else:
        horovod_line = f"not installed ({horovod['install']})"
    patches = report["patches"]
    auto = report["auto"]
    return "\n".join([
        f"tfdist {versions['tfdist']} (from {report['tfdist_from']}), Python "
        f"{versions['python']}, TensorFlow {versions['tensorflow']}, Keras {versions['keras']}",
        f"devices     CPU: {cpu}; GPUs: {gpus}"
        + (f"; TPU: {cluster.tpu.name}" if cluster.tpu else ""),
        f"cluster     {where}",
        f"auto        strategy {auto['strategy']} ({auto['why']})",
        f"            precision {auto['precision']} ({auto['precision_why']})",
        f"strategies  {', '.join(report['strategies_available'])}",
        f"horovod     {horovod_line}",
        f"zero_stage  1, 2 and 3 under {', '.join(report['zero_stage']['strategies'])} "
        f"(one_device: nothing to shard); refused by the others",
        f"parallel    model_parallel.devices > 1 under "
        f"{', '.join(report['model_parallel']['strategies'])}; refused by the others",
        f"patches     {len(patches['all'])} known, {len(patches['active'])} active in this "
        f"process (each with its upstream issue: --json)",
        "the full report, as JSON: tfdist env --json",
    ])


def _bfloat16_probe(cluster: Any) -> dict:
    """The matmul figures `precision: auto` decided from on this CPU (cached per machine)."""
    if not cluster.cpu_bf16:
        return {"probed": False, "why": "the CPU has no bfloat16 instructions"}
    from tfdist import bfloat16_probe

    try:
        probe = bfloat16_probe.cached_probe(cluster)
    except (OSError, RuntimeError) as error:
        return {"probed": False, "why": str(error)}
    return {"probed": True, "float32_gflops": round(probe.float32_gflops, 1),
            "bfloat16_gflops": round(probe.bfloat16_gflops, 1),
            "speedup": round(probe.speedup, 3), "bfloat16_faster": probe.bfloat16_faster,
            "min_speedup": bfloat16_probe.MIN_SPEEDUP,
            "cache": os.path.join(cluster.cache_dir, bfloat16_probe.CACHE_FILE)}


def patches_report(check_bugs: bool = True) -> dict:
    """tfdist's fixes to Keras and TensorFlow: which are active in this process, and for
    each, what goes wrong without it, its upstream issue, whether the installed code still
    has the bug, and which strategies apply it (`tfdist env --json`; the docs' patches page).

    Args:
        check_bugs: Read the installed code for each bug (imports Keras, TensorFlow and
            Horovod). False: `bug_present` is None.

    Example:
        [patch["name"] for patch in patches_report()["all"] if patch["bug_present"]]
    """
    from tfdist import patches, registry

    users: dict[str, list[str]] = {}
    for name in registry.available():
        adapter_cls = registry.get(name)
        for patch in (*patches.EXACT_UPDATES, *adapter_cls.patches,
                      *adapter_cls.patches_while_building):
            if name not in users.setdefault(patch.name, []):
                users[patch.name].append(name)
    for patch in patches.HOROVOD_KERAS:
        users.setdefault(patch.name, []).append("tfdist.horovod.keras.init()")
    for patch in patches.MODEL_PARALLEL:
        users.setdefault(patch.name, []).append("tfdist.parallel")
    return {"active": patches.active(),
            "all": [{"name": patch.name, "summary": patch.summary, "upstream": patch.upstream,
                     "bug_present": _bug_present(patch) if check_bugs else None,
                     "applied_by": users.get(patch.name, [])}
                    for patch in patches.registered()]}


def _bug_present(patch: Any) -> bool | None:
    """Whether the installed code still has the bug; None where the component (Horovod)
    is not installed here."""
    try:
        return patch.bug_present()
    except ImportError:
        return None


def _zero_stages() -> dict:
    """Where sharded training state (`zero_stage` 1, 2, 3) runs, and why the others refuse it."""
    from tfdist import registry

    adapters = {name: registry.get(name) for name in registry.available()}
    return {"stages": [0, 1, 2, 3],
            "strategies": [name for name, adapter in adapters.items()
                           if adapter.zero_refusal is None],
            "refused": {name: adapter.zero_refusal for name, adapter in adapters.items()
                        if adapter.zero_refusal is not None}}


def _model_parallel() -> dict:
    """Where one model spread over a process's devices (`model_parallel.devices` > 1) runs,
    and why the others refuse it."""
    from tfdist import registry

    adapters = {name: registry.get(name) for name in registry.available()}
    return {"strategies": [name for name, adapter in adapters.items()
                           if adapter.model_parallel_refusal is None],
            "refused": {name: adapter.model_parallel_refusal
                        for name, adapter in adapters.items()
                        if adapter.model_parallel_refusal is not None}}


def _horovod_build() -> dict:
    """Horovod's version and what it was built with, or how to get it."""
    from tfdist.adapters.horovod import import_horovod

    try:
        hvd = import_horovod()
    except ConfigError as error:  # It says how to build Horovod here.
        return {"installed": False, "install": str(error)}
    import horovod

    return {"installed": True, "version": horovod.__version__, "mpi": bool(hvd.mpi_built()),
            "gloo": bool(hvd.gloo_built()), "nccl": bool(hvd.nccl_built())}


if __name__ == "__main__":
    main()
