#!/bin/sh
# The vm tier inside the guest (PID 1, on the host's root file system shared read-only): writable
# tmpfs where the tests write, cgroup v2 (unified), the guest kernel's modules, then pytest tests/vm.
# Its log and exit code go to the host through the writable 'out' share; then the guest powers off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
export PYTHONDONTWRITEBYTECODE=1 EDGETB_VM_GUEST=1
repo= kdir=
for word in $(cat /proc/cmdline); do
  case $word in edgetb.repo=*) repo=$(printf %s "${word#edgetb.repo=}" | sed 's/%20/ /g; s/%25/%/g') ;; edgetb.kdir=*) kdir=$(printf %s "${word#edgetb.kdir=}" | sed 's/%20/ /g; s/%25/%/g') ;; esac
done
off() { sync; umount /run/edgetb-out 2>/dev/null; echo o > /proc/sysrq-trigger; sleep 10; }
mount -t tmpfs -o mode=755 tmpfs /run
# writable where tests and the testbed write (/var/lib/edgetb: state), except over the checkout
export HOME=/tmp
for d in /tmp /var/tmp /var/lib /var/log /root; do
  case "$repo/" in
    "$d"/*) echo "vm guest: the checkout is under $d, which stays read-only"
      [ "$d" = /tmp ] && mkdir -p -m 1777 /run/tmp && export TMPDIR=/run/tmp HOME=/run/tmp ;;
    *) mount -t tmpfs -o mode=1777 tmpfs "$d" ;;
  esac
done
mkdir -p /run/edgetb-out /dev/shm /dev/pts
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out /run/edgetb-out || { echo "vm guest: no out share"; off; }
mount -t tmpfs tmpfs /dev/shm
mount -t devpts devpts /dev/pts
mount -t cgroup2 cgroup2 /sys/fs/cgroup
# the host has no /lib/modules of the guest's kernel: modprobe (also the kernel's own requests)
# reads the extracted package instead
printf '#!/bin/sh\nexec /sbin/modprobe -d %s "$@"\n' "$kdir" > /run/modprobe
chmod +x /run/modprobe
echo /run/modprobe > /proc/sys/kernel/modprobe
hostname edgetb-vm
ip link set lo up
/run/modprobe -a sch_htb sch_netem cls_u32 veth bridge ifb sch_ingress act_mirred 2>&1
out=/run/edgetb-out
: > "$out/booted"
set --
while IFS= read -r a; do [ -n "$a" ] && set -- "$@" "$a"; done < "$out/args"
cd "$repo" || off
echo "vm guest: kernel $(uname -r), cgroup $(stat -fc %T /sys/fs/cgroup), $(nproc) cpu, $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)"
# with no arguments: tests/vm and the netns tests listed in tests/vm/netns_tests.txt
if [ $# -eq 0 ]; then
  set -- tests/vm $(grep -v '^#' tests/vm/netns_tests.txt)
fi
{ .venv/bin/python -m pytest -p no:cacheprovider -ra "$@"; echo $? > "$out/rc.tmp"; } 2>&1 | tee "$out/pytest.log"
mv "$out/rc.tmp" "$out/rc"
off
