# The README's commands. `make demo` and `make test` set up whatever is missing first.
PYTHON ?= python3
TF_BUILD ?= cpu
VENV := .venv
BIN := $(VENV)/bin
# The stamp is newer than the files that define the set-up, so a second `make` skips it.
STAMP := $(VENV)/.setup-$(TF_BUILD)
# A machine without GPUs mirrors across 2 logical CPU devices; on GPUs: make demo DEMO_FLAGS=
DEMO_FLAGS ?= --set mirrored.cpu_replicas=2

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh scripts/install_horovod.sh
	PYTHON=$(PYTHON) TF_BUILD=$(TF_BUILD) scripts/setup.sh
	touch $@

demo: setup
	$(BIN)/tfdist train --config strategies/mirrored.yaml $(DEMO_FLAGS)

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/precision.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/allreduce.py
	$(BIN)/python benchmarks/accumulation.py
	$(BIN)/python benchmarks/parameter_server.py
	$(BIN)/python benchmarks/checkpoint.py

clean:
	rm -rf $(VENV) tfdist_output benchmarks/results .pytest_cache
