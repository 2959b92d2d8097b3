# `make demo` and `make check` each install what they need when it is missing:
# Debian packages (scripts/install-system-deps) and a project venv made from /usr/bin/python3.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: check demo tour deps system-deps lint typecheck test bench soak stress clean

system-deps:
	@scripts/install-system-deps

$(STAMP): pyproject.toml
	@test -x $(PY) || /usr/bin/python3 -m venv $(VENV)
	@$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	@$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

deps: system-deps $(STAMP)

lint: deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: deps
	$(VENV)/bin/mypy --strict sandboxer

# Two pytest-xdist workers, each running whole modules (a module's fixtures are made once): most
# of a test's time is spent waiting on bwrap, git and Docker, so two overlap well even on two
# cores. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: deps
	@scripts/start-dockerd || echo "Docker is unavailable: the Docker tests will say why they skip"
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile

check: lint typecheck test

demo: deps
	@$(PY) scripts/demo.py

tour: deps
	@$(PY) scripts/tour.py

bench: deps
	$(PY) benchmarks/bench_digest.py
	$(PY) benchmarks/bench_sandbox.py
	$(PY) benchmarks/bench_egress.py
	$(PY) benchmarks/bench_publish.py
	$(PY) benchmarks/bench_watch.py

# 1,000 sequential create -> exec -> teardown cycles (root broker); fails if anything on the host
# grows past its tolerance (docs/soak.md). SOAK_ARGS="--cycles 200 --backend docker" to vary it.
SOAK_ARGS ?=
soak: deps
	$(PY) scripts/soak.py $(SOAK_ARGS)

# 100 sandboxes live at once through a root service with a warm pool: creates, execs and
# teardowns in parallel, four rounds (docs/soak.md); the suite runs a small version of it.
# STRESS_ROUNDS=8 to vary it.
STRESS_ROUNDS ?= 4
stress: deps
	SANDBOXER_STRESS=1 SANDBOXER_STRESS_ROUNDS=$(STRESS_ROUNDS) $(VENV)/bin/pytest tests/integration/test_stress.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .hypothesis *.egg-info
