"""absl flags onto the config: precedence defaults < file < --set < named flags."""

import sys

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


def test_from_flags_on_flags_without_tfdists_names_the_import():
    bare = flags.FlagValues()
    bare(["prog"])
    with pytest.raises(ConfigError, match=r"^Runner.from_flags\(\) reads tfdist's absl flags, "
                                          r"which `from tfdist import flags` defines: .*"
                                          r"Received: no tfdist flags defined$"):
        Runner.from_flags(bare)
    unparsed = flags.FlagValues()
    flags.DEFINE_string("strategy", None, "", flag_values=unparsed)
    with pytest.raises(ConfigError, match="Received: flags not parsed yet$"):
        Runner.from_flags(unparsed)


ABSL_SCRIPT = """
from absl import app, flags
import tfdist
{import_line}

def main(argv):
    tfdist.Runner.from_flags()

if __name__ == "__main__":
    {run}(main)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("import_line, run, status, said", [
    # The documented pattern: bad input is one line and exit status 2.
    ("from tfdist import flags as tfdist_flags", "tfdist_flags.run", 2,
     "script.py: error: unknown strategy 'mirorred'; did you mean 'mirrored'?"),
    # Without the import absl does not know --strategy: its own parsing error (and a hint).
    ("", "app.run", 1, "FATAL Flags parsing error: Unknown command line flag 'strategy'"),
], ids=["tfdist_flags_run", "no_import"])
def test_an_absl_script_with_a_typo_gets_one_line(tmp_path, import_line, run, status, said):
    from tests.conftest import run_command

    script = tmp_path / "script.py"
    script.write_text(ABSL_SCRIPT.format(import_line=import_line, run=run))
    result = run_command([sys.executable, str(script), "--strategy=mirorred"], cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines()
             if line.strip() and not line.startswith("Pass --helpshort")]
    assert result.returncode == status, result.stderr[-2000:]
    assert lines[-1].startswith(said), lines[-3:]
    assert "Traceback" not in result.stderr
