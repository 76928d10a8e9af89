# `make test` and `make demo` work on a fresh machine: they build .venv, install the project
# with its test extras (torch pinned to the CPU build found on these machines) and find or
# install a real redis-server; `make test` also tmux, for the console's end-to-end test, and
# chromium, for the browser view's, and SLURM with munge, for the scheduler tests' own cluster.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
# Two pytest workers, each a whole file at a time (module fixtures run once): the suite is
# mostly waiting on agents, workers and servers, so two fit this 2-core machine's budget.
TEST_WORKERS ?= 2

.PHONY: test demo lint bench screenshots clean redis tools

# pip byte-compiles what it installs one file at a time (half of building .venv here);
# compileall does the same on every core. Its status is not checked: a few packages ship
# files for other Pythons that never compile, which pip skips silently too.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile "$(TORCH_PIN)"
	$(PY) -m pip install -q --no-compile -e ".[test]"
	-$(PY) -m compileall -qq -j 0 $(VENV)/lib >/dev/null
	touch $(STAMP)

# Our own modules, compiled ahead: every agent, console and worker the suite or the demo
# starts imports them, and under PYTHONDONTWRITEBYTECODE (set on this machine) each
# would compile them again (~0.2 s a process; a quarter of the process-heavy tests' time).
# compileall writes regardless and only what changed.
COMPILE := $(PY) -m compileall -qq -j 0 agent console tests examples bench scripts

redis: $(STAMP)
	@bash scripts/ensure-tools.sh $(VENV) redis-server

tools: $(STAMP)
	@bash scripts/ensure-tools.sh $(VENV) redis-server tmux chromium slurm util-linux procps

lint: $(STAMP)
	$(VENV)/bin/ruff check agent console tests bench examples scripts
	$(VENV)/bin/lint-imports

test: tools lint
	$(COMPILE)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

bench: redis
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/rendezvous_bench.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/launch_bench.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/log_view_bench.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/console_bench.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/log_ring_bench.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/reader_bench.py --ranks 4096
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/watchdog_bench.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/odd_rank_runs.py --runs 10
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/redis_memory.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/stacks_bench.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/chaos.py --agents 16 --workers 8 --duration 150 --seed 1

screenshots: redis
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) scripts/screenshots.py

demo: redis
	$(COMPILE)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/demo.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .import_linter_cache
