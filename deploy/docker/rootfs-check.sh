#!/usr/bin/env bash
# Plays deploy/docker/Dockerfile's runtime stage where no Docker daemon runs: debootstraps a
# minimal Debian 12 root file system, installs exactly the packages the runtime stage installs
# (runtime-packages.sh's list + the fixed extras), adds uid 10001, copies the kvrelay binary,
# and runs it there as uid 10001: every library resolves, make-test-model, a co-located
# generate, and a cache store that answers the HEALTHCHECK command.
# Needs root and Debian's mirror (downloads ~60 MB). Not part of CI (network, minutes); run by
# hand after changing the Dockerfile or the binary's dependencies.
# Usage: deploy/docker/rootfs-check.sh build/bin/kvrelay [ROOTFS_DIR]
set -euo pipefail
kvrelay=$(realpath "${1:?usage: rootfs-check.sh KVRELAY [ROOTFS_DIR]}")
here=$(cd "$(dirname "$0")" && pwd)
rootfs=${2:-$(mktemp -d /tmp/kvrelay-rootfs.XXXXXX)}
mounted=()
store_pid=""
cleanup() {
  [[ -n $store_pid ]] && kill "$store_pid" 2>/dev/null || true
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
# The same list and extras as the Dockerfile's runtime stage.
extras=$(sed -n 's/^ *libucx0 \(.*\) ca-certificates.*/libucx0 \1 ca-certificates/p' "$here/Dockerfile")
[[ -n $extras ]] || { echo "rootfs-check.sh: cannot read the runtime stage's extra packages" >&2; exit 1; }
packages="$("$here/runtime-packages.sh" "$kvrelay" | tr '\n' ' ') $extras"

if [[ ! -x $rootfs/bin/sh ]]; then
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
fi
mount -t proc proc "$rootfs/proc" && mounted+=("$rootfs/proc")
mount --bind /dev "$rootfs/dev" && mounted+=("$rootfs/dev")
mount --bind /dev/pts "$rootfs/dev/pts" && mounted+=("$rootfs/dev/pts")
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
echo "installing: $packages"
# shellcheck disable=SC2086
chroot "$rootfs" /bin/sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends $packages >/dev/null"
chroot "$rootfs" /bin/sh -c "getent passwd 10001 >/dev/null || { groupadd --system --gid 10001 kvrelay && \
  useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/kvrelay --create-home --shell /usr/sbin/nologin kvrelay; }"
install -m 0755 "$kvrelay" "$rootfs/usr/local/bin/kvrelay"

as_kvrelay() { chroot --userspec=10001:10001 "$rootfs" /usr/bin/env HOME=/var/lib/kvrelay "$@"; }
if chroot "$rootfs" ldd /usr/local/bin/kvrelay | grep "not found"; then
  echo "FAIL: libraries missing in the runtime root file system" >&2; exit 1
fi
echo "ldd: every library of kvrelay resolves"
as_kvrelay /usr/local/bin/kvrelay make-test-model --arch=llama --seed=1 --out=/tmp/tiny-llama >/dev/null
as_kvrelay /usr/local/bin/kvrelay generate --colocated --model /tmp/tiny-llama --tokens 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17 --max-tokens 4
# Not through as_kvrelay: a backgrounded function is a subshell, and $! would be its pid.
chroot --userspec=10001:10001 "$rootfs" /usr/local/bin/kvrelay cachestore --host 127.0.0.1 --port 0 \
  --metrics-port 0 >"$rootfs/tmp/store.out" 2>&1 &
store_pid=$!
for _ in $(seq 100); do grep -q "listening on" "$rootfs/tmp/store.out" && break; sleep 0.1; done
address=$(sed -n 's/^cachestore listening on \([0-9.]*:[0-9]*\) .*/\1/p' "$rootfs/tmp/store.out")
as_kvrelay /bin/sh -c "KVRELAY_HEALTH_ADDRESS=$address; exec kvrelay health --address \"\$KVRELAY_HEALTH_ADDRESS\""
kill -TERM "$store_pid"; wait "$store_pid"; store_pid=""
echo "runtime root file system ($rootfs): $(du -shx "$rootfs" | cut -f1); kvrelay runs there as uid 10001"
