"""Fixtures of the e2e tier."""
from __future__ import annotations

import pytest

from tests.e2e.harness import Run


@pytest.fixture
def run(tmp_path):
    runs = []

    def make(**kw) -> Run:
        r = Run(tmp_path, **kw)
        runs.append(r)
        return r

    yield make
    for r in runs:
        r.close()
