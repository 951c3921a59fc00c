"""The run's configuration: frozen dataclasses, string enums, strict loading.

Precedence is decided here and nowhere else: dataclass defaults, then the YAML
file, then overrides (dotted keys), then validation. The result is frozen.

Every value passes through `Config.__post_init__`, whichever way the config
was made (`load_config`, `Config(...)`, `dataclasses.replace`): strings become
enums through one resolver with a small alias table (`tfdist.choices`), sections given as dicts
become dataclasses, each field's bound (beside it: `_field(..., bound=...)`) is
checked by one loop, and `_validate` checks the values that must agree with each
other. Errors are one line that names the key, says what is expected and ends with what
was received.

Example:

    config = load_config("mirrored",
                         overrides={"precision": "bf16", "mirrored.cpu_replicas": 2})
    config.precision          # Precision.MIXED_BFLOAT16
    config.mirrored.cpu_replicas  # 2
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import re
import types
import typing
from typing import Any, Callable, Mapping

import yaml

from tfdist import presets
from tfdist.choices import (AutoShard, Communication, Compression, CrossDeviceOps, DatasetName,
                            OptimizerName, Precision, Reduction, Strategy, ZeroStage,
                            parse_enum, parse_numbered)
from tfdist.errors import ConfigError

__all__ = ["AutoShard", "CheckpointConfig", "ClusterConfig", "Communication", "Compression",
           "Config", "CrossDeviceOps", "DEFAULT_COLLECTIVE_TIMEOUT_SECONDS", "DatasetName",
           "HorovodConfig", "MirroredConfig", "ModelParallelConfig", "MultiWorkerConfig",
           "OneDeviceConfig", "OptimizerName", "ParameterServerConfig", "Precision",
           "Reduction", "Strategy", "TPUConfig", "ThreadsConfig", "TrainConfig", "ZeroConfig",
           "ZeroStage", "check_precision_supported", "config_keys", "field_help",
           "load_config", "parse_enum"]


# Long enough for peers that trace, compile or read data at different speeds; short enough
# that a stuck peer ends the job well inside the usual 30-second preemption notice plus a
# restart. tfdist fences its own long pauses (checkpoint reads and writes) with
# coordination-service barriers, which have their own, longer timeout.
DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class _Bound:
    """What one field's value must be: a check, and the words its one-line error uses."""

    holds: Callable[[Any], bool]
    requirement: str


def _at_least(low: float, requirement: str) -> _Bound:
    return _Bound(lambda value: value >= low, requirement)


def _above(low: float, requirement: str) -> _Bound:
    return _Bound(lambda value: value > low, requirement)


def _field(default: Any, help: str,  # noqa: A002 - `help` is the metadata's name
           bound: _Bound | None = None) -> Any:
    """A config field: its default, its help (`tfdist train --help`), and the bound its
    value must keep (checked by `_out_of_bounds`; None, as for an unset seed, is not checked)."""
    return dataclasses.field(default=default, metadata={"help": help, "bound": bound})


_SECONDS = _at_least(0, "a number of seconds >= 0 (0: no timeout)")
_THREADS = _at_least(0, "an integer >= 0 (0: TensorFlow's default)")
_POSITIVE = _at_least(1, "an integer >= 1")


@dataclasses.dataclass(frozen=True)
class OneDeviceConfig:
    """Options of the `one_device` strategy."""

    device: str = _field(
        "", "Device to train on, e.g. '/gpu:1'. Empty: the first GPU, else the CPU.")


@dataclasses.dataclass(frozen=True)
class MirroredConfig:
    """Options of the `mirrored` strategy (one machine, several devices)."""

    devices: tuple[str, ...] = _field(
        (), "Devices to mirror across, e.g. ['/gpu:0', '/gpu:1']. Empty: every GPU, else the CPU.")
    cross_device_ops: CrossDeviceOps = _field(
        CrossDeviceOps.AUTO,
        "Gradient all-reduce: auto (TensorFlow's choice), nccl, hierarchical_copy, reduce_to_one.")
    cpu_replicas: int = _field(
        0, "Split the CPU into this many logical devices and mirror across them (0: no split).",
        bound=_at_least(0,
                        "an integer >= 0 (logical CPU devices to mirror across; 0 means no split)"))


