# The two set-up commands (see README.md):
#   make demo   build a model repository, serve it with the real embedded tritonserver, query it
#   make test   lint (ruff), type-check (pyright) and run the test suite (the docs site is built by a test)
#   make unit   the unit tests only (tests/unit: no server, no export; seconds), for every change
# Both create/refresh the virtual environment first (scripts/setup.sh: installs requirements/lock.txt,
# every package at an exact version with hashes; quick when up to date).
#   make lock   refresh requirements/lock.txt from requirements/runtime.txt + constraints.txt
#               (scripts/lock.sh; LOCK_ARGS=--upgrade moves every package to its newest allowed version)

VENV ?= .venv
# pytest-xdist workers for `make test`; each test module stays on one worker (--dist loadfile), so
# its one tritonserver and its module fixtures are made once. On a 2-core host, two took 17 min for a
# fresh clone's make test and three 14 min at first; of five runs on three, one had a samplings model
# that never finished loading (not understood; a start that times out now says what each stub is
# doing), one a worker hung in fork() (fixed: servers start without a preexec_fn) and one a request
# count read too early (fixed), and with today's suite three took 15.6 min of pytest: two it is.
# Again on 2026-11-27, a fresh clone on a quiet 2-core host: two 18.2 min in all (pytest 1080 s, 24.1 min
# of CPU), three 16.6 min (pytest 979 s, 28.0 min of CPU): 9% faster for 16% more CPU, not worth the risk.
# --no-loadscope-reorder: the modules go out in collection order, which tests/conftest.py makes
# longest first (xdist's own order, by number of tests, left slow few-test modules for the end).
PYTEST_WORKERS ?= 2
PYTHON := $(VENV)/bin/python

.PHONY: setup demo test pytest unit lint doctor lock

setup:
	bash scripts/setup.sh

lock:
	bash scripts/lock.sh $(LOCK_ARGS)

demo: setup
	$(PYTHON) scripts/demo.py

# lint runs beside the suite (-j2; pytest prints as it goes): pyright is single-threaded, and the suite leaves
# the cores idle part of the time (servers starting and stopping). Either failing fails make test.
test: setup
	@$(MAKE) --no-print-directory -j2 lint pytest

pytest: setup
	$(PYTHON) -m pytest -ra -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

unit: setup
	$(PYTHON) -m pytest -q tests/unit $(PYTEST_ARGS)

# ruff (pyflakes, pycodestyle, import order, bugbear, pyupgrade) and pyright (basic mode) over the
# package and its tests; their settings are in pyproject.toml.
lint: setup
	$(VENV)/bin/ruff check bionemo_export tests benchmarks scripts docs
	$(VENV)/bin/pyright --pythonpath $(PYTHON)

doctor: setup
	$(VENV)/bin/bionemo-export doctor
