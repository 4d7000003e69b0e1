# Thin targets: each creates .venv by itself on a fresh machine (Python 3.11 and make only).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck check bench clean

$(STAMP): setup.cfg pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or make PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[worker,test,daemon,metrics]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/gpud up --demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check gpud broker worker standby libclient tests bench

typecheck: $(STAMP)
	$(BIN)/mypy -p gpud -p gpud_client

check: lint typecheck test

bench: $(STAMP)
	$(BIN)/python bench/dispatch.py

clean:
	rm -rf $(VENV) build *.egg-info
