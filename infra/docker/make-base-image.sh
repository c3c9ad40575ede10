#!/usr/bin/env bash
# Make the compose stack's base image without any container registry: Debian bookworm (the minbase variant) from
# Debian's own packages with debootstrap, imported into the local engine. Needs root, debootstrap
# (apt-get install debootstrap) and a running Docker engine. Prints the BASE_IMAGE to build with.
#
#   infra/docker/make-base-image.sh [NAME]        NAME defaults to rlstream-base:bookworm
#   BASE_IMAGE=rlstream-base:bookworm docker compose up --build
set -euo pipefail
name="${1:-rlstream-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
say() { echo "make-base-image: $*" >&2; }
command -v debootstrap >/dev/null || { say "debootstrap is missing: apt-get install debootstrap"; exit 1; }
[[ $(id -u) == 0 ]] || { say "debootstrap needs root: run this as root"; exit 1; }
docker info >/dev/null 2>&1 || { say "no Docker engine answers (docker info): start one first (see README, Docker compose)"; exit 1; }
root="$(mktemp -d -t rlstream-base.XXXXXX)"
trap 'rm -rf "$root" "$root.log"' EXIT
say "debootstrap --variant=minbase bookworm from $mirror (about a minute)"
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 || {
    tail -20 "$root.log" >&2; say "debootstrap failed (log above): is $mirror reachable?"; exit 1; }
rm -f "$root.log"
# The same sources as Debian's own bookworm images: updates and security too.
cat >"$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main
SOURCES
# No package lists or caches in an image: every build runs apt-get update first.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*
tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$name" >/dev/null
say "made $name; build with BASE_IMAGE=$name"
echo "$name"
