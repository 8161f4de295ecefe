"""The vm tier: runs inside a qemu guest on Debian's stock kernel (scripts/vm_test.sh), where
sch_netem and cgroup v2 are present. On any other machine its tests skip with that reason.

The netns tier's fixtures (hosts on their own testbed ids and subnets, reset and checked for
leftovers at teardown) and the e2e tier's ``run`` (a ``*_run.py`` experiment) are used as they are.
"""
import os

import pytest

from tests.e2e.conftest import run  # noqa: F401  (fixtures)
from tests.netns.conftest import host, make_host  # noqa: F401

IN_GUEST = os.environ.get("EDGETB_VM_GUEST") == "1"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="vm tier: runs in the guest of scripts/vm_test.sh (Debian's stock kernel)")
    for item in items:
        if "tests/vm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vm)
            if not IN_GUEST:
                item.add_marker(skip)
