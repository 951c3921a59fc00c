"""The closed sets of strings a config takes: str enums, their aliases, one resolver.

A member prints and serialises as its value. `parse_enum` accepts a member's value
in any case, or one of a small, closed table of aliases (`bf16`, `hvd`), and
otherwise raises a one-line `ConfigError` that lists the choices and the closest.

Example:

    parse_enum(Precision, "bf16", "precision")   # Precision.MIXED_BFLOAT16
"""

from __future__ import annotations

import difflib
import enum
from typing import Any

from tfdist.errors import ConfigError


class _Choice(str, enum.Enum):
    """A closed set of strings that prints and serialises as its value."""

    def __str__(self) -> str:
        return self.value


class Strategy(_Choice):
    """How training is placed on devices and machines."""

    AUTO = "auto"
    ONE_DEVICE = "one_device"
    MIRRORED = "mirrored"
    MULTI_WORKER = "multi_worker"
    PARAMETER_SERVER = "parameter_server"
    TPU = "tpu"
    HOROVOD = "horovod"


class Precision(_Choice):
    """A Keras dtype policy, or `auto` to choose one from the hardware."""

    FLOAT32 = "float32"
    MIXED_FLOAT16 = "mixed_float16"
    MIXED_BFLOAT16 = "mixed_bfloat16"
    AUTO = "auto"


class CrossDeviceOps(_Choice):
    """How `MirroredStrategy` reduces gradients across its devices."""

    AUTO = "auto"
    NCCL = "nccl"
    HIERARCHICAL_COPY = "hierarchical_copy"
    REDUCE_TO_ONE = "reduce_to_one"


class Communication(_Choice):
    """The collective implementation `MultiWorkerMirroredStrategy` uses across workers."""

    AUTO = "auto"
    RING = "ring"
    NCCL = "nccl"


class AutoShard(_Choice):
    """How a dataset is split across workers (`tf.data.experimental.AutoShardPolicy`)."""

    AUTO = "auto"
    DATA = "data"
    FILE = "file"
    OFF = "off"


class Reduction(_Choice):
    """How Horovod combines gradients across ranks."""

    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"


class Compression(_Choice):
    """How Horovod compresses gradients on the wire."""

    NONE = "none"
    FP16 = "fp16"


class DatasetName(_Choice):
    """The main job's data: real handwritten digits, or synthetic features."""

    DIGITS = "digits"
    SYNTHETIC = "synthetic"


class ZeroStage(enum.IntEnum):
    """How much training state each Horovod rank shards (ZeRO): a number, as DeepSpeed's
    `zero_optimization.stage` is. Prints and serialises as its number."""

    NONE = 0  # Every rank holds all of the optimizer state.
    OPTIMIZER_STATE = 1  # Each rank holds 1/N of it: its variables'.
    GRADIENTS = 2  # Also reduces only its slice of the gradients (reduce-scatter).
    PARAMETERS = 3  # Also stores only its slice of each weight, gathered where it is read.

    def __str__(self) -> str:
        return str(self.value)


# What a number-valued choice must be, for its one-line error.
_NUMBERED: dict[type[enum.IntEnum], str] = {
    ZeroStage: "0, 1, 2 or 3 (0: no sharding; 1: optimizer state; 2: optimizer state and "
               "gradients; 3: optimizer state, gradients and weights)",
}


class OptimizerName(_Choice):
    """The main job's optimizer."""

    ADAM = "adam"
    SGD = "sgd"


# Accepted spellings beyond each member's own value: a closed, small table.
_ALIASES: dict[type[enum.Enum], dict[str, enum.Enum]] = {
    Strategy: {
        "single": Strategy.ONE_DEVICE,
        "mirror": Strategy.MIRRORED,
        "mwms": Strategy.MULTI_WORKER,
        "ps": Strategy.PARAMETER_SERVER,
        "hvd": Strategy.HOROVOD,
    },
    Precision: {
        "fp32": Precision.FLOAT32,
        "32": Precision.FLOAT32,
        "fp16": Precision.MIXED_FLOAT16,
        "16-mixed": Precision.MIXED_FLOAT16,
        "bf16": Precision.MIXED_BFLOAT16,
        "bf16-mixed": Precision.MIXED_BFLOAT16,
    },
}


def choices(enum_cls: type[enum.Enum]) -> str:
    """The values of an enum's members, comma-separated, for messages."""
    return ", ".join(m.value for m in enum_cls)


def parse_numbered(enum_cls: type[enum.IntEnum], value: Any, key: str) -> Any:
    """Resolves a number-valued choice (`ZeroStage`): a member, or its number.

    Args:
        enum_cls: The enum, e.g. `ZeroStage`.
        value: A member, or an integer.
        key: The config key, for the error message.

    Raises:
        ConfigError: not an integer, or a number that names no member.

    Example:

        parse_numbered(ZeroStage, 2, "zero_stage")   # ZeroStage.GRADIENTS
    """
    if isinstance(value, enum_cls):
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{key} must be an integer. Received: {key}={value!r} "
                          f"({type(value).__name__})")
    if value not in {member.value for member in enum_cls}:
        raise ConfigError(f"{key} must be {_NUMBERED[enum_cls]}. Received: {key}={value!r}")
    return enum_cls(value)


def parse_enum(enum_cls: type[enum.Enum], value: Any, key: str) -> Any:
    """Resolves a user's spelling of an enum member: its value, or an alias.

    Args:
        enum_cls: The enum, e.g. `Strategy`.
        value: A member, or a string in any case (`"Mirrored"`, `"bf16"`).
        key: The config key, for the error message.

    Raises:
        ConfigError: the value names no member; the message lists the choices.
    """
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be one of {choices(enum_cls)}; YAML reads unquoted "
                          f"yes/no/on/off as true/false, so quote the value. "
                          f"Received: {key}={value!r}")
    if isinstance(value, str):
        spelled = value.strip().lower()
        for member in enum_cls:
            if member.value == spelled:
                return member
        alias = _ALIASES.get(enum_cls, {}).get(spelled)
        if alias is not None:
            return alias
        names = [m.value for m in enum_cls] + list(_ALIASES.get(enum_cls, {}))
        close = difflib.get_close_matches(spelled, names, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown {key} '{value}'; {hint}choose one of {choices(enum_cls)}. "
                          f"Received: {key}={value!r}")
    raise ConfigError(f"{key} must be a string, one of {choices(enum_cls)}. "
                      f"Received: {key}={value!r} ({type(value).__name__})")
