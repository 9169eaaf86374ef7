# make run  : create .venv, install what is missing, start everything (epd up) on http://127.0.0.1:8000
# make test : create .venv, install what is missing, run the test suite
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
UV_VERSION := 0.13.8
STAMP := $(VENV)/.epd-installed
PYTEST_ARGS ?=

.PHONY: install run test clean-data lock

$(STAMP): requirements.lock pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install --python $(VENV)/bin/python -r requirements.lock
	$(VENV)/bin/uv pip install --python $(VENV)/bin/python --no-deps -e .
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/epd up

test: install
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Re-resolve the pinned tree after changing pyproject.toml dependencies.
lock:
	$(VENV)/bin/uv pip compile --python $(VENV)/bin/python pyproject.toml --extra test -o requirements.lock

clean-data:
	rm -rf var
