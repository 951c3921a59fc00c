#!/usr/bin/env bash
# Builds Horovod 0.28.1 against the TensorFlow of HOROVOD_PYTHON's environment and installs
# it there; the second time it installs the cached wheel in seconds. It ships inside the
# tfdist package, so an installed wheel has it (the `tfdist` command's error names its path);
# in a checkout, scripts/install_horovod.sh runs it for .venv.
#
#   HOROVOD_PYTHON=/path/to/env/bin/python bash .../tfdist/horovod/install_horovod.sh
#   HOROVOD_GPU_OPERATIONS=NCCL ...                          # GPU machine with CUDA and NCCL
#
# Why a build of our own: 0.28.1 (June 2023) is Horovod's last release, and against
# TensorFlow 2.21 its build fails compiling horovod/tensorflow/xla_mpi_ops.cc
# (xla/printer.h includes highwayhash/arch_specific.h, which TF's wheel does not ship).
# Those XLA ops are off by default (HOROVOD_ENABLE_XLA_OPS), so the one CMake line that
# compiles the file is removed; nothing else changes.
set -euo pipefail

HOROVOD_VERSION=0.28.1
PY="${HOROVOD_PYTHON:?set HOROVOD_PYTHON to the python of the environment to install Horovod into}"
GPU_OPERATIONS="${HOROVOD_GPU_OPERATIONS:-}"

check='import horovod, horovod.tensorflow as hvd, sys
sys.exit(0 if horovod.__version__ == sys.argv[1] and hvd.mpi_built() and hvd.gloo_built() else 1)'
if "$PY" -c "$check" "$HOROVOD_VERSION" 2>/dev/null; then
  exit 0
fi

tf_version=$("$PY" -c "import tensorflow as tf; print(tf.__version__)" 2>/dev/null)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/tfdist/horovod-$HOROVOD_VERSION-tf$tf_version-${GPU_OPERATIONS:-cpu}"
if ! ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
  command -v mpicc >/dev/null || { echo "install_horovod: Open MPI is missing (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 2; }
  command -v cmake >/dev/null || "$PY" -m pip install -q cmake
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "install_horovod: building Horovod $HOROVOD_VERSION against TensorFlow $tf_version (a few minutes)"
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
  tar xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  source_dir="$work/horovod-$HOROVOD_VERSION"
  cmake_file="$source_dir/horovod/tensorflow/CMakeLists.txt"
  [ "$(grep -c 'xla_mpi_ops.cc' "$cmake_file")" = 1 ] || { echo "install_horovod: $cmake_file is not the one this patch expects" >&2; exit 1; }
  sed -i '/horovod\/tensorflow\/xla_mpi_ops.cc/d' "$cmake_file"
  mkdir -p "$cache"
  env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
      HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      ${GPU_OPERATIONS:+HOROVOD_GPU_OPERATIONS=$GPU_OPERATIONS} \
      MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$cache" "$source_dir"
fi
"$PY" -m pip install -q "$cache"/horovod-*.whl
"$PY" -c "$check" "$HOROVOD_VERSION" || { echo "install_horovod: the installed Horovod lacks MPI or Gloo" >&2; exit 1; }
"$PY" -c "import horovod, horovod.tensorflow as hvd; print(f'install_horovod: Horovod {horovod.__version__}: MPI {hvd.mpi_built()}, Gloo {hvd.gloo_built()}, NCCL {bool(hvd.nccl_built())}')" 2>/dev/null
