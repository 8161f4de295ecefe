"""Subnets for the tests' and benchmarks' testbeds: /16s that no address of this host is in."""
from __future__ import annotations

import ipaddress
import subprocess
from typing import Iterable


def host_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this host's addresses (``ip -4 -o addr show``)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    return [ipaddress.IPv4Interface(words[words.index("inet") + 1]).network
            for words in map(str.split, out.splitlines()) if "inet" in words]


def free_subnets(octets: Iterable[int]) -> list[str]:
    """Of ``10.<octet>.0.0/16`` for ``octets`` (in their order), those no address of this host is in."""
    taken = host_networks()
    subnets = [ipaddress.IPv4Network(f"10.{octet}.0.0/16") for octet in octets]
    return [str(s) for s in subnets if not any(s.overlaps(t) for t in taken)]
