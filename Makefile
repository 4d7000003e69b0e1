# Thin targets: each creates .venv by itself on a fresh machine (Python 3.11 and make only).
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NOVA   := .venv-nova

# `make units`: render systemd/*.in for this installation (make units BINDIR=/opt/gpud/bin).
BINDIR     ?= /usr/bin
SYSCONFDIR ?= /etc
UNITDIR    ?= build/systemd

.PHONY: run test lint typecheck check bench bench-others units clean gpu-check debian-packages

$(STAMP): setup.cfg pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or make PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[worker,test,daemon,metrics,openstack]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/gpud up --demo

test: $(STAMP) $(NOVA)/.installed debian-packages
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check gpud cli broker worker standby libclient tests bench

typecheck: $(STAMP)
	$(BIN)/mypy -p gpud -p gpud_cli -p gpud_client -p gpud_broker -p gpud_worker -p gpud_standby

check: lint typecheck test

bench: $(STAMP)
	$(BIN)/python bench/dispatch.py

# Real Nova, placement and Keystone for tests/integration/test_openstack*.py (tests/realnova), from a
# venv of their own: gpud depends on none of them. About a minute and 450 MB the first time.
# The stamp is a copy of the requirements: a checkout that only touched the file reinstalls nothing.
$(NOVA)/.installed: tests/realnova/requirements.txt
	@if cmp -s $< $@; then touch $@; else \
		set -e; rm -rf $(NOVA); $(PYTHON) -m venv $(NOVA); \
		echo "$(NOVA)/bin/pip install -q -r $<"; $(NOVA)/bin/pip install -q -r $<; cp $< $@; \
	fi

# Debian packages the tests run for real: systemd (booted in a namespace by test_systemd.py) and
# mariadb-server (Nova's databases). Installed with apt-get where missing (as root); a quick check
# when they are there.
DEBIAN_PACKAGES := systemd mariadb-server
debian-packages:
	@missing=$$(for p in $(DEBIAN_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed$$' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then echo "not root: cannot install $$missing (the tests that need them skip)"; exit 0; fi; \
		echo "apt-get install $$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

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
	rm -rf $(VENV) $(CMP) $(NOVA) build *.egg-info
