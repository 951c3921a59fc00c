"""absl flags onto the config: precedence defaults < file < --set < named flags."""

import pytest
from absl import flags
from absl.testing import flagsaver

from tfdist import flags as tfdist_flags
from tfdist.config import Precision, Strategy
from tfdist.errors import ConfigError
from tfdist.runner import Runner

FLAGS = flags.FLAGS


def parse(*args):
    FLAGS.unparse_flags()
    FLAGS(["prog", *args])
    return tfdist_flags.config_from_flags()


@flagsaver.flagsaver
def test_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("strategy: one_device\nprecision: float32\nseed: 1\ntrain:\n  epochs: 9\n")
    config = parse(f"--config={path}", "--set", "seed=2", "--set", "strategy=tpu",
                   "--strategy=mirrored", "--precision=bf16")
    assert config.strategy is Strategy.MIRRORED        # named flag beats --set and the file
    assert config.precision is Precision.MIXED_BFLOAT16
    assert config.seed == 2                            # --set beats the file
    assert config.train.epochs == 9                    # the file beats the default


@flagsaver.flagsaver
def test_set_values_are_read_as_yaml():
    config = parse("--set", "one_device.device=/cpu:0", "--set", "mirrored.devices=[/cpu:0]",
                   "--set", "train.learning_rate=0.5", "--set", "tpu.name=my-tpu",
                   "--set", "train.epochs=3")
    assert config.one_device.device == "/cpu:0"
    assert config.train.epochs == 3
    assert config.mirrored.devices == ("/cpu:0",)
    assert config.train.learning_rate == 0.5
    assert config.tpu.name == "my-tpu"


@flagsaver.flagsaver
def test_accumulation_steps_flag():
    assert parse("--accumulation_steps=1").accumulation_steps == 1
    with pytest.raises(ConfigError, match="accumulation_steps must be an integer >= 1"):
        parse("--accumulation_steps=0")


@flagsaver.flagsaver
def test_malformed_set():
    with pytest.raises(ConfigError, match="--set expects KEY=VALUE"):
        parse("--set", "epochs")


@flagsaver.flagsaver
def test_runner_from_flags():
    parse("--strategy=mirrored", "--set", "mirrored.cpu_replicas=2")
    runner = Runner.from_flags()
    assert runner.num_replicas == 2
    assert runner.strategy_name is Strategy.MIRRORED
