#!/usr/bin/env bash
# The vm test tier: boot Debian's stock kernel (linux-image-amd64 of this machine's Debian release)
# under qemu, with this machine's root file system shared read-only over 9p (so the checkout, its
# .venv and the host's ip, tc, iptables and Python are the guest's), cgroup v2 mounted, and run
# tests/vm there. The tier's exit code and pytest's summary come back to the host. Run as root.
#
# Cached on the host under /var/cache/edgetb/vm/<kernel package>_<version>/: the .deb, the
# extracted kernel and modules, and the initramfs (busybox, virtio and 9p modules). A later run
# with the same version downloads nothing; a download that fails or stalls (300 s) fails the tier
# clearly, unless an older kernel is cached: that one is used, with a note.
# Nothing stays behind: qemu is ended on every exit path and the scratch directory is removed.
# Arguments replace pytest's in the guest (default: tests/vm and tests/vm/netns_tests.txt's list).
# EDGETB_VM_ACCEL: auto (default: KVM where a guest boots with it, else TCG), kvm or tcg;
# EDGETB_VM_TIMEOUT_S bounds the guest (default 600 s).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd -P)
start_s=$(date +%s)
cache=/var/cache/edgetb/vm
accel=${EDGETB_VM_ACCEL:-auto}
timeout_s=${EDGETB_VM_TIMEOUT_S:-600}
mem_mb=${EDGETB_VM_MEM_MB:-768}
smp=${EDGETB_VM_SMP:-1}  # one vCPU: with two, the guest's TSCs are unsynchronised and timers late by ms

