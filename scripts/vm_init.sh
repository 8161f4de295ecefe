#!/bin/busybox sh
# /init of the vm tier's initramfs (scripts/vm_test.sh): load the modules that reach the host's
# root file system over 9p, mount it read-only with the guest's own /proc, /sys, /dev, and hand
# over to scripts/vm_guest.sh of the checkout (named on the kernel command line).
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() { echo "vm init: $*" > /dev/console; echo o > /proc/sysrq-trigger; sleep 5; exit 1; }
while read -r m; do insmod "$m" || fail "cannot load $m"; done < /modules
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 host /newroot \
  || fail "cannot mount the host's root file system over 9p"
repo=
for word in $(cat /proc/cmdline); do
  case $word in edgetb.repo=*) repo=$(printf %s "${word#edgetb.repo=}" | sed 's/%20/ /g; s/%25/%/g') ;; esac
done
[ -f "/newroot$repo/scripts/vm_guest.sh" ] || fail "no scripts/vm_guest.sh under '$repo'"
for d in proc sys dev; do mount --move "/$d" "/newroot/$d"; done
exec switch_root /newroot /bin/sh "$repo/scripts/vm_guest.sh"
