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
    assert registry.available() == ["one_device", "mirrored", "multi_worker", "parameter_server",
                                    "tpu", "horovod"]


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="choose one of auto, one_device, mirrored"):
        registry.get("mirroredd")


def test_auto_is_a_choice_not_an_adapter():
    with pytest.raises(ConfigError, match="'auto' has no adapter of its own"):
        registry.get("auto")


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