say() { echo "vm_test: $*" >&2; }
# a path as one word of the kernel's command line (which splits at spaces): % and space escaped
cmdline_word() { printf %s "$1" | sed 's/%/%25/g; s/ /%20/g'; }
die() { say "$*"; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root (the guest shares the host's root file system)"
[ -x .venv/bin/python ] || die "no .venv here: run scripts/setup.sh first"
case "$repo/" in
  /run/*|/proc/*|/sys/*|/dev/*) die "the checkout ($repo) is under a directory the guest mounts its own" ;;
esac

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
dpkg-query -W -f '${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || need+=(busybox-static)
command -v depmod >/dev/null || need+=(kmod)
if [ ${#need[@]} -gt 0 ]; then
  say "installing Debian packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -qq || die "apt-get update failed or took over 300 s"
  timeout 600 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || die "apt-get install ${need[*]} failed or took over 600 s"
fi

# the kernel: linux-image-amd64's dependency, by version --------------------------------------
kernel_pkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}'; }
pkg=${EDGETB_VM_KERNEL_PKG:-$(kernel_pkg)}
if [ -z "$pkg" ]; then  # a new machine's package lists may be empty
  timeout 300 apt-get update -qq || say "apt-get update failed or took over 300 s"
  pkg=$(kernel_pkg)
fi
[ -n "$pkg" ] || die "apt-cache knows no linux-image-amd64 (run apt-get update)"
ver=$(apt-cache show "$pkg" 2>/dev/null | awk '/^Version:/ {print $2; exit}')
[ -n "$ver" ] || die "apt-cache has no version of $pkg"
kdir=$cache/${pkg}_${ver}
if [ ! -f "$kdir/extracted" ]; then
  mkdir -p "$kdir"
  if ! ls "$kdir"/*.deb >/dev/null 2>&1; then
    say "downloading $pkg $ver into $kdir"
    if ! (cd "$kdir" && timeout 300 apt-get download -o APT::Sandbox::User=root -o Acquire::http::Timeout=30 -o Acquire::Retries=1 \
          "$pkg=$ver" >/dev/null 2>download.log); then
      why=$(tail -3 "$kdir/download.log" | tr '\n' ' ')
      rm -rf "$kdir"
      cached=$(ls -td "$cache"/*/extracted 2>/dev/null | head -1 || true)
      [ -n "$cached" ] || die "download of $pkg $ver failed or took over 300 s: $why"
      kdir=$(dirname "$cached")
      say "download of $pkg $ver failed ($why); using the cached $(basename "$kdir")"
      pkg=$(basename "$kdir"); ver=${pkg##*_}; pkg=${pkg%_*}
    fi
  fi
  if [ ! -f "$kdir/extracted" ]; then
    rm -rf "$kdir/root" && mkdir "$kdir/root"
    dpkg-deb -x "$(ls "$kdir"/*.deb | head -1)" "$kdir/root"
    depmod -b "$kdir/root" "${pkg#linux-image-}"
    touch "$kdir/extracted"
  fi
fi
krel=${pkg#linux-image-}
vmlinuz=$kdir/root/boot/vmlinuz-$krel
[ -f "$vmlinuz" ] || die "no $vmlinuz in $pkg $ver"

# the initramfs: busybox, the modules that reach the 9p share, /init ----------------------------
initrd=$kdir/initrd-$(sha256sum scripts/vm_init.sh | cut -c1-12).cpio.gz
if [ ! -f "$initrd" ]; then
  say "building $initrd"
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  mkdir -p "$build"/{bin,dev,proc,sys,newroot,lib/modules}
  cp /bin/busybox "$build/bin/busybox"
  : > "$build/modules"
  for m in virtio_pci 9pnet_virtio 9p; do
    modprobe -d "$kdir/root" -S "$krel" --show-depends "$m" | while read -r kind path _; do
      [ "$kind" = insmod ] || continue
      rel=${path#"$kdir/root"}
      grep -qx "$rel" "$build/modules" && continue
      mkdir -p "$build$(dirname "$rel")"
      cp "$path" "$build$rel"
      echo "$rel" >> "$build/modules"
    done
  done
  cp scripts/vm_init.sh "$build/init"
  chmod +x "$build/init"
  (cd "$build" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) > "$initrd.tmp"
  mv "$initrd.tmp" "$initrd"
  rm -rf "$build"
  trap - EXIT
fi

# boot -----------------------------------------------------------------------------------------
out=$(mktemp -d /tmp/edgetb-vm.XXXXXX)
qpid=""
cleanup() {
  if [ -n "$qpid" ] && kill -0 "$qpid" 2>/dev/null; then kill "$qpid" 2>/dev/null; wait "$qpid" 2>/dev/null || true; fi
  rm -rf "$out"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
printf '%s\n' "$@" > "$out/args"
boot() {  # boot the guest with accelerator $1 in the background (qpid)
  local args
  case $1 in
    kvm) args=(-accel kvm -cpu kvm64) ;;
    *) args=(-accel tcg -cpu max) ;;
  esac
  say "booting $pkg $ver ($1, $smp cpu, $mem_mb MB); pytest in the guest"
  timeout --foreground -k 10 "$timeout_s" qemu-system-x86_64 "${args[@]}" -machine q35 -smp "$smp" -m "$mem_mb" \
    -nodefaults -no-user-config -display none -no-reboot -serial stdio \
    -kernel "$vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 panic=-1 quiet loglevel=3 edgetb.repo=$(cmdline_word "$repo") edgetb.kdir=$(cmdline_word "$kdir/root")" \
    -virtfs local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap \
    -virtfs local,path="$out",mount_tag=out,security_model=none,multidevs=remap \
    </dev/null &
  qpid=$!
}
# auto: KVM where it boots (the guest reaches its test script within 30 s), else TCG; a KVM that
# failed here is remembered per host kernel and qemu, and not tried again
kvm_failed=$kdir/kvm-failed-$(uname -r)-$(qemu-system-x86_64 --version | awk 'NR==1 {print $4}')
if [ "$accel" = auto ]; then
  accel=tcg
  if [ -w /dev/kvm ] && [ ! -f "$kvm_failed" ]; then
    boot kvm
    for _ in $(seq 30); do
      [ -f "$out/booted" ] || ! kill -0 "$qpid" 2>/dev/null && break
      sleep 1
    done
    if [ -f "$out/booted" ]; then
      accel=kvm
    else
      say "a KVM guest did not boot within 30 s here: TCG from now on (remembered in $kvm_failed)"
      kill "$qpid" 2>/dev/null; wait "$qpid" 2>/dev/null || true
      touch "$kvm_failed"
    fi
  fi
fi
[ "$accel" = kvm ] && [ -n "$qpid" ] || boot "$accel"
wait "$qpid" || true
qpid=""
elapsed=$(( $(date +%s) - start_s ))
if [ ! -f "$out/rc" ]; then
  die "the guest ended without a result after ${elapsed}s (see the console above)"
fi
rc=$(cat "$out/rc")
summary=$(grep -E '^=+ .* in [0-9.]+s' "$out/pytest.log" | tail -1 | sed -E 's/^=+ | =+$//g' || true)
say "result on $krel: exit $rc, ${summary:-no pytest summary}; the vm tier took ${elapsed}s"
exit "$rc"
