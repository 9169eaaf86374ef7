#!/usr/bin/env bash
# `make test-compose`, step 2: every image the compose test runs, built here without an image
# registry, and how long each build took. Build output goes to var/compose-test/build-*.log
# (its tail is printed when a build fails). Docker's build cache makes a rebuild of unchanged
# images take seconds.
#   epd-python:3.11-bookworm-local   deploy/build-local-base.sh (kept if it exists)
#   epd-serve:<version>-cpu          the Dockerfile's cpu target on that base (deploy/docker-build.sh)
#   epd-test/nats, epd-test/seaweedfs-s3   the stand-ins of tests/compose/Dockerfile
set -euo pipefail
cd "$(dirname "$0")/../.."

base=${EPD_TEST_BASE_IMAGE:-epd-python:3.11-bookworm-local}
version=$(sed -n -E 's/^version = "([^"]+)"/\1/p' pyproject.toml | head -n 1)
logs=var/compose-test
mkdir -p "$logs"

step() {  # step NAME LIMIT_S COMMAND...: run it niced and bounded, its output in the log
    local name=$1 limit=$2 t0=$SECONDS log="$logs/build-$1.log"
    shift 2
    echo "build-images: $name ..."
    if ! timeout "$limit" nice -n 10 "$@" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "build-images: $name FAILED after $((SECONDS - t0)) s (log: $log)" >&2
        exit 1
    fi
    echo "build-images: $name took $((SECONDS - t0)) s"
}

images=("epd-serve:$version-cpu" epd-test/nats:2.15.1 epd-test/seaweedfs-s3:4.48)
before=$(docker image inspect -f '{{.Id}}' "${images[@]}" 2>/dev/null || true)

step base 1200 deploy/build-local-base.sh "$base"
step epd-serve 2400 deploy/docker-build.sh --progress=plain --build-arg "PYTHON_IMAGE=$base" --target cpu \
    -t "epd-serve:$version-cpu" .
step nats 900 deploy/docker-build.sh --progress=plain --build-arg "BASE_IMAGE=$base" --target nats \
    -t epd-test/nats:2.15.1 tests/compose
step s3 900 deploy/docker-build.sh --progress=plain --build-arg "BASE_IMAGE=$base" --target s3 \
    -t epd-test/seaweedfs-s3:4.48 tests/compose

# A rebuild leaves the image a tag named before untagged (7 GB for epd-serve), and the build cache
# grows with every changed layer: CI's disk once filled to 4 GB free, and NATS's default JetStream
# limit (75% of the free disk) then refused the streams. The images these tags named before go
# (unless a container still uses one), and the build cache is capped (EPD_TEST_BUILD_CACHE).
now=$(docker image inspect -f '{{.Id}}' "${images[@]}")
for id in $before; do
    if ! grep -qx "$id" <<<"$now"; then
        docker rmi "$id" >/dev/null 2>&1 && echo "build-images: removed the replaced image ${id:7:12}" || true
    fi
done
docker builder prune -f --keep-storage "${EPD_TEST_BUILD_CACHE:-12GB}" >/dev/null 2>&1 || true
