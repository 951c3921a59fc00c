#!/usr/bin/env bash
# Builds Horovod 0.28.1 against the TensorFlow in .venv (or HOROVOD_PYTHON's environment) and
# installs it: tfdist/horovod/install_horovod.sh does the work (it ships in the wheel; see
# there why Horovod is built here).
#
#   scripts/install_horovod.sh                                           # into .venv
#   HOROVOD_PYTHON=/path/to/env/bin/python scripts/install_horovod.sh   # another environment
#   HOROVOD_GPU_OPERATIONS=NCCL scripts/install_horovod.sh   # GPU machine with CUDA and NCCL
set -euo pipefail
cd "$(dirname "$0")/.."
HOROVOD_PYTHON="${HOROVOD_PYTHON:-.venv/bin/python}" exec bash tfdist/horovod/install_horovod.sh
