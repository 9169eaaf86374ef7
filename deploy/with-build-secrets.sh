#!/bin/sh
# Build-time only (the Dockerfile's builder stage): run "$@" with the package-index settings and CA
# bundle that deploy/docker-build.sh hands the build as BuildKit secrets (RUN --mount=type=secret,
# id=epd-index / id=epd-cacert). The secrets exist only for the duration of that RUN: nothing of
# them reaches a layer. Without them (a plain `docker build` with registry access) pip and uv use
# PyPI and the image's own CA bundle.
set -eu
if [ -s /run/secrets/epd-index ]; then
    # KEY=VALUE lines (PIP_INDEX_URL, UV_INDEX_URL, ...), written by deploy/docker-build.sh.
    set -a
    . /run/secrets/epd-index
    set +a
fi
if [ -s /run/secrets/epd-cacert ]; then
    export SSL_CERT_FILE=/run/secrets/epd-cacert PIP_CERT=/run/secrets/epd-cacert \
        REQUESTS_CA_BUNDLE=/run/secrets/epd-cacert
fi
exec "$@"
