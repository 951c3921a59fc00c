"""The wheel, installed into a fresh environment outside the repository, trains from a preset."""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tfdist.app.launch import task_output
from tests.conftest import REPO, last_json_line, run_command
from tests.docs_blocks import Run, all_blocks, copy_of_repository, installs, shell_lines

# One worker runs this module: its tests share one wheel, and two builds at once in the
# checkout's build/ folder collide ("File exists: build/bdist.../tfdist-0.1.0.dist-info").
pytestmark = pytest.mark.xdist_group("packaging")


@pytest.fixture(autouse=True)
def without_the_checkout_on_the_path(monkeypatch):
    """The installed wheel is under test here: the checkout that tests/conftest.py puts on
    every process's PYTHONPATH would stand in front of it."""
    monkeypatch.delenv("PYTHONPATH", raising=False)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    built = run_command([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w",
                         str(root / "dist"), str(REPO)], cwd=root, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (found,) = (root / "dist").glob("tfdist-*.whl")
    return found


def empty_environment(env: Path, dependencies) -> Path:
    """A virtual environment at `env` with nothing installed and `dependencies` (a folder)
    on its path; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(f"{dependencies}\n")
    return python


def environment(root, wheel, dependencies):
    """A virtual environment in `root` holding only the wheel, and `dependencies` (a
    folder) on its path; returns its bin folder and an empty folder to run in."""
    env = root / "env"
    python = empty_environment(env, dependencies)
    done = run_command([str(python), "-m", "pip", "install", "--no-deps", "--no-index",
                        "--ignore-installed", str(wheel)], cwd=root, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return env / "bin", elsewhere


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel; TensorFlow and the other dependencies come from this environment's
    site-packages, added as a plain path (so this environment's editable tfdist is not
    seen there)."""
    return environment(tmp_path_factory.mktemp("env"), wheel, sysconfig.get_paths()["purelib"])


@pytest.fixture(scope="module")
def without_tensorflow(wheel, tmp_path_factory):
    """The wheel installed without its extra: every dependency of this environment but
    TensorFlow (and TensorBoard, which comes with it), each linked into one folder."""
    root = tmp_path_factory.mktemp("no_tf")
    dependencies = root / "dependencies"
    dependencies.mkdir()
    for path in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = path.name.lower()
        if not name.startswith(("tensorflow", "tensorboard", "tf_keras", "tfdist",
                                "__editable__")) and path.suffix != ".pth":
            (dependencies / path.name).symlink_to(path)
    return environment(root, wheel, dependencies)


@pytest.mark.multiprocess
def test_the_wheel_holds_the_presets_and_imports_from_itself(installed):
    bin_dir, elsewhere = installed
    shown = run_command([str(bin_dir / "python"), "-c",
                         "import tfdist, tfdist.presets as p; print(tfdist.__file__); "
                         "print(' '.join(p.names()))"], cwd=elsewhere)
    where, names = shown.stdout.splitlines()
    assert where.startswith(str(bin_dir.parent)) and str(REPO) not in where
    assert names.split() == ["auto", "horovod", "mirrored", "multi_worker", "one_device",
                             "parameter_server", "tpu"]
    version = run_command([str(bin_dir / "tfdist"), "--version"], cwd=elsewhere)
    assert version.returncode == 0 and version.stdout.startswith("tfdist ")


@pytest.mark.multiprocess
def test_the_wheel_trains_a_preset_by_name_and_under_its_launcher(installed):
    bin_dir, elsewhere = installed
    tfdist = str(bin_dir / "tfdist")
    alone = run_command([tfdist, "train", "--config", "mirrored", "--set",
                         "mirrored.cpu_replicas=2", "--set", "train.epochs=1"], cwd=elsewhere,
                        timeout=180)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert last_json_line(alone.stdout)["replicas"] == 2
    launched = run_command([tfdist, "launch", "-n", "2", "--", tfdist, "train", "--config",
                            "multi_worker", "--set", "train.epochs=1"], cwd=elsewhere,
                           timeout=180)
    assert launched.returncode == 0, launched.stdout[-3000:]
    assert json.loads(task_output(launched.stdout, "worker:0")[-1])["replicas"] == 2


@pytest.mark.multiprocess
@pytest.mark.refuses
def test_without_its_tensorflow_extra_the_wheel_says_which_to_install(without_tensorflow):
    bin_dir, elsewhere = without_tensorflow
    # A command that works from a clone and from the wheel alike (tfdist is not on PyPI).
    line = ("tfdist: error: TensorFlow is not installed in this environment; install the "
            "release tfdist is built for: pip install 'tensorflow-cpu>=2.21,<2.22' (or "
            "'tensorflow[and-cuda]>=2.21,<2.22' on NVIDIA GPUs)")
    for command in (["train"], ["env"], ["train", "--strategy", "horovod"]):
        result = run_command([str(bin_dir / "tfdist"), *command], cwd=elsewhere)
        assert (result.returncode, result.stderr.splitlines()) == (2, [line]), result.stderr
    python = run_command([str(bin_dir / "python"), "-c",
                          "import tfdist\ntry:\n    tfdist.Runner()\nexcept ModuleNotFoundError "
                          "as error:\n    print(error)"], cwd=elsewhere)
    assert python.stdout.strip() == line.removeprefix("tfdist: error: "), python.stderr[-2000:]
    assert run_command([str(bin_dir / "tfdist"), "--version"], cwd=elsewhere).returncode == 0


@pytest.mark.multiprocess
@pytest.mark.refuses
def test_without_horovod_the_wheel_names_a_script_it_holds(installed):
    bin_dir, elsewhere = installed
    # A None entry in sys.modules makes `import horovod` fail, as when it is not installed.
    code = ("import sys; sys.modules['horovod'] = None; from tfdist.app.cli import main; "
            "main(['tfdist', 'train', '--strategy=horovod'])")
    result = run_command([str(bin_dir / "python"), "-c", code], cwd=elsewhere)
    assert result.returncode == 2
    (line,) = [text for text in result.stderr.splitlines() if text.startswith("tfdist: error:")]
    command = re.search(r"`HOROVOD_PYTHON=(\S+) bash (\S+)`", line)
    assert command, line
    python, script = command.groups()
    assert python == str(bin_dir / "python")
    assert script.startswith(str(bin_dir.parent)) and Path(script).is_file(), script


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", [pytest.param(block, id=block.where)
                                   for block in all_blocks() if installs(block)])
def test_the_install_commands_run_as_written(block, tmp_path):
    # The README's and the install page's blocks, line by line, in a copy of the repository,
    # with an empty environment's bin first on PATH: its `python` is the one they name, and
    # the dependencies pip is told to install are there already (this environment's).
    bin_dir = empty_environment(tmp_path / "env", sysconfig.get_paths()["purelib"]).parent
    folder = copy_of_repository(tmp_path / "clone")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    problems = []
    for line in shell_lines(block.body):
        done = run_command(["bash", "-o", "pipefail", "-c", line], cwd=folder, env=env,
                           timeout=300)
        problems += Run(block.where, line, done.returncode, done.stdout + done.stderr).problems()
    assert problems == []
    assert (tmp_path / "env" / "bin" / "tfdist").is_file()
