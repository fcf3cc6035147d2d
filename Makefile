# Quickstart targets. Both create/reuse a local virtual environment (.venv) with Python 3.12.
PYTHON ?= python3.12
VENV   := .venv
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install -e '.[test]'
	touch $(STAMP)

## Run the CPU quickstart job (tiny model, synthetic data).
demo: $(STAMP)
	$(VENV)/bin/python examples/quickstart.py

## Lint and format-check with ruff, then run the test suite (GPU tests are skipped without CUDA).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest tests

clean-venv:
	rm -rf $(VENV)
