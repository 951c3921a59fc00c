"""The registry: lazy built-ins, strict registration, clear errors."""

import pytest

from tfdist import registry
from tfdist.adapters.base import Adapter
from tfdist.adapters.mirrored import MirroredAdapter
from tfdist.config import Strategy
from tfdist.errors import ConfigError


def test_builtin_lookup():
    assert registry.get("mirrored") is MirroredAdapter
    assert issubclass(registry.get(Strategy.ONE_DEVICE), Adapter)
    assert registry.available() == ["one_device", "mirrored", "multi_worker", "tpu", "horovod"]


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="choose one of auto, one_device, mirrored"):
        registry.get("mirroredd")


def test_strategies_without_an_adapter_say_so():
    with pytest.raises(ConfigError, match="'parameter_server' is not available yet.*one_device, "
                                          "mirrored, multi_worker, tpu, horovod"):
        registry.get("parameter_server")


def test_registering_a_taken_name_needs_override():
    class CustomMirrored(MirroredAdapter):
        pass

    with pytest.raises(ValueError, match="override=True"):
        registry.register("mirrored", CustomMirrored)
    registry.register("mirrored", CustomMirrored, override=True)
    try:
        assert registry.get("mirrored") is CustomMirrored
    finally:
        registry._registered.clear()
    assert registry.get("mirrored") is MirroredAdapter


def test_auto_cannot_be_registered():
    with pytest.raises(ValueError, match="auto"):
        registry.register("auto", MirroredAdapter, override=True)
