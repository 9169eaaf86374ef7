#!/usr/bin/env bash
# Build a Debian bookworm + Python 3.11 base image from Debian's packages alone, for machines that
# reach no image registry (air-gapped sites, this project's CI). It stands in for the Dockerfile's
# default PYTHON_IMAGE (python:3.11.N-slim-bookworm) where that image cannot be pulled:
#
#   deploy/build-local-base.sh                      # -> image epd-python:3.11-bookworm-local
#   DOCKER_BUILDKIT=1 docker build --build-arg PYTHON_IMAGE=epd-python:3.11-bookworm-local \
#       --secret id=cacert,src=/etc/ssl/certs/ca-certificates.crt --secret id=pipconf,src=PIP.CONF \
#       -t epd-serve:0.1.0-cpu .                    # deploy/build-images.sh does this for you
#
# What the image offers is what the Dockerfile relies on from python:3.11-slim: python3.11, pip
# (usable: no PEP 668 marker) and venv under /usr/local/bin, apt-get, ca-certificates, groupadd /
# useradd. It is Debian's python3.11 (3.11.2 plus Debian's security fixes), not python.org's build.
#
# Usage: deploy/build-local-base.sh [--force] [IMAGE]   (root; needs debootstrap and a Docker engine)
# Env:   DEBIAN_MIRROR (default: the first Debian mirror in this machine's apt sources, else
#        http://deb.debian.org/debian), DEBIAN_SECURITY_MIRROR, DEBIAN_SUITE (bookworm).
# An existing IMAGE is kept unless --force is given (the build takes a few minutes).
set -euo pipefail

force=0
if [ "${1:-}" = "--force" ]; then force=1; shift; fi
image=${1:-epd-python:3.11-bookworm-local}
suite=${DEBIAN_SUITE:-bookworm}

if [ "$force" = 0 ] && docker image inspect "$image" >/dev/null 2>&1; then
    echo "build-local-base: $image exists (--force rebuilds it)"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then echo "build-local-base: debootstrap needs root" >&2; exit 1; fi
if ! command -v debootstrap >/dev/null; then
    echo "build-local-base: installing debootstrap" >&2
    apt-get install -y --no-install-recommends debootstrap >/dev/null
fi

# The mirror this machine's apt already uses (deb822 "URIs:" or one-line "deb URL suite ...").
first_mirror() {
    local pattern=$1
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | sed -n -E "s#^(deb|URIs:)[[:space:]]+(\[[^]]*\][[:space:]]+)?([a-z]+://[^[:space:]]*${pattern})/?([[:space:]].*)?\$#\3#p" \
        | head -n 1 || true
}
mirror=${DEBIAN_MIRROR:-$(first_mirror '/debian')}
mirror=${mirror:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-$(first_mirror '/debian-security')}
security=${security:-http://deb.debian.org/debian-security}

root=$(mktemp -d /var/tmp/epd-base.XXXXXX)
cleanup() {
    for m in proc dev; do umount -l "$root/$m" 2>/dev/null || true; done
    rm -rf --one-file-system "$root"
}
trap cleanup EXIT

echo "build-local-base: debootstrap $suite from $mirror into $root"
debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"

cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main
EOF
# No recommends and no docs, as in Debian's slim images.
cat >"$root/etc/apt/apt.conf.d/90epd-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
EOF
cat >"$root/etc/dpkg/dpkg.cfg.d/90epd-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF

mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive sh -euc '
    echo "APT::Sandbox::User \"root\";" > /etc/apt/apt.conf.d/00epd-build
    apt-get update -qq
    apt-get upgrade -y -qq >/dev/null
    # python3.11-venv cannot come in through debootstrap --include (it misses python3.11-distutils
    # there); apt inside the chroot resolves it.
    apt-get install -y -qq python3.11 python3.11-venv python3-pip ca-certificates netbase tzdata >/dev/null
    apt-get clean
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt/* /var/log/dpkg.log
    # pip usable as in python:3.11-slim (that image has no PEP 668 marker); the image is the
    # environment, nothing else on it is managed by pip.
    rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED
    for name in python3.11 python3 python; do ln -sf /usr/bin/python3.11 /usr/local/bin/$name; done
    printf "#!/bin/sh\nexec /usr/bin/python3.11 -m pip \"\$@\"\n" > /usr/local/bin/pip
    chmod 755 /usr/local/bin/pip
    ln -sf pip /usr/local/bin/pip3
    /usr/local/bin/python3.11 -m venv --help >/dev/null
    /usr/local/bin/pip --version
'
for m in proc dev; do umount "$root/$m"; done
: >"$root/etc/resolv.conf"   # docker provides it at run time

echo "build-local-base: importing as $image"
tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$image" >/dev/null
docker run --rm "$image" python3.11 -c 'import ssl, venv, sys; print("build-local-base: ok", sys.version.split()[0])'
