"""Config loading: precedence, strictness, resolution of spellings, round trips."""

import dataclasses

import pytest
import yaml

from tfdist.config import (Config, CrossDeviceOps, Precision, Strategy, config_keys,
                           field_help, load_config)
from tfdist import presets
from tfdist.errors import ConfigError


def test_defaults():
    config = load_config()
    assert config.strategy is Strategy.AUTO
    assert config.precision is None
    assert config.accumulation_steps == 1
    assert config.mirrored.cpu_replicas == 0
    assert config.seed is None


def test_precedence_defaults_then_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("strategy: one_device\nseed: 3\nmirrored:\n  cpu_replicas: 2\n"
                    "train:\n  epochs: 7\n")
    config = load_config(path, overrides={"seed": 4, "mirrored.cpu_replicas": 3})
    assert config.strategy is Strategy.ONE_DEVICE  # from the file
    assert config.train.epochs == 7                # from the file
    assert config.seed == 4                        # override wins over the file
    assert config.mirrored.cpu_replicas == 3       # dotted override reaches a nested field
    assert config.train.global_batch_size == 64    # default kept


def test_override_can_name_a_whole_section_and_merges_into_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("mirrored:\n  cross_device_ops: reduce_to_one\n")
    config = load_config(path, overrides={"mirrored": {"cpu_replicas": 2}})
    assert config.mirrored.cross_device_ops is CrossDeviceOps.REDUCE_TO_ONE
    assert config.mirrored.cpu_replicas == 2


@pytest.mark.parametrize("spelling, expected", [
    ("mirrored", Strategy.MIRRORED), ("Mirrored", Strategy.MIRRORED),
    ("mirror", Strategy.MIRRORED), ("ps", Strategy.PARAMETER_SERVER),
    ("hvd", Strategy.HOROVOD), (Strategy.TPU, Strategy.TPU),
])
def test_strategy_spellings(spelling, expected):
    assert load_config(overrides={"strategy": spelling}).strategy is expected


@pytest.mark.parametrize("spelling, expected", [
    ("bf16", Precision.MIXED_BFLOAT16), ("bf16-mixed", Precision.MIXED_BFLOAT16),
    ("fp16", Precision.MIXED_FLOAT16), ("16-mixed", Precision.MIXED_FLOAT16),
    ("fp32", Precision.FLOAT32), ("32", Precision.FLOAT32), ("AUTO", Precision.AUTO),
])
def test_precision_aliases(spelling, expected):
    assert load_config(overrides={"precision": spelling}).precision is expected


def test_direct_construction_is_coerced_and_validated():
    config = Config(strategy="mirrored", mirrored={"cpu_replicas": 2})
    assert config.strategy is Strategy.MIRRORED
    assert config.mirrored.cpu_replicas == 2
    with pytest.raises(ConfigError, match="accumulation_steps"):
        dataclasses.replace(config, accumulation_steps=0)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_config().strategy = Strategy.TPU


def test_yaml_round_trip():
    config = load_config(overrides={"strategy": "mirrored", "precision": "bf16",
                                    "mirrored.devices": ["/gpu:0", "/gpu:1"], "seed": 5})
    assert load_config(overrides=yaml.safe_load(config.to_yaml())) == config


@pytest.mark.parametrize("preset", presets.names())
def test_every_preset_loads_by_name_from_any_folder(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(preset)
    assert config.strategy.value == preset
    assert load_config(presets.path(preset)) == config


def test_one_preset_per_strategy():
    assert set(presets.names()) == {s.value for s in Strategy}


def test_a_file_here_wins_over_a_preset_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mirrored").write_text("strategy: one_device\n")
    assert load_config("mirrored").strategy is Strategy.ONE_DEVICE
    with pytest.raises(ConfigError, match=r"^config file not found: mirrorred; pass the path "
                       r"of a YAML file or a preset's name \(auto, horovod, mirrored, "):
        load_config("mirrorred")


@pytest.mark.parametrize("typed, expected", [("1e-3", 0.001), ("2.5E+4", 25000.0), (".5", 0.5),
                                             ("3", 3.0)])
def test_a_number_in_exponent_form_is_a_number_as_people_type_it(typed, expected):
    assert yaml.safe_load("1e-3") == "1e-3"  # YAML 1.1: a string without a dot
    assert load_config(overrides={"train.learning_rate": typed}).train.learning_rate == expected


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), ".inf"])
def test_a_number_that_is_not_finite_is_one_line(value):
    value = yaml.safe_load(value) if isinstance(value, str) else value
    with pytest.raises(ConfigError, match=r"^train.learning_rate must be a finite number. "
                                          r"Received: train.learning_rate=(inf|-inf|nan)$"):
        load_config(overrides={"train.learning_rate": value})


def test_unknown_key_suggests_the_closest_across_sections():
    with pytest.raises(ConfigError, match="did you mean 'train.epochs'"):
        load_config(overrides={"epochs": 3})


def test_int_fields_reject_bools_and_floats():
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config(overrides={"accumulation_steps": True})
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config(overrides={"train.epochs": 2.5})


def test_float_fields_accept_ints():
    assert load_config(overrides={"train.learning_rate": 1}).train.learning_rate == 1.0


def test_empty_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == load_config()


def test_every_key_has_help():
    for key in config_keys():
        assert field_help(key), key


def test_gradient_grouping_options():
    config = load_config(overrides={"multi_worker.bytes_per_pack": 25 << 20,
                                    "horovod.grouped": True})
    assert (config.multi_worker.bytes_per_pack, config.horovod.grouped) == (25 << 20, True)
    assert (Config().multi_worker.bytes_per_pack, Config().horovod.grouped) == (0, False)
    with pytest.raises(ConfigError, match="multi_worker.bytes_per_pack"):
        load_config(overrides={"multi_worker.bytes_per_pack": -1})


@pytest.mark.parametrize("call, message", [
    (lambda: load_config(overrides="strategy=mirrored"),
     "load_config's overrides must be a mapping of keys to values, such as {\"strategy\": "
     "\"mirrored\", \"train.epochs\": 2}. Received: str 'strategy=mirrored'"),
    (lambda: load_config({"strategy": "mirrored"}),
     "load_config's first argument is a file or a preset's name; pass values as overrides: "
     "load_config(overrides={...}). Received: {'strategy': 'mirrored'}"),
    (lambda: load_config(3), "load_config's path must be a file path or a preset's name. "
                             "Received: int"),
], ids=["overrides_as_a_string", "overrides_as_the_path", "a_number_as_the_path"])
def test_arguments_of_the_wrong_kind_are_one_line(call, message):
    with pytest.raises(ConfigError) as raised:
        call()
    assert str(raised.value) == message


def test_several_mistakes_are_reported_together_a_line_each(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("strategy: mirorred\naccumulation_steps: 0\ntrain:\n  epochz: 3\n"
                    "mirrored:\n  cpu_replicas: two\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    lines = str(raised.value).splitlines()
    assert raised.value.problems == lines
    assert [line.split(";")[0].split(" must")[0] for line in lines] == [
        "unknown strategy 'mirorred'", "mirrored.cpu_replicas", "unknown config key 'train.epochz'",
        "accumulation_steps"]
    assert all("Received: " in line for line in lines)
