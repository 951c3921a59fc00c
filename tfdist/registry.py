"""Strategy name to adapter class.

Built-in adapters are listed by import path and imported on first use, so
`import tfdist` loads no adapter (and none of Horovod). `register` adds or
replaces one; taking a name that is already taken needs `override=True`.

Example:

    adapter_cls = registry.get(Strategy.MIRRORED)
    registry.register(Strategy.MIRRORED, MyMirroredAdapter, override=True)
"""

from __future__ import annotations

import importlib

from tfdist.config import Strategy, parse_enum
from tfdist.errors import ConfigError

_BUILTIN: dict[Strategy, str] = {
    Strategy.ONE_DEVICE: "tfdist.adapters.one_device:OneDeviceAdapter",
    Strategy.MIRRORED: "tfdist.adapters.mirrored:MirroredAdapter",
    Strategy.MULTI_WORKER: "tfdist.adapters.multi_worker:MultiWorkerAdapter",
    Strategy.PARAMETER_SERVER: "tfdist.adapters.parameter_server:ParameterServerAdapter",
    Strategy.TPU: "tfdist.adapters.tpu:TPUAdapter",
    Strategy.HOROVOD: "tfdist.adapters.horovod:HorovodAdapter",
}
_registered: dict[Strategy, type] = {}


def register(name: Strategy | str, adapter_cls: type, *, override: bool = False) -> None:
    """Makes `adapter_cls` the adapter for a strategy name.

    Args:
        name: A `Strategy` or its string value.
        adapter_cls: A subclass of `tfdist.adapters.base.Adapter`.
        override: Replace an adapter already registered or built in.

    Raises:
        ValueError: the name is taken and `override` is False.
    """
    strategy = parse_enum(Strategy, name, "strategy")
    if strategy is Strategy.AUTO:
        raise ValueError("'auto' chooses among adapters and cannot have one of its own")
    if not override and (strategy in _registered or strategy in _BUILTIN):
        raise ValueError(f"strategy '{strategy}' already has an adapter; pass override=True "
                         f"to replace it")
    _registered[strategy] = adapter_cls


def get(name: Strategy | str) -> type:
    """Returns the adapter class for a concrete strategy name.

    Raises:
        ConfigError: the name is unknown (the message lists the known ones), or is
            `auto`, which names a choice rather than an adapter.
    """
    strategy = parse_enum(Strategy, name, "strategy")
    if strategy is Strategy.AUTO:
        raise ConfigError("strategy 'auto' has no adapter of its own: the Runner chooses one "
                          f"of {', '.join(available())}. Received: strategy=auto")
    if strategy in _registered:
        return _registered[strategy]
    module_name, class_name = _BUILTIN[strategy].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def available() -> list[str]:
    """Names of the strategies that have an adapter, in declaration order."""
    return [s.value for s in Strategy if s in _BUILTIN or s in _registered]
