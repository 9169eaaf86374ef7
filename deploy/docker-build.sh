#!/usr/bin/env bash
# `docker build` with BuildKit and this machine's package-index settings and CA bundle handed to
# the build as secrets (never baked into a layer): the Dockerfile's pip / uv steps read them through
# deploy/with-build-secrets.sh. Use it where the build can reach the package registry only the way
# this host does (a proxy or mirror, a TLS-inspecting gateway with its own CA):
#
#   deploy/docker-build.sh -t epd-serve:0.1.0-cpu .
#   deploy/docker-build.sh --build-arg PYTHON_IMAGE=epd-python:3.11-bookworm-local -t epd-serve:0.1.0-cpu .
#
# Arguments are passed to `docker build` as they are. What is handed in:
#   epd-cacert  BUILD_CA_BUNDLE, else the host's system CA bundle (Debian/Ubuntu or RHEL path)
#   epd-index   the http(s) index settings of the host's pip configuration (`pip config list`:
#               index-url, extra-index-url, trusted-host; PIP_INDEX_URL / PIP_EXTRA_INDEX_URL
#               in the environment win), as PIP_* and UV_* variables. Local paths (file://,
#               find-links folders) are left out: they do not exist inside the build.
# BuildKit is required (for the secrets): a docker CLI with buildx, or a docker CLI older than 23
# (which still has BuildKit built in, e.g. Debian's docker.io 20.10) with DOCKER_BUILDKIT=1.
set -euo pipefail

# A docker CLI that builds with BuildKit.
docker_cli=""
if docker buildx version >/dev/null 2>&1; then
    docker_cli=docker
else
    while read -r candidate; do
        major=$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)
        if [[ "$major" =~ ^[0-9]+$ ]] && [ "$major" -lt 23 ]; then docker_cli=$candidate; break; fi
    done < <(type -ap docker; ls /usr/bin/docker 2>/dev/null || true)
fi
if [ -z "$docker_cli" ]; then
    echo "docker-build: need BuildKit: install the buildx plugin (or Debian's docker.io for its CLI)" >&2
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 700 "$work"
secrets=()

ca=${BUILD_CA_BUNDLE:-}
if [ -z "$ca" ]; then
    for f in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
        if [ -s "$f" ]; then ca=$f; break; fi
    done
fi
if [ -n "$ca" ]; then secrets+=(--secret "id=epd-cacert,src=$ca"); fi

pip_setting() {  # the last value pip's configuration gives KEY (any section), or nothing
    local py
    py=$(command -v python3 || true)
    [ -n "$py" ] || return 0
    "$py" -m pip config list 2>/dev/null | sed -n -E "s/^[a-z:._-]*\\.$1='(.*)'\$/\\1/p" | tail -n 1 || true
}
http_only() { tr ' ' '\n' | grep -E '^https?://' | tr '\n' ' ' | sed 's/ $//' || true; }
index=${PIP_INDEX_URL:-$(pip_setting index-url)}
index=$(http_only <<<"$index")
extra=${PIP_EXTRA_INDEX_URL:-$(pip_setting extra-index-url)}
extra=$(http_only <<<"$extra")
trusted=${PIP_TRUSTED_HOST:-$(pip_setting trusted-host)}
assign() {  # NAME='VALUE' for POSIX sh (the build sources it with /bin/sh)
    local q="'\\''"
    printf "%s='%s'\n" "$1" "${2//\'/$q}"
}
{
    if [ -n "$index" ]; then assign PIP_INDEX_URL "$index"; assign UV_INDEX_URL "$index"; fi
    if [ -n "$extra" ]; then assign PIP_EXTRA_INDEX_URL "$extra"; assign UV_EXTRA_INDEX_URL "$extra"; fi
    if [ -n "$trusted" ]; then assign PIP_TRUSTED_HOST "$trusted"; assign UV_INSECURE_HOST "$trusted"; fi
} >"$work/index.env"
secrets+=(--secret "id=epd-index,src=$work/index.env")

DOCKER_BUILDKIT=1 "$docker_cli" build "${secrets[@]}" "$@"
