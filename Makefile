# Two commands set everything up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PLUGINS := $(sort $(wildcard plugins/*))
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline

.PHONY: install demo test test-faults mutations bench docs clean-runs

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml) requirements-minestudio.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, from the CPU build when it is missing, so that nothing pulls CUDA wheels.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q "torch>=2.3" -e ".[crafter,test]" $(foreach p,$(PLUGINS),-e $(p))
	# MineStudio's real simulator and policies for the tests, without its CUDA/GUI dependency set.
	$(PIP) install -q --no-deps -r requirements-minestudio.txt
	touch $(STAMP)

install: $(STAMP)

# A short Crafter run that exercises everything a run writes: checkpoints, videos, report PNGs, wandb.
# The first 4 iterations of examples/crafter.py (~17k env steps) took 68 s on a
# quiet 2-core machine (3 videos); the return is still noisy this early (benchmarks/RESULTS.md, issue 19).
DEMO_OVERRIDES ?= train_config.num_iterations=4 train_config.record_video_interval=1 'logger_config.loggers=[wandb]'

demo: install
	$(VENV)/bin/mineonline run examples/crafter.py $(DEMO_OVERRIDES)

# Most tests wait on Ray start-ups, subprocesses and real runs rather than compute, so four pytest workers
# and three mutation children keep two cores busy (benchmarks/RESULTS.md, issue 36: per-test durations).
PYTEST_WORKERS ?= 4
MUTATION_JOBS ?= 3

test: install
	WANDB_MODE=disabled $(PY) -m pytest -q -m "not slow" -n $(PYTEST_WORKERS) --dist worksteal --durations=40
	$(PY) tests/mutations/run_mutations.py --jobs $(MUTATION_JOBS)

# Reintroduce each known defect (tests/mutations/run_mutations.py) and check the tests catch it.
mutations: install
	$(PY) tests/mutations/run_mutations.py

test-faults: install
	WANDB_MODE=disabled $(PY) -m pytest -q tests/faults

bench: install
	$(PY) benchmarks/run_all.py

docs: install
	$(VENV)/bin/mineonline config docs > docs/configuration.md
	$(VENV)/bin/mineonline plugins --table --output docs/plugins.md
