#!/usr/bin/env bash
# Builds the driver's image for the local cluster without a registry or a container
# engine: a Debian root made with debootstrap from the Debian mirror this machine's apt
# uses, Python's venv at /opt/dra with requirements.lock (as the Dockerfile installs it),
# and this checkout's package on top. Two layers, each a plain tar kept in the cache:
#   base.tar  debootstrap + /opt/dra's dependencies   (rebuilt when requirements.lock,
#                                                       the suite or the package list change)
#   top.tar   the driver package from this working tree (rebuilt when driver/ changes)
# cluster.py assembles them into an OCI archive and imports it with `ctr images import`
# (Cluster.import_driver_image); the image is what the MPS control daemon pod runs
# (`dra-driver mps-control-daemon`, the chart's MPS_IMAGE).
#
# The cache lives outside the repository: $DRA_LOCAL_CLUSTER_CACHE, default
# ~/.cache/dra-local-cluster/driver-image. Needs root (debootstrap, chroot) and debootstrap
# (apt-get install debootstrap).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${DRA_LOCAL_CLUSTER_CACHE:-$HOME/.cache/dra-local-cluster}/driver-image
suite=${DEBIAN_SUITE:-bookworm}
# python3-venv: the venv the Dockerfile makes; pci.ids: what the Dockerfile's image adds.
packages=python3,python3-venv,pci.ids
log() { echo "image.sh: $*" >&2; }

command -v debootstrap >/dev/null || { echo "image.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 3; }
[ "$(id -u)" = 0 ] || { echo "image.sh: needs root (debootstrap, chroot)" >&2; exit 3; }

# The mirror apt uses here (deb822 sources first, then sources.list), else Debian's CDN.
mirror=${DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
  mirror=$(awk '/^URIs:/ && $2 ~ /\/debian\/?$/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
fi
if [ -z "$mirror" ]; then
  mirror=$(awk '$1 == "deb" && $2 ~ /\/debian\/?$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}

mkdir -p "$cache"
root="$cache/root"
base_stamp=$(printf '%s\n' "$suite" "$packages" "$mirror" | cat - "$repo/requirements.lock" | sha256sum | cut -c1-16)

unmount_root() {
  # debootstrap mounts /proc and /sys in the root while it runs; a killed run leaves them
  local m
  for m in $(awk -v r="$root/" 'index($2, r) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
}

build_base() {
  if [ -f "$cache/base.tar" ] && [ "$(cat "$cache/base.stamp" 2>/dev/null)" = "$base_stamp" ]; then
    log "base layer is up to date ($cache/base.tar)"; return
  fi
  local t0=$SECONDS
  unmount_root
  rm -rf "$root" "$cache/base.tar" "$cache/base.stamp" "$cache/wheels"
  log "debootstrap $suite from $mirror"
  debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" > "$cache/debootstrap.log" 2>&1 \
    || { unmount_root; tail -20 "$cache/debootstrap.log" >&2; echo "image.sh: debootstrap failed (log: $cache/debootstrap.log)" >&2; exit 1; }
  unmount_root
  # The dependencies as wheels fetched by this machine's pip (its index and certificates),
  # then installed inside the root by the root's own Python, without network.
  python3 -m pip download -q --no-deps --only-binary=:all: -r "$repo/requirements.lock" -d "$cache/wheels"
  cp -r "$cache/wheels" "$root/tmp/wheels"
  cp "$repo/requirements.lock" "$root/tmp/requirements.lock"
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot "$root" sh -ec '
    python3 -m venv /opt/dra
    /opt/dra/bin/pip install -q --disable-pip-version-check --no-index --find-links /tmp/wheels \
      --no-deps -r /tmp/requirements.lock
    rm -rf /tmp/wheels /tmp/requirements.lock /root/.cache'
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  # Numeric owners, no device nodes, no /proc or /sys contents: the runtime provides those.
  tar --numeric-owner --xattrs -C "$root" -cf "$cache/base.tar.new" \
    --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* --exclude=./run/* .
  mv "$cache/base.tar.new" "$cache/base.tar"
  echo "$base_stamp" > "$cache/base.stamp"
  log "base layer took $((SECONDS - t0))s ($(du -h "$cache/base.tar" | cut -f1))"
}

build_top() {
  local src stamp t0=$SECONDS
  # Nothing here depends on the Python that runs the tier: the mock node's tools
  # (driver/devices/mock/tree.py) run under the interpreter of the process that calls
  # them, in the MPS daemon pod /opt/dra's (driver/prepare/mps_daemon.py).
  stamp=$( (cd "$repo" && find driver pyproject.toml README.md -type f ! -path '*/__pycache__/*' -print0 \
            | sort -z | xargs -0 sha256sum; echo "$base_stamp") | sha256sum | cut -c1-16)
  if [ -f "$cache/top.tar" ] && [ "$(cat "$cache/top.stamp" 2>/dev/null)" = "$stamp" ]; then
    log "driver layer is up to date ($cache/top.tar)"; return
  fi
  src=$(mktemp -d /tmp/dra-image-src-XXXXXX)
  trap 'rm -rf "$src"' RETURN
  (cd "$repo" && tar -cf - --exclude=__pycache__ driver pyproject.toml README.md) | tar -xf - -C "$src"
  python3 -m pip wheel -q --no-deps -w "$src/wheel" "$src" >/dev/null
  rm -rf "$root/tmp/top" "$root/tmp/wheel"
  cp -r "$src/wheel" "$root/tmp/wheel"
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot "$root" sh -ec '
    /opt/dra/bin/pip install -q --disable-pip-version-check --no-warn-script-location --no-index --no-deps --root /tmp/top /tmp/wheel/*.whl
    test -x /tmp/top/opt/dra/bin/dra-driver'
  rm -rf "$root/tmp/wheel"
  tar --numeric-owner -C "$root/tmp/top" -cf "$cache/top.tar.new" .
  rm -rf "$root/tmp/top"
  mv "$cache/top.tar.new" "$cache/top.tar"
  echo "$stamp" > "$cache/top.stamp"
  log "driver layer took $((SECONDS - t0))s ($(du -h "$cache/top.tar" | cut -f1))"
}

build_base
build_top
echo "$cache"
