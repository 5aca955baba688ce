#!/usr/bin/env bash
# Run a command as root under another Linux kernel: Debian 12's 6.1 by default, booted in QEMU
# (software emulation: no KVM needed; ~20x slower than the host), with this machine's files.
#
#   scripts/guest-kernel/run.sh 'cd /work/main && .venv/bin/python -m pytest -q tests/e2e'
#   scripts/guest-kernel/run.sh -f script.sh
#
# Prints the command's output and exits with its exit code (124: the guest timed out). The guest
# sees the host's / read-only under a throwaway overlay (so this checkout and its .venv, writable,
# the writes lost at the end), empty /tmp and /run, and no network but loopback. Needs root, apt
# (qemu-system-x86, busybox-static, kmod, cpio, the kernel package, on first use).
# Env: KERNEL (a linux-image package version, default 6.1.0-57-amd64), TIMEOUT (s, 3600),
# MEM (2G), SMP (2), CACHE (/var/tmp/reconciler-guest-kernel).
set -u
KV=${KERNEL:-6.1.0-57-amd64}
CACHE=${CACHE:-/var/tmp/reconciler-guest-kernel}
HERE=$(cd "$(dirname "$0")" && pwd)
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

need=()
for tool in qemu-system-x86_64:qemu-system-x86 busybox:busybox-static depmod:kmod cpio:cpio; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2 || exit 2
fi
mkdir -p "$CACHE"
if [ ! -f "$CACHE/kroot/boot/vmlinuz-$KV" ]; then  # unpacked, not installed: the host's /boot is left alone
  (cd "$CACHE" && apt-get download "linux-image-$KV" >&2 && dpkg-deb -x linux-image-"${KV}"_*.deb kroot) || exit 2
  depmod -b "$CACHE/kroot" "$KV"
fi
INITRD=$CACHE/initrd-$KV.gz
if [ ! -f "$INITRD" ] || [ "$HERE/init" -nt "$INITRD" ]; then
  src=$(mktemp -d) && mkdir -p "$src"/{bin,proc,sys,dev,mnt,mods}
  cp "$(command -v busybox)" "$src/bin/busybox" && cp "$HERE/init" "$src/init" && chmod +x "$src/init"
  M=$CACHE/kroot/lib/modules/$KV/kernel
  for f in drivers/virtio/virtio drivers/virtio/virtio_ring drivers/virtio/virtio_pci_legacy_dev \
           drivers/virtio/virtio_pci_modern_dev drivers/virtio/virtio_pci fs/netfs/netfs fs/fscache/fscache \
           net/9p/9pnet net/9p/9pnet_virtio fs/9p/9p fs/overlayfs/overlay; do
    cp "$M/$f.ko" "$src/mods/" 2>/dev/null || true  # (some are built in, depending on the kernel)
  done
  (cd "$src" && find . | cpio -o -H newc 2>/dev/null | gzip -1) > "$INITRD"
  rm -rf "$src"
fi

X=$(mktemp -d "$CACHE/run.XXXXXX")
trap 'rm -rf "$X"' EXIT
if [ "${1:-}" = "-f" ]; then cp "$2" "$X/cmd.sh"; else printf '%s\n' "$*" > "$X/cmd.sh"; fi
# -cpu max: the host's wheels may use instructions QEMU's default CPU model lacks (SIGILL)
timeout "${TIMEOUT:-3600}" qemu-system-x86_64 -accel tcg -cpu max -m "${MEM:-2G}" -smp "${SMP:-2}" \
  -kernel "$CACHE/kroot/boot/vmlinuz-$KV" -initrd "$INITRD" \
  -append "console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init guestcache=$CACHE" \
  -nographic -no-reboot -nic none \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs "local,path=$X,mount_tag=xfer,security_model=none,multidevs=remap" \
  > "$X/console.log" 2>&1 </dev/null
qrc=$?
cat "$X/out" 2>/dev/null
if [ $qrc = 124 ]; then echo "guest-kernel: timed out after ${TIMEOUT:-3600}s" >&2; exit 124; fi
if [ -s "$X/rc" ]; then exit "$(cat "$X/rc")"; fi
echo "guest-kernel: the guest did not run the command (qemu exit $qrc); its console:" >&2
cat "$X/console.log" >&2
exit 125
