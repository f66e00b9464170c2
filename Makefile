# `make demo` and `make test` work on a fresh machine with only Python 3.11.
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed-stamp

# Stage commands in dvc.yaml run `python`: make it the venv's. Nothing reaches the Hub.
export PATH := $(BIN):$(PATH)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: install demo test bench clean-demo

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24,<27"
	$(BIN)/python -m pip install --quiet -e '.[demo,dev]'
	touch $(STAMP)

demo: install
	$(BIN)/python -m stages.demo

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python bench/run.py

clean-demo:
	rm -rf data/prompts data/completions data/tokenized data/merged data/base .cache/requests
