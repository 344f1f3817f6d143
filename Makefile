# The two commands the README promises: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test check-install lint docs bench reliability slurm-check clean

# Some machines set PYTHONDONTWRITEBYTECODE, which would make every process compile the same modules again.
unexport PYTHONDONTWRITEBYTECODE

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# What the tests' processes import, imported once in one process: Python writes the bytecode of those modules
# here, where otherwise both test workers and the processes they start compile the same ones at once.
define WARM_IMPORTS
import importlib
for name in """torch torch._dynamo torch.distributed.fsdp torch.utils.checkpoint torch._subclasses.fake_tensor
    transformers transformers.models.gpt2.modeling_gpt2 transformers.models.llama.modeling_llama
    transformers.models.vit.modeling_vit transformers.models.t5.modeling_t5 batchfit.cli.app batchfit.cli.find
    batchfit.cli.estimate batchfit.cli.plan batchfit.cli.optimal batchfit.cli.sweep_run batchfit.cli.tokens_run
    batchfit.sweep.jobs matplotlib.pyplot hypothesis jsonschema lightning""".split():
    try:
        importlib.import_module(name)
    except ImportError:  # an extra this machine lacks: nothing to warm
        pass
endef
export WARM_IMPORTS

# torch is pinned to the local CPU wheel first, so the project's `torch>=2.13` installs nothing more. Nothing is
# compiled at install (--no-compile): the tests import a fraction of torch's and transformers' modules, and Python
# writes the bytecode of those on first import (PYTHONDONTWRITEBYTECODE is unset above for that reason), most of
# them in WARM_IMPORTS.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	$(BIN)/pip install --quiet --no-compile -e ".[test,plot,lightning,transformers,mlx,docs]"
	$(BIN)/python -c "$$WARM_IMPORTS"
	touch $(STAMP)

install: $(STAMP)

# The main job on the built-in workload: on a GPU if there is one, else on a simulated device.
demo: $(STAMP)
	$(BIN)/batchfit find gpt-tiny --plot batchfit-demo.png --json batchfit-demo.json

# Lint, format and the import contract (tests/project/test_layout.py) run with the suite: everything CI runs.
# Two pytest-xdist workers, one per core (the tests' models are tiny: one torch thread each).
test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples docs/hooks .ci
	$(BIN)/ruff format --check src tests benchmarks examples docs/hooks .ci
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --quiet --strict --site-dir build/site
	$(BIN)/python -m pytest -n 2 --dist loadgroup -m "not slow and not slurm" src tests

# A real single-node Slurm on this machine (as root; installs Debian's slurm-wlm and munge if missing; docs/slurm.md),
# then the Slurm engine's tests on it (about 55 s from nothing installed). scripts/slurm/stop.sh stops it.
slurm-check: $(STAMP)
	bash scripts/slurm/start.sh
	$(BIN)/python -m pytest -m slurm tests/sweep/test_engine_slurm.py

# The package as a user installs it, in a fresh virtual environment: no extras, the lowest versions admitted,
# then [plot] and [transformers] (about 100 s; CI runs it after `make test`).
check-install:
	.ci/check_install

# The documentation site (docs/, mkdocs.yml), every warning an error; make test builds it too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples docs/hooks .ci
	$(BIN)/ruff format --check src tests benchmarks examples docs/hooks .ci

bench: $(STAMP)
	$(BIN)/python benchmarks/search_strategies.py
	$(BIN)/python benchmarks/trace_cost.py
	$(BIN)/python benchmarks/nn_layers_trace.py
	$(BIN)/python benchmarks/microbatch_overhead.py
	$(BIN)/python benchmarks/sweep_trials.py
	$(BIN)/python benchmarks/peers.py
	$(BIN)/python benchmarks/regimes.py
	$(BIN)/python benchmarks/sharded_peers.py
	$(BIN)/python benchmarks/one_rank.py
	$(BIN)/python benchmarks/offload.py
	$(BIN)/python benchmarks/allocator.py
	$(BIN)/python benchmarks/loop_campaign.py
	$(BIN)/python benchmarks/readme_times.py
	$(BIN)/python benchmarks/gpu_estimates.py
	$(BIN)/python benchmarks/tokens.py
	$(BIN)/python benchmarks/import_time.py
	$(BIN)/python benchmarks/cli_startup.py

# Fault injection, bad inputs and endurance (a reduced form runs in `make test`): benchmarks/RELIABILITY.md;
# an OOM inside FSDP2, the cache against edits, Ctrl-C at seeded sites: benchmarks/FAULTS.md.
reliability: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m slow tests
	$(BIN)/python benchmarks/reliability.py
	$(BIN)/python benchmarks/fault_campaigns.py

# The GPU check (benchmarks/gpu_check.py): on a machine with an NVIDIA GPU, with that machine's python (no .venv),
# under 8 minutes; without a GPU it exits 2 at once. Options: make gpu-check GPU_CHECK_ARGS="--out DIR --budget S".
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
