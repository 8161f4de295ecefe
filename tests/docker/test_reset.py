"""Reset removes exactly what carries the testbed's id: foreign containers survive."""
from __future__ import annotations

import secrets

from tests.docker.conftest import DOCKER, assert_no_leftovers
from worker.kernel import nsfs

pytestmark = DOCKER


def test_reset_leaves_foreign_containers_untouched(make_host, engine, foreign_container):
    host = make_host()
    tb = host.testbed_id
    suffix = secrets.token_hex(3)
    # not ours: another testbed's label, a name that looks like ours without the label, no label at all
    foreign = [foreign_container(f"etbforeign-{suffix}-1", {"edgetb.testbed": tb + "x"}),
               foreign_container(f"etb-{tb}-lookalike{suffix}"),
               foreign_container(f"plain-{suffix}")]
    host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})
    assert len(engine.containers(filters={"label": f"edgetb.testbed={tb}"})) == 2
    removed = host.reset()["removed"]
    assert removed["nodes"] == 2
    assert_no_leftovers(host)
    for cid in foreign:
        assert engine.inspect_container(cid)["State"]["Running"], cid


def test_reset_without_state_finds_containers_by_label(make_host, engine):
    host = make_host()
    host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})
    with host.store.locked() as state:  # the agent lost its state file (crash, new disk)
        state.update(nodes={}, plans={}, processes={})
    host.reset()
    assert_no_leftovers(host)
    assert not [n for n in nsfs.list_netns() if n.startswith(f"etb-{host.testbed_id}-")]
