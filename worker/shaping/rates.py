"""Link rates changed in place, fast: what a recorded trace's replay sends every bin.

A replay changes the rate of many links ten times a second; ``Links.set_links`` would plan,
diff, program and read back every node each time. Here only the HTB class of each changed link
(and its netem leaf, whose limit follows the rate) is changed, one netlink batch per node, on a
socket kept open per node's namespace (opening one enters the namespace); the kernel's answer to
every request is the check (a refused change raises ``ShapingError``). The full read-back stays
with ``GET /nodes/<name>/shaping``. The thread that changes them runs at nice -10 meanwhile
(``urgent``; as root): a tick is due at a time, and a loaded host would delay it most.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from worker.api.errors import ShapingError
from worker.api.shape import Shape
from worker.kernel import netlink as nl
from worker.kernel import nsfs
from worker.shaping.apply import ifindex_in
from worker.shaping.plan import ACCESS_MINOR, netem_limit_pkts

URGENT_NICE = -10  # a replay's ticks under load: 36 -> 13 ms median for 100 links beside 4 busy loops on 2 cores
Key = tuple[Optional[str], int, str]  # namespace name, its inode (a namespace made again is another), interface


class RateSockets:
    """One open netlink socket and interface index per node interface, reused across changes."""

    def __init__(self) -> None:
        self._open: dict[Key, tuple[nl.RtnlSocket, int]] = {}
        self._lock = threading.Lock()

    def _key(self, netns: Optional[str], ifname: str) -> Key:
        return (netns, nsfs.inode(netns) if netns else 0, ifname)

    def get(self, netns: Optional[str], ifname: str) -> tuple[nl.RtnlSocket, int]:
        key = self._key(netns, ifname)
        with self._lock:
            if key not in self._open:
                for old in [k for k in self._open if k[0] == netns]:  # that namespace made again
                    self._open.pop(old)[0].close()
                self._open[key] = (nl.RtnlSocket(netns), ifindex_in(netns, ifname))
            return self._open[key]

    def forget(self, netns: Optional[str]) -> None:
        with self._lock:
            for key in [k for k in self._open if k[0] == netns]:
                self._open.pop(key)[0].close()

    def close(self) -> None:
        with self._lock:
            for sock, _ in self._open.values():
                sock.close()
            self._open.clear()


def rate_messages(ifindex: int, plan: dict[str, Any], rates: dict[str, int],
                  netem: Optional[dict[str, tuple[float, float]]] = None) -> tuple[list[bytes], list[str]]:
    """The requests that give the links of ``plan`` (a stored plan: ``Plan.to_dict``) to the
    destinations of ``rates`` their new rate (their class; a netem leaf's limit too), as
    ``Plan.class_rates`` computes them (an uplink's share), and to those of ``netem`` their new
    (delay in ms, loss in %) in their netem leaf (a recording's columns); what each request does."""
    msgs: list[bytes] = []
    what: list[str] = []
    netem = netem or {}
    uplink = plan.get("uplink_bps")
    count = max(1, len(plan["rules"]))
    for rule in plan["rules"]:
        dest, old = rule["dest"], rule["shape"]
        if dest not in rates:
            continue
        link = rates[dest]
        impair = netem.get(dest)
        new_impair = impair is not None and (old.get("delay_ms") or 0.0, old.get("loss_pct") or 0.0) != impair
        if old["rate_bps"] == link and not new_impair:
            continue
        label = f"rate of the link to {dest} ({link} bit/s)"
        if old["rate_bps"] != link:
            rate = max(8, min(link, int(uplink) // count)) if uplink else link
            msgs.append(nl.htb_class(ifindex, int(rule["minor"]), rate, 0, ceil_bps=link, parent_minor=ACCESS_MINOR))
            what.append(label)
        delay_ms, loss_pct = impair if impair is not None else (old.get("delay_ms") or 0.0, old.get("loss_pct") or 0.0)
        if impair is not None or any(old.get(k) for k in ("delay_ms", "jitter_ms", "loss_pct")):
            # the leaf's delay and loss, and its limit, which follows the rate
            shape = Shape.from_dict({**old, "rate_bps": link, "delay_ms": delay_ms, "loss_pct": loss_pct})
            msgs.append(nl.netem_leaf(ifindex, int(rule["minor"]), shape.delay_ms, shape.jitter_ms, shape.loss_pct,
                                      netem_limit_pkts(shape)))
            what.append(label if impair is None else f"delay and loss of the link to {dest} "
                                                     f"({delay_ms:g} ms, {loss_pct:g} %)")
    return msgs, what


def change_rates(sockets: RateSockets, netns: Optional[str], plan: dict[str, Any], rates: dict[str, int],
                 netem: Optional[dict[str, tuple[float, float]]] = None) -> int:
    """Give the links of ``plan`` (stored) to ``rates``' destinations their new rate (and to
    ``netem``'s their delay and loss) in one batch; how many changed. A refusal raises
    ShapingError; a socket that fails (the interface made again) is opened afresh once."""
    for attempt in (0, 1):
        sock, ifindex = sockets.get(netns, plan["ifname"])
        msgs, what = rate_messages(ifindex, plan, rates, netem)
        if not msgs:
            return 0
        try:
            failures = sock.run(msgs)
        except OSError as e:
            failures = [nl.Failure(0, e.errno or 0, str(e))]
        if not failures:
            return len(set(what))
        sockets.forget(netns)
        if attempt:
            lines = [f"{what[f.position]}: {f.describe()}" for f in failures[:10]]
            raise ShapingError(f"changing rates in {netns or 'the host'} failed: " + "; ".join(lines),
                               detail={"netns": netns, "failures": lines})
    raise ShapingError("unreachable")  # pragma: no cover


@contextmanager
def urgent(nice: int = URGENT_NICE) -> Iterator[None]:
    """Run the calling thread at ``nice`` (at least; Linux keeps a nice value per thread) for the
    block, then as before: the rates of a replay's tick are due at a time, and on a loaded host
    a thread of nice 0 waits behind every busy process. Without the right to (not root), as it was."""
    tid = threading.get_native_id()
    try:
        old = os.getpriority(os.PRIO_PROCESS, tid)
        if old > nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        old = None
    try:
        yield
    finally:
        if old is not None and old > nice:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, old)
            except OSError:  # pragma: no cover (raising one's own nice value is always allowed)
                pass