@dataclasses.dataclass(frozen=True)
class MultiWorkerConfig:
    """Options of the `multi_worker` strategy (synchronous, several machines)."""

    communication: Communication = _field(
        Communication.AUTO, "Collectives across workers: auto, ring (gRPC) or nccl (GPUs).")
    bytes_per_pack: int = _field(
        0, "Split the gradients into packs of about this many bytes, each all-reduced as "
           "soon as its gradients are computed, overlapping the backward pass (0: one pack, "
           "all-reduced once every gradient is computed).",
        bound=_at_least(0, "0 (one pack) or a positive number of bytes"))
    timeout_seconds: float = _field(
        DEFAULT_COLLECTIVE_TIMEOUT_SECONDS,
        "Abort a collective that waits longer than this for a peer, so a stuck or dead worker "
        "becomes an error on every other worker instead of a hang (0: wait forever).",
        bound=_SECONDS)
    auto_shard: AutoShard = _field(
        AutoShard.AUTO, "How datasets are split across workers: auto, data, file or off.")
    cpu_replicas: int = _field(
        0, "Replicas per worker on logical CPU devices, for machines without GPUs (0: one).",
        bound=_at_least(0, "an integer >= 0 (replicas per worker on the CPU)"))
    workers: tuple[str, ...] = _field(
        (), "host:port of every worker, chief first, when neither TF_CONFIG nor Slurm sets "
            "the cluster.",
        bound=_Bound(lambda workers: all(":" in address for address in workers),
                     "a list of 'host:port' addresses"))
    task_index: int = _field(0, "This process's index in `workers`.")
    slurm_port_base: int = _field(
        8888, "Under Slurm, the first port of the workers on each node (one port per task).",
        bound=_Bound(lambda port: 1024 <= port <= 65000, "a port number from 1024 to 65000"))


@dataclasses.dataclass(frozen=True)
class TPUConfig:
    """Where the TPU is: the arguments of `TPUClusterResolver`."""

    name: str = _field(
        "", "TPU name, grpc:// address, or 'local' on a TPU VM. Empty: found from the environment.")
    zone: str = _field("", "GCE zone of a named TPU. Empty: from the metadata server.")
    project: str = _field("", "GCP project of a named TPU. Empty: from the metadata server.")


@dataclasses.dataclass(frozen=True)
class HorovodConfig:
    """Options of the `horovod` strategy (one process per device, under mpirun or horovodrun)."""

    op: Reduction = _field(
        Reduction.AVERAGE, "How gradients combine across ranks: average, sum or adasum.")
    compression: Compression = _field(
        Compression.NONE, "Gradient compression on the wire: none or fp16.")
    grouped: bool = _field(
        False, "Reduce the gradients in buckets of 25 MB, the last layers' first, each as "
               "soon as its gradients are computed, overlapping the backward pass (false), "
               "or all in one grouped allreduce once every gradient is computed (true); "
               "benchmarks/overlap.py compares them.")
    sparse_as_dense: bool = _field(
        False, "Allreduce sparse gradients (embeddings) as dense tensors instead of "
               "allgathering them; faster when most rows change every step.")
    scale_learning_rate: bool = _field(
        False, "Multiply the learning rate by the number of ranks (Goyal et al., 2017).")
    warmup_steps: int = _field(
        0, "With scale_learning_rate: ramp linearly from the base rate to the scaled one "
           "over this many updates (0: scaled from the first update).",
        bound=_at_least(0, "an integer >= 0 (updates to ramp the scaled learning rate over)"))
    timeout_seconds: float = _field(
        DEFAULT_COLLECTIVE_TIMEOUT_SECONDS,
        "Shut Horovod down when a rank has not joined a collective the others wait in for "
        "this long, so a stuck rank becomes an error instead of a hang (0: wait forever).",
        bound=_SECONDS)
    cycle_time_ms: float | None = _field(
        None, "Milliseconds between Horovod's background cycles (HOROVOD_CYCLE_TIME); a "
              "collective waits for the next cycle to start. Unset: 0.1 at zero_stage 2 "
              "and 3, whose collectives (a few per layer) go one after another, each waiting "
              "a cycle (benchmarks/zero.py), else Horovod's own (1). An exported "
              "HOROVOD_CYCLE_TIME wins.",
        bound=_above(0, "a number of milliseconds > 0, or unset"))


