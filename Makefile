# The README's commands. `make demo` and `make test` set up whatever is missing first.
PYTHON ?= python3
TF_BUILD ?= cpu
VENV := .venv
BIN := $(VENV)/bin
# The stamp is newer than the files that define the set-up, so a second `make` skips it.
STAMP := $(VENV)/.setup-$(TF_BUILD)
# A machine without GPUs mirrors across 2 logical CPU devices; on GPUs: make demo DEMO_FLAGS=
DEMO_FLAGS ?= --set mirrored.cpu_replicas=2

# make test-compat KERAS=3.x: the suite against another Keras release, put ahead of the
# installed one on PYTHONPATH (processes the tests start inherit it). PYTEST_ARGS narrows it.
KERAS ?=
PYTEST_ARGS ?=
COMPAT := .compat/keras-$(KERAS)

.PHONY: setup demo lint docs test test-all test-fast test-compat refusals mutants bench bench-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh scripts/install_horovod.sh tfdist/horovod/install_horovod.sh
	PYTHON=$(PYTHON) TF_BUILD=$(TF_BUILD) scripts/setup.sh
	touch $@

demo: setup
	$(BIN)/tfdist train --config mirrored $(DEMO_FLAGS)

# Style (flake8, configured in setup.cfg) over everything Python in the repository.
lint: setup
	$(BIN)/python -m flake8 tfdist tests benchmarks examples scripts docs

# The docs site (mkdocs.yml), into site/. --strict: a broken link or anchor, a page missing
# from the nav, or a docstring the API reference cannot read fails the build.
# NO_MKDOCS_2_WARNING: Material's notice about MkDocs 2, printed on every build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# The tiers (docs/develop/tests.md). The unit tier starts no process and trains nothing for
# long; the first tier adds one real multi-process run of each strategy and technique
# (tests/tiers.py). A missing mpirun or Horovod fails rather than skips (--require-all).
UNIT_TIER := not multiprocess and not slow and not benchmark
FIRST_TIER := (first_tier or ($(UNIT_TIER))) and not serial
# Each test's CPU seconds and the processes it started (tests/costs.py); the run ends with
# their summary. make test-all's parts append to one report.
COSTS := .test-costs.jsonl
# TEST_WORKERS tests at a time (pytest-xdist; a module whose tests share runs stays on one
# worker).
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest --require-all --cpu-report=$(COSTS)

# The README's test command: lint, the docs site, the unit and the first tier (under 20
# minutes from a fresh clone on 2 cores, set-up included).
test: setup lint docs
	rm -f $(COSTS)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "$(FIRST_TIER)"

# Every test, as CI runs it (.ci/run): lint, the docs site, every test but the few that
# assert how long something took, then those alone.
test-all: setup lint docs
	rm -f $(COSTS)
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not serial"
	$(PYTEST) -m serial

# Which of tfdist's refusals of bad input (a ConfigError raised, an exit with status 2) the
# tests reach: every test that starts no process and the multi-process tests marked
# `refuses`, under coverage.py in every process they start; lists each refusal no test
# reached, and fails if there is one (tests/refusals.py). About 10 minutes on 2 cores.
refusals: setup
	rm -f .coverage .coverage.*
	COVERAGE_FILE=$(CURDIR)/.coverage COVERAGE_PROCESS_START=$(CURDIR)/setup.cfg \
	  $(BIN)/python -m coverage run -m pytest --require-all -n $(TEST_WORKERS) --dist loadgroup \
	  -m "(not multiprocess and not benchmark or refuses) and not serial"
	$(BIN)/python -m coverage combine -q
	$(BIN)/python -m tests.refusals .coverage

# The unit tier: no process started, nothing trained for long (under 2 minutes).
test-fast: setup
	$(BIN)/python -m pytest -m "$(UNIT_TIER)"

test-compat: setup
	@test -n "$(KERAS)" || { echo "usage: make test-compat KERAS=3.x [PYTEST_ARGS=...]" >&2; exit 2; }
	$(BIN)/python -m pip install -q --no-deps --target $(COMPAT) "keras==$(KERAS)"
	PYTHONPATH=$(CURDIR)/$(COMPAT) $(BIN)/python -m pytest $(PYTEST_ARGS)

# Every benchmark (each under 5 minutes), then benchmarks/RESULTS.md, its plots and the
# README's table, written from their results (benchmarks/results/*.json).
# Deliberate bugs (scripts/mutants.py), each applied alone to a copy of the repository,
# against the tests that should see it; every one must be caught. Before a release, not
# in CI (about 17 minutes on 2 cores). MUTANTS_ARGS: e.g. --only adasum_averaged, or --list.
MUTANTS_ARGS ?=
mutants: setup
	$(BIN)/python scripts/mutants.py $(MUTANTS_ARGS)

bench: setup
	$(BIN)/python benchmarks/report.py

# On a GPU machine (make setup TF_BUILD=gpu): ResNet-50 images/s, added to RESULTS.md.
bench-gpu: setup
	$(BIN)/python benchmarks/report.py --only gpu

clean:
	rm -rf $(VENV) .compat tfdist_output benchmarks/results/*.log .pytest_cache site $(COSTS) .coverage .coverage.*
