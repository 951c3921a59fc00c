#!/usr/bin/env bash
# Sets up everything tfdist needs on a fresh machine, and does nothing the second time.
#
#   scripts/setup.sh                 # CPU build of TensorFlow
#   TF_BUILD=gpu scripts/setup.sh    # tensorflow[and-cuda]: CUDA and cuDNN come from pip
#
# The Makefile runs it; `make setup` is the usual way in. Horovod is built by
# scripts/install_horovod.sh (a few minutes the first time on a machine, then cached).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TF_BUILD="${TF_BUILD:-cpu}"
VENV=.venv

case "$TF_BUILD" in
  cpu|gpu) ;;
  *) echo "setup: TF_BUILD must be 'cpu' or 'gpu'. Received: TF_BUILD=$TF_BUILD" >&2; exit 2 ;;
esac

# Open MPI runs the Horovod adapter's processes (mpirun). Installed from the
# distribution's packages, once.
if ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Open MPI (openmpi-bin, libopenmpi-dev) with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  else
    echo "setup: Open MPI not found; install it (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev)." \
         "Everything but the Horovod adapter works without it." >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

echo "setup: installing tfdist[$TF_BUILD,test,docs] into $VENV"
"$VENV/bin/python" -m pip install -q -e ".[$TF_BUILD,test,docs]"

# keras-hub's BERT and GPT-2 are users' models the tests train (public code nobody here
# wrote). Installed without its declared dependencies: it requires tensorflow-text, which
# requires the `tensorflow` distribution and would install a second TensorFlow over
# tensorflow-cpu. Its models import regex and tokenizers, and need nothing else.
echo "setup: installing keras-hub (for the tests) into $VENV"
"$VENV/bin/python" -m pip install -q --no-deps "keras-hub==0.32.0"
"$VENV/bin/python" -m pip install -q "regex>=2023" "tokenizers>=0.19"

# matplotlib draws `make bench`'s plots, and nothing else needs it. Keras imports
# matplotlib.pyplot whenever it can (keras.src.visualization), which costs every process
# that imports TensorFlow about 0.9 s of CPU here; so it goes to a directory of its own
# that only benchmarks/charts.py puts on its path (PLOTTING_DIR there).
PLOTTING="$VENV/plotting"
echo "setup: installing matplotlib into $PLOTTING (for make bench)"
"$VENV/bin/python" -m pip install -q --upgrade --target "$PLOTTING" "matplotlib>=3.8"
if "$VENV/bin/python" -m pip show -q matplotlib >/dev/null 2>&1; then
  # An earlier set-up put it in the environment itself.
  "$VENV/bin/python" -m pip uninstall -q -y matplotlib
fi
"$VENV/bin/python" -c "import tensorflow as tf, keras; print(f'setup: TensorFlow {tf.__version__}, Keras {keras.__version__}')"

# Horovod, built against this TensorFlow (see the script for why); cached after the first
# time. On a GPU machine with the CUDA toolkit and NCCL: HOROVOD_GPU_OPERATIONS=NCCL.
scripts/install_horovod.sh
