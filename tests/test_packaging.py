"""The wheel, installed into a fresh environment outside the repository, trains from a preset."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tfdist.app.launch import task_output
from tests.conftest import REPO, last_json_line, run_command


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A virtual environment holding only the wheel; TensorFlow and the other dependencies
    come from this environment's site-packages, added as a plain path (so this
    environment's editable tfdist is not seen there)."""
    root = tmp_path_factory.mktemp("wheel")
    built = run_command([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w",
                         str(root / "dist"), str(REPO)], cwd=root, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (root / "dist").glob("tfdist-*.whl")
    env = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = run_command([str(python), "-m", "pip", "install", "--no-deps", "--no-index",
                        "--ignore-installed", str(wheel)], cwd=root, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return env / "bin", elsewhere


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
