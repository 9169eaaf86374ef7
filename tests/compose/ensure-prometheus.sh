#!/usr/bin/env bash
# `make test-compose`: a Prometheus binary for tests/compose/check_observability.py (no Prometheus
# image can be pulled here). Debian's package (bookworm: 2.42), unpacked under var/prometheus;
# prints the binary's path. Kept between runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=var/prometheus
BIN=$DEST/usr/bin/prometheus
if [ ! -x "$BIN" ]; then
    if command -v prometheus >/dev/null; then command -v prometheus; exit 0; fi
    mkdir -p "$DEST/deb"
    (cd "$DEST/deb" && { apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq && apt-get download prometheus >/dev/null; }; })
    dpkg -x "$DEST"/deb/prometheus_*.deb "$DEST"
fi
realpath "$BIN"
