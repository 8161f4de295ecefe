"""Interface indexes asked by netlink (``worker.kernel.netlink.ifindex``): the kernel's own index of
a node's interface and of the host's, None for a name that is not there."""
from __future__ import annotations

import json
import socket
import subprocess

import pytest

from tests.netns.conftest import NETNS, nodes_body
from worker.api.errors import NotFound
from worker.kernel import netlink as nl

pytestmark = NETNS


def test_an_index_is_the_kernels_and_a_missing_name_is_none(host):
    host.create_nodes(nodes_body("a"))
    netns = host.runtime.node("a")["netns"]
    shown = json.loads(subprocess.run(["ip", "-n", netns, "-j", "link", "show", "eth0"], capture_output=True,
                                      text=True, check=True).stdout)
    assert nl.ifindex(netns, "eth0") == shown[0]["ifindex"]
    assert nl.ifindex(None, "lo") == socket.if_nametoindex("lo")
    assert nl.ifindex(netns, "ifb-none") is None
    assert nl.ifindex(None, "etb-no-such") is None
    with pytest.raises(NotFound, match="etb-no-such-netns"):
        nl.ifindex("etb-no-such-netns", "eth0")
