# Thin targets: each creates .venv by itself on a fresh machine (Python 3.11 and make only).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# `make units`: render systemd/*.in for this installation (make units BINDIR=/opt/gpud/bin).
BINDIR     ?= /usr/bin
SYSCONFDIR ?= /etc
UNITDIR    ?= build/systemd

.PHONY: run test lint typecheck check bench bench-others units clean gpu-check

$(STAMP): setup.cfg pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or make PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[worker,test,daemon,metrics,openstack]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/gpud up --demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check gpud cli broker worker standby libclient tests bench

typecheck: $(STAMP)
	$(BIN)/mypy -p gpud -p gpud_cli -p gpud_client

check: lint typecheck test

bench: $(STAMP)
	$(BIN)/python bench/dispatch.py

# gpud against Ray, dask.distributed and ipyparallel on this machine (bench/others.py), from a venv
# of its own: gpud depends on none of them.
CMP := .venv-compare
$(CMP)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(CMP)
	$(CMP)/bin/pip install -q -e '.[worker]' ray 'dask[distributed]' ipyparallel
	@touch $@

bench-others: $(CMP)/.installed
	$(CMP)/bin/python bench/others.py

# The GPU check, on a GPU machine without network: a venv of its own from the files of ./wheels
# (GPUD_WHEELS; made by scripts/gpu-wheels.sh where there is network), pycuda built there, tests/gpu
# and the remote-vs-local GPU figures (docs/OPERATIONS.md, GPU check). Not needed by `make test`.
gpu-check:
	scripts/gpu-check.sh

units:
	@mkdir -p $(UNITDIR)
	@for f in systemd/*.in; do \
		sed -e 's|@BINDIR@|$(BINDIR)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' "$$f" > "$(UNITDIR)/$$(basename "$$f" .in)" || exit 1; \
	done
	cp systemd/gpud-sysusers.conf systemd/gpud-tmpfiles.conf $(UNITDIR)/
	@echo "units in $(UNITDIR): install *.service in /etc/systemd/system, gpud-sysusers.conf as /usr/lib/sysusers.d/gpud.conf, gpud-tmpfiles.conf as /usr/lib/tmpfiles.d/gpud.conf"

clean:
	rm -rf $(VENV) $(CMP) build *.egg-info
