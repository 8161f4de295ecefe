"""The security tier: attacks against real testbeds, asserted to fail, with the legitimate path
still working. Uses the netns tier's hosts (random ids and subnets, reset and leak-checked)."""
from tests.netns.conftest import NETNS, host, make_host  # noqa: F401  (fixtures)

SECURITY = [*NETNS, __import__("pytest").mark.security]
