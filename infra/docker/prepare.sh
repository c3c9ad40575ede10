#!/usr/bin/env bash
# Prepare this host for a compose build that reaches no registry but Debian's packages: check the engine and the
# base image, then fill infra/docker/cache/ (mounted by the Dockerfile while it builds, never copied into an image):
#   wheels/            a wheelhouse of the rlstream image's packages, pinned by constraints.txt (pip wheel: once
#                      `make setup` has run, pip's cache holds them and nothing is downloaded again)
#   rlstream/kafka/H/  the Kafka jars of the pom whose hash is H, as `rlstream up` fetched them (Maven Central)
#   ca.pem             $SSL_CERT_FILE, for a build that does reach PyPI from behind a TLS-intercepting proxy
#
#   BASE_IMAGE=rlstream-base:bookworm PY=python3.11 infra/docker/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-python3}"
base="${BASE_IMAGE:-debian:bookworm-slim}"
cache=infra/docker/cache
say() { echo "prepare: $*" >&2; }
fail() { say "$*"; exit 1; }

command -v docker >/dev/null || fail "no docker command: install a Docker engine (README, section Docker compose)"
docker info >/dev/null 2>&1 || fail "no Docker engine answers (docker info failed): start it, e.g. as root
  dockerd --storage-driver overlay2 --exec-opt native.cgroupdriver=cgroupfs >/var/log/dockerd.log 2>&1 &"
if ! docker image inspect "$base" >/dev/null 2>&1 && ! docker pull -q "$base" >/dev/null 2>&1; then
    fail "base image $base is not in the engine and cannot be pulled (no registry reachable?): make one from
  Debian's packages with infra/docker/make-base-image.sh, then build with BASE_IMAGE=rlstream-base:bookworm"
fi
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || fail "$PY is not Python 3.11, the image's: set PY to a Python 3.11 (the wheels must match it)"

# The wheelhouse is made again whenever the pins or the package list change.
inputs="$(cat constraints.txt pyproject.toml infra/docker/requirements.py | sha256sum | cut -c1-16)"
if [[ "$(cat "$cache/wheels/COMPLETE" 2>/dev/null)" != "$inputs" ]]; then
    say "wheelhouse of the image's packages into $cache/wheels (pip wheel, from pip's cache where it can)"
    rm -rf "$cache/wheels"
    mkdir -p "$cache/wheels"
    "$PY" infra/docker/requirements.py pyproject.toml >"$cache/requirements.txt"
    PIP_CONSTRAINT="$PWD/constraints.txt" "$PY" -m pip wheel -q -w "$cache/wheels" -c constraints.txt \
        -r "$cache/requirements.txt"
    rm -f "$cache/requirements.txt"
    echo "$inputs" >"$cache/wheels/COMPLETE"
fi

hash="$(PYTHONPATH=. "$PY" -c 'from rlstream.infra.broker_jars import pom_hash; print(pom_hash())')"
if [[ ! -d "$cache/rlstream/kafka/$hash" ]]; then
    lib="$(PYTHONPATH=. "$PY" -m rlstream.infra.broker fetch)"
    say "the Kafka jars of $lib into $cache/rlstream/kafka/$hash"
    rm -rf "$cache/rlstream"
    mkdir -p "$cache/rlstream/kafka"
    cp -r "$lib" "$cache/rlstream/kafka/$hash.partial"
    mv "$cache/rlstream/kafka/$hash.partial" "$cache/rlstream/kafka/$hash"
fi

if [[ -n "${SSL_CERT_FILE:-}" && -f "$SSL_CERT_FILE" ]]; then
    cp "$SSL_CERT_FILE" "$cache/ca.pem"
fi
say "ready: $(du -sh "$cache" | cut -f1) in $cache; build with BASE_IMAGE=$base"
