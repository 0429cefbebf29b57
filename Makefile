# The two set-up commands (see README.md):
#   make demo   build a model repository, serve it with the real embedded tritonserver, query it
#   make test   run the test suite
# Both create/refresh the virtual environment first (scripts/setup.sh; quick when up to date).

VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: setup demo test doctor

setup:
	bash scripts/setup.sh

demo: setup
	$(PYTHON) scripts/demo.py

test: setup
	$(PYTHON) -m pytest -ra $(PYTEST_ARGS)

doctor: setup
	$(VENV)/bin/bionemo-export doctor
