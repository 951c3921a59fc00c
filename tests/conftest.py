"""Shared test set-up: two logical CPU devices, clean Keras state, subprocess helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import pytest
import tensorflow as tf

from tfdist.devices import split_cpu

REPO = Path(__file__).resolve().parents[1]
TFDIST = str(Path(sys.executable).with_name("tfdist"))


def pytest_configure(config):
    # TensorFlow fixes its devices when its runtime starts. Splitting the CPU
    # before any test runs lets one_device and 2-replica mirrored tests share a
    # process in any order.
    split_cpu(2)


def pytest_collection_modifyitems(config, items):
    if tf.config.list_physical_devices("GPU"):
        return
    skip = pytest.mark.skip(reason="needs a GPU; none found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_keras_state():
    """Each test starts and ends with Keras's default dtype policy and a fresh session."""
    policy = keras.config.dtype_policy()
    keras.backend.clear_session()
    yield
    keras.config.set_dtype_policy(policy)
    keras.backend.clear_session()


def run_command(args: list[str], *, cwd: Path, env: dict[str, str] | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs a command with this interpreter's environment (plus `env`), capturing text."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def last_json_line(stdout: str) -> dict:
    """The JSON object on the last non-empty line of a command's output."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "the command printed nothing"
    return json.loads(lines[-1])