@dataclasses.dataclass(frozen=True)
class ParameterServerConfig:
    """Options of the `parameter_server` strategy (a chief, workers and ps tasks)."""

    min_shard_bytes: int = _field(
        256 << 10, "A variable is split into shards of at least this many bytes, across "
                   "the parameter servers (row-wise, on its first axis).",
        bound=_at_least(1, "an integer >= 1 (bytes per shard, at least)"))
    max_shards: int = _field(
        0, "At most this many shards per variable (0: one per parameter server; "
           "1: no sharding).",
        bound=_at_least(0, "an integer >= 0 (0: one shard per parameter server)"))


@dataclasses.dataclass(frozen=True)
class ModelParallelConfig:
    """Model parallelism inside each process (`tfdist.parallel`): one copy of the model over
    several devices, its layers in pipeline stages or its matmuls split."""

    devices: int = _field(
        1, "Devices each process spreads one model over: its GPUs (horovod rank r: GPUs "
           "r*K ... r*K+K-1 of its machine), or this many logical CPU devices without GPUs. "
           "1: no model parallelism. one_device and horovod only.",
        bound=_at_least(1, "an integer >= 1 (devices one model is spread over in each process)"))
    micro_batches: int = _field(
        1, "Micro-batches each batch is cut into by a tfdist.parallel.Pipeline, whose stages "
           "then overlap (GPipe); must divide each process's batch.",
        bound=_at_least(1, "an integer >= 1 (micro-batches per batch in a Pipeline)"))


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """How zero_stage 3 gathers the weights (`tfdist.sharding.units`)."""

    reshard_after_forward: bool = _field(
        True, "At zero_stage 3, each layer's weights are gathered for its call and dropped "
              "after it, then gathered again in the backward pass, which recomputes the "
              "layer's forward (about one more forward pass): a rank holds one layer's whole "
              "weights at a time. false: each gathered weight lives until the backward pass "
              "has used it, so at the peak every rank holds the whole model's.")
    prefetch: int = _field(
        0, "With zero.reshard_after_forward, how many layers ahead each layer's weights are "
           "gathered: in the forward pass while the layers before it compute, in the "
           "backward pass while the layers after it do (FSDP's forward and backward "
           "prefetch). Each one ahead holds one more layer's whole weights. 0: each "
           "layer's gather waits for its own input (on CPUs, where Horovod's collectives "
           "share the cores with the compute, 1 measured slower).",
        bound=_at_least(0, "an integer >= 0 (layers gathered ahead; 0: none)"))
    bucket_mb: float = _field(
        0.0, "With zero.reshard_after_forward, a layer's weights are gathered in one "
             "collective, and their gradients reduce-scattered in one, while their float32 "
             "size together stays within this many MiB (a larger weight goes alone): fewer "
             "collectives, each waiting for the one before it, for a copy of the bucket "
             "when it is cut back into its weights. 0: one collective per weight.",
        bound=_at_least(0, "a number >= 0 (MiB per bucket; 0: one collective per weight)"))
    unit: tuple[str, ...] = _field(
        (), "With zero.reshard_after_forward, names of layers (a transformer block, say) "
            "that are each one unit of every weight inside them: gathered whole for the "
            "layer's call, dropped after it and gathered again for its backward pass, which "
            "recomputes the whole layer. Each named layer holds its whole weights at once; "
            "one whose call updates state (Dropout's seed, BatchNormalization's statistics) "
            "is refused. Empty: each layer that creates weights is a unit of its own.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints for an exact resume after a crash or preemption (`runner.callbacks`)."""

    dir: str = _field(
        "", "Folder of the run's checkpoints, readable by every process; a run restarted with "
            "the same folder resumes from its newest good checkpoint (empty: no checkpoints).")
    save_every_steps: int = _field(
        0, "Also save every this many training steps, counted across epochs (0: at the end of "
           "each epoch only).", bound=_at_least(0, "an integer >= 0 (0: at epoch ends only)"))
    keep: int = _field(
        3, "Checkpoints kept; older ones are deleted (at least 2, so a torn newest one has a "
           "fallback).",
        bound=_at_least(2, "an integer >= 2 (the newest checkpoint and at least one to fall "
                           "back on)"))
    grace_seconds: float = _field(
        25.0, "After SIGTERM, every process saves at one agreed step and exits with status "
              "143; a process still running this long after the signal exits without saving.",
        bound=_above(0, "a number of seconds > 0"))
    resume_changed: bool = _field(
        False, "Resume a checkpoint folder even though the run differs from the one that made "
               "it (another model, optimizer setting, batch, or fewer epochs); without it such "
               "a run stops with one line naming the differences.")


@dataclasses.dataclass(frozen=True)
class ThreadsConfig:
    """TensorFlow's thread pools; set before TensorFlow starts its runtime."""

    inter_op: int = _field(
        0, "Threads running independent ops (0: TensorFlow's default). "
           "With several local processes use at least processes + 1.", bound=_THREADS)
    intra_op: int = _field(0, "Threads inside one op (0: TensorFlow's default).", bound=_THREADS)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """How the processes of a multi-process run find each other."""

    startup_timeout_seconds: float = _field(
        300.0, "How long a task waits at start-up for every other task to answer before it "
               "stops with a line naming those that never did (pods being scheduled, images "
               "being pulled: minutes, not seconds).", bound=_above(0, "a number of seconds > 0"))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The main job run by `tfdist train`; the Runner itself does not read it."""

    dataset: DatasetName = _field(DatasetName.DIGITS, "digits (real, bundled) or synthetic.")
    epochs: int = _field(5, "Passes over the training data.", bound=_POSITIVE)
    global_batch_size: int = _field(
        64, "Examples per step across all replicas (the micro-batch when accumulating).",
        bound=_POSITIVE)
    optimizer: OptimizerName = _field(OptimizerName.ADAM, "adam or sgd.")
    learning_rate: float = _field(1e-3, "Learning rate of the optimizer.",
                                  bound=_above(0, "a number > 0"))
    hidden_units: int = _field(128, "Width of the reference model's hidden layers.",
                               bound=_POSITIVE)
    hidden_layers: int = _field(2, "Number of hidden Dense layers in the reference model.",
                                bound=_at_least(0, "an integer >= 0"))
    synthetic_examples: int = _field(4096, "Training examples in the synthetic dataset.",
                                     bound=_POSITIVE)
    synthetic_features: int = _field(256, "Features per synthetic example.", bound=_POSITIVE)
    output_dir: str = _field(
        "tfdist_output", "Where the chief writes the resolved config and result.",
        bound=_Bound(bool, "a directory path"))
    tensorboard: bool = _field(False, "Write TensorBoard logs to output_dir/tensorboard (chief).")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that decides how a run trains.

    Args:
        strategy: How training is placed on devices; `auto` chooses from the hardware.
        precision: Keras dtype policy. None means the strategy's default:
            `mixed_bfloat16` on TPU, `float32` elsewhere.
        accumulation_steps: Micro-batches whose gradients make one optimizer update.
        zero_stage: Sharded training state (ZeRO): 0 (every rank holds all of it), 1
            (each rank holds the optimizer state of its share of the variables), 2
            (also only its slice of the averaged gradients) or 3 (also only its slice
            of each weight, from the variable's creation); see `tfdist.sharding`.
        seed: Seeds Python, NumPy and TensorFlow when set, so runs repeat.
        one_device: The `one_device` strategy's options.
        mirrored: The `mirrored` strategy's options.
        multi_worker: The `multi_worker` strategy's options.
        tpu: The `tpu` strategy's options.
        horovod: The `horovod` strategy's options.
        parameter_server: The `parameter_server` strategy's options.
        model_parallel: One model over several devices per process (`tfdist.parallel`).
        zero: How zero_stage 3 gathers the weights.
        checkpoint: Checkpoints for an exact resume, and what a SIGTERM does.
        cluster: How the processes of a multi-process run find each other.
        trusted_network: Silence the warning about TensorFlow's unauthenticated servers.
        every_process_prints: Every process prints progress bars and status lines, not
            the chief alone.
        threads: TensorFlow's thread pools.
        train: The main job's settings (`tfdist train`).

    Example:

        config = Config(strategy="mirrored", mirrored={"cpu_replicas": 2})
        config.strategy is Strategy.MIRRORED   # True
    """

    strategy: Strategy = _field(Strategy.AUTO, "auto, one_device, mirrored, multi_worker, "
                                               "parameter_server, tpu or horovod.")
    precision: Precision | None = _field(
        None, "float32, mixed_float16, mixed_bfloat16 or auto. "
              "Unset: the strategy's default (mixed_bfloat16 on TPU, float32 elsewhere).")
    accumulation_steps: int = _field(
        1, "Micro-batches per optimizer update: gradients of this many steps are summed on "
           "each replica and applied (and reduced across replicas) once, as one batch this "
           "many times larger.",
        bound=_at_least(1, "an integer >= 1 (micro-batches per optimizer update; 1 means no "
                           "accumulation)"))
    zero_stage: ZeroStage = _field(
        ZeroStage.NONE,
        "Sharded training state (ZeRO), under horovod: 0 every rank holds all of the "
        "optimizer state; 1 each holds 1/N of it (its variables'); 2 also receives only its "
        "slice of the averaged gradients (element-wise optimizers: SGD, Adam, AdamW, ...); 3 "
        "also stores only its slice of each weight (build the model in runner.scope()).")
    seed: int | None = _field(None, "Seed for Python, NumPy and TensorFlow. Unset: not seeded.",
                              bound=_at_least(0, "a non-negative integer, or unset"))
    one_device: OneDeviceConfig = _field(OneDeviceConfig(), "Options of one_device.")
    mirrored: MirroredConfig = _field(MirroredConfig(), "Options of mirrored.")
    multi_worker: MultiWorkerConfig = _field(MultiWorkerConfig(), "Options of multi_worker.")
    tpu: TPUConfig = _field(TPUConfig(), "Options of tpu.")
    horovod: HorovodConfig = _field(HorovodConfig(), "Options of horovod.")
    parameter_server: ParameterServerConfig = _field(ParameterServerConfig(),
                                                     "Options of parameter_server.")
    model_parallel: ModelParallelConfig = _field(
        ModelParallelConfig(), "Model parallelism over each process's devices.")
    zero: ZeroConfig = _field(ZeroConfig(), "How zero_stage 3 gathers the weights.")
    checkpoint: CheckpointConfig = _field(CheckpointConfig(),
                                          "Checkpoints, resume and preemption.")
    cluster: ClusterConfig = _field(ClusterConfig(), "How the processes find each other.")
    trusted_network: bool = _field(
        False, "The cluster's network admits only trusted machines: silences the warning that "
               "TensorFlow's gRPC servers accept unauthenticated connections.")
    every_process_prints: bool = _field(
        False, "Every process of a multi-process run prints Keras's progress bars and tfdist's "
               "status lines (false: the chief alone; the others print warnings and errors).")
    threads: ThreadsConfig = _field(ThreadsConfig(), "TensorFlow thread pools.")
    train: TrainConfig = _field(TrainConfig(), "The main job (tfdist train).")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        problems: list[str] = []
        coerced = set()
        for f in dataclasses.fields(self):
            try:
                value = _coerce(getattr(self, f.name), hints[f.name], f.name)
            except ConfigError as error:  # the next fields' mistakes are reported too
                problems += error.problems
                continue
            object.__setattr__(self, f.name, value)
            coerced.add(f.name)
        problems += _out_of_bounds(self, "", only=coerced)
        if problems:
            raise ConfigError.of(problems)
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (enums as strings, tuples as lists), ready for YAML or JSON."""
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        """The config as YAML that `load_config` reads back to an equal config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def load_config(path: str | os.PathLike | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Builds a validated, frozen `Config`: defaults, then the file, then overrides.

    Args:
        path: A YAML file whose keys mirror `Config` (sections are nested mappings), or
            the name of a preset that ships with tfdist ("mirrored": `tfdist.presets`).
            None: start from the defaults.
        overrides: Values that win over the file. Keys may be dotted to reach a nested
            field (`"mirrored.cpu_replicas": 2`) or name a whole section.

    Returns:
        The validated `Config`.

    Raises:
        ConfigError: a missing or malformed file, an unknown key, a wrong type, a value
            out of range, or a combination that cannot work.

    Example:

        config = load_config(overrides={"strategy": "mirrored", "mirrored.cpu_replicas": 2})
    """
    if isinstance(path, Mapping):
        raise ConfigError("load_config's first argument is a file or a preset's name; pass "
                          "values as overrides: load_config(overrides={...}). "
                          f"Received: {_clip_value(path)}")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError("load_config's path must be a file path or a preset's name. "
                          f"Received: {type(path).__name__}")
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError("load_config's overrides must be a mapping of keys to values, such "
                          "as {\"strategy\": \"mirrored\", \"train.epochs\": 2}. "
                          f"Received: {type(overrides).__name__} {_clip_value(overrides)}")
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(_preset_or_path(path))
    if overrides:
        data = _deep_merge(data, _expand_dotted(overrides))
    return _coerce(data, Config, "")


def _clip_value(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def config_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key a config accepts, e.g. `mirrored.cpu_replicas`."""
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default):
            keys.extend(config_keys(type(f.default), f"{prefix}{f.name}."))
        else:
            keys.append(prefix + f.name)
    return keys


def field_help(key: str) -> str:
    """The help text of a dotted config key, as written beside its field."""
    cls: Any = Config
    *sections, name = key.split(".")
    for section in sections:
        cls = type({f.name: f for f in dataclasses.fields(cls)}[section].default)
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata["help"]


# --- conversion -------------------------------------------------------------------------


# A number as people write it: 3, 0.5, .5, 1e-3, 2.5E+4.
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Converts one value to the field's declared type, or raises a one-line ConfigError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return parse_numbered(hint, value, key)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return parse_enum(hint, value, key)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _coerce_section(value, hint, key)
    if origin is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        return _wrong_type(key, value, "a list of strings")
    if hint is bool:
        return value if isinstance(value, bool) else _wrong_type(key, value, "true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return _wrong_type(key, value, "an integer")
    if hint is float:
        if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
            # YAML 1.1 reads 1e-3 (no dot) as a string; everyone types it.
            value = float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number. Received: {key}={value!r}")
            return float(value)
        return _wrong_type(key, value, "a number")
    if hint is str:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a string; YAML reads unquoted yes/no/on/off as "
                              f"true/false, so quote the value. Received: {key}={value!r}")
        return value if isinstance(value, str) else _wrong_type(key, value, "a string")
    raise TypeError(f"config field {key} has an unsupported type {hint!r}")  # a tfdist bug


def _coerce_section(value: Any, cls: type, key: str) -> Any:
    prefix = f"{key}." if key else ""
    problems: list[str] = []
    if isinstance(value, cls):
        given = {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}
    elif isinstance(value, Mapping):
        given = dict(value)
        problems += _unknown_keys(given, cls, prefix)
        known = {f.name for f in dataclasses.fields(cls)}
        given = {name: v for name, v in given.items() if name in known}
    else:
        where = key or "the config"
        return _wrong_type(where, value, "a mapping of keys to values")
    if cls is Config:  # Config coerces and validates itself in __post_init__.
        try:
            config = Config(**given)
        except ConfigError as error:
            raise ConfigError.of(problems + error.problems) from None
        if problems:
            raise ConfigError.of(problems)
        return config
    hints = typing.get_type_hints(cls)
    coerced = {}
    for name, v in given.items():
        try:
            coerced[name] = _coerce(v, hints[name], prefix + name)
        except ConfigError as error:
            problems += error.problems
    if problems:
        raise ConfigError.of(problems)
    return cls(**coerced)


def _unknown_keys(given: Mapping[str, Any], cls: type, prefix: str) -> list[str]:
    """A line for each key of `given` that `cls` does not have."""
    known = [f.name for f in dataclasses.fields(cls)]
    problems = []
    for name in given:
        if name in known:
            continue
        full = prefix + str(name)
        every_key = config_keys()
        close = difflib.get_close_matches(full, every_key, n=1) or [
            k for k in every_key if k.rsplit(".", 1)[-1] == name][:1]
        hint = f"did you mean '{close[0]}'? " if close else ""
        where = f"under '{prefix[:-1]}'" if prefix else "at the top level"
        problems.append(f"unknown config key '{full}'; {hint}valid keys {where}: "
                        f"{', '.join(known)}. Received: {full}={given[name]!r}")
    return problems


def _wrong_type(key: str, value: Any, expected: str) -> Any:
    raise ConfigError(f"{key} must be {expected}. Received: {key}={value!r} "
                      f"({type(value).__name__})")


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# --- validation: the fields' bounds, then their combinations ------------------------------


def _validate(config: Config) -> None:
    """The combinations of values; each value is of its type and within its bound here."""

    def require(ok: bool, key: str, value: Any, requirement: str) -> None:
        if not ok:
            raise ConfigError(f"{key} must be {requirement}. Received: {key}={value!r}")

    # What no single field's bound can say: values that must agree with each other.
    mirrored = config.mirrored
    require(not (mirrored.cpu_replicas and mirrored.devices), "mirrored.cpu_replicas",
            mirrored.cpu_replicas, "0 when mirrored.devices is set: choose the devices or "
            "the CPU split, not both")
    require(not (mirrored.cpu_replicas and mirrored.cross_device_ops is CrossDeviceOps.NCCL),
            "mirrored.cross_device_ops", "nccl", "auto, hierarchical_copy or reduce_to_one "
            "with cpu_replicas: NCCL reduces on GPUs only")
    multi_worker = config.multi_worker
    require(0 <= multi_worker.task_index < max(1, len(multi_worker.workers)),
            "multi_worker.task_index", multi_worker.task_index,
            f"an index into multi_worker.workers (0 to {max(0, len(multi_worker.workers) - 1)})")
    require(not (multi_worker.cpu_replicas and multi_worker.communication is Communication.NCCL),
            "multi_worker.communication", "nccl", "auto or ring with cpu_replicas: NCCL "
            "runs on GPUs only")
    horovod = config.horovod
    require(not horovod.warmup_steps or horovod.scale_learning_rate, "horovod.warmup_steps",
            horovod.warmup_steps, "0 unless horovod.scale_learning_rate is true: the warmup "
            "ramps up to the scaled rate")
    check_precision_supported(config.strategy, config.precision)


def _out_of_bounds(section: Any, prefix: str, only: set[str] | None = None) -> list[str]:
    """A line for each field out of its bound (`_field(..., bound=...)`), sections
    included, in the order the fields are declared (`only`: these fields of `section`)."""
    problems = []
    for f in dataclasses.fields(section):
        if only is not None and f.name not in only:
            continue
        value, key = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            problems += _out_of_bounds(value, key + ".")
            continue
        bound = f.metadata.get("bound")
        if bound is not None and value is not None and not bound.holds(value):
            problems.append(f"{key} must be {bound.requirement}. Received: "
                            f"{key}={_plain(value)!r}")
    return problems


def check_precision_supported(strategy: Strategy, precision: Precision | None) -> None:
    """Raises ConfigError for a precision the strategy's hardware cannot run.

    Called on the config as written, and again once `auto` has chosen a strategy.
    """
    if strategy is Strategy.TPU and precision is Precision.MIXED_FLOAT16:
        raise ConfigError("precision mixed_float16 does not run on TPU, which computes in "
                          "bfloat16; use mixed_bfloat16 or auto. "
                          "Received: strategy=tpu, precision=mixed_float16")


# --- files and overrides ------------------------------------------------------------------


def _preset_or_path(path: str | os.PathLike) -> str | os.PathLike:
    """A preset's file for a bare preset name that is not a file here; else `path`."""
    text = os.fspath(path)
    if os.path.exists(text) or os.sep in text or text.endswith((".yaml", ".yml")):
        return path
    return presets.path(text) or path


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as stream:
            data = yaml.safe_load(stream)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {os.fspath(path)}; pass the path of a YAML "
                          f"file or a preset's name ({', '.join(presets.names())}). "
                          f"Received: path={os.fspath(path)!r}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a directory: {os.fspath(path)}; pass a YAML file. "
                          f"Received: path={os.fspath(path)!r}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"config file {os.fspath(path)} is not valid YAML{where}: {problem}; "
                          f"fix the syntax there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {os.fspath(path)} must hold a mapping of keys to values. "
                          f"Received: a {type(data).__name__}")
    return data


def _expand_dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"override keys must be non-empty strings. Received: {key!r}")
        *sections, name = key.split(".")
        target = nested
        for section in sections:
            target = target.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override '{key}' reaches inside '{section}', which is not a "
                                  f"section. Received: {key}={value!r}")
        if isinstance(target.get(name), dict) and not isinstance(value, Mapping):
            # Whichever came last would win silently: `--set strategy.x=1` with
            # `--strategy mirrored` trained as if the first were never given.
            inner = ", ".join(f"{key}.{field}" for field in target[name])
            raise ConfigError(f"override '{key}' is a section, which {inner} set keys inside, "
                              f"and a value too; give one of them. Received: {key}={value!r}")
        target[name] = _deep_merge(target[name], value) if (
            isinstance(target.get(name), dict) and isinstance(value, Mapping)) else value
    return nested


def _deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(merged.get(key), Mapping) and isinstance(value, Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
