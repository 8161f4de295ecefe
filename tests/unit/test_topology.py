"""The topology model: building by API and from files, defaults, order, round trips."""
import json

import pytest

from controller.topology import Topology, load_links, load_nodes
from worker.errors import TopologyError
from worker.shape import Shape


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_api_and_symmetric_link():
    t = Topology()
    for name in ("a", "b", "c"):
        t.add_node(name, cpu=0.5, mem="64M")
    t.add_symmetric_link("a", "b", "10mbit", delay="5ms")
    t.add_link("a", "c", "1mbps", queue=10)
    assert t.links[("a", "b")].shape == t.links[("b", "a")].shape == Shape(10_000_000, delay_ms=5.0)
    assert t.links[("a", "c")].shape == Shape(8_000_000, queue_pkts=10)
    assert t.out_neighbours("a") == ["b", "c"]
    assert [n.index for n in t.nodes.values()] == [0, 1, 2]
    assert t.nodes["a"].mem_bytes == 64 * 2**20 and t.nodes["a"].cpu == 0.5
    with pytest.raises(TopologyError, match="duplicate"):
        t.add_link("b", "a", "1mbit")


def test_links_file_declares_nodes_in_order(tmp_path):
    path = write(tmp_path, "links.json", {"n2": [{"dest": "n9", "bw": "1mbit"}, {"dest": "n1", "bw": "2mbit"}],
                                          "n1": [{"dest": "n2", "bw": "3mbit", "loss": "1%"}]})
    t = load_links(path)
    assert list(t.nodes) == ["n2", "n1", "n9"]
    assert all(n.kind == "emulated" and n.cpu is None and n.mem_bytes is None for n in t.nodes.values())
    assert t.links[("n1", "n2")].shape.loss_pct == 1.0
    assert [l.dst for l in t.links_from("n2")] == ["n9", "n1"]


def test_nodes_file_then_links(tmp_path):
    nodes = write(tmp_path, "nodes.json", {"nodes": [{"name": "a", "cpu": 1, "mem": "1G"},
                                                     {"name": "pi", "kind": "physical", "ip": "192.168.7.2"},
                                                     {"name": "b", "host": "host2"}]})
    links = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "10mbit"}], "pi": [{"dest": "a", "bw": "1mbit"}]})
    t = load_links(links, load_nodes(nodes), nodes_declared=True)
    assert t.nodes["pi"].kind == "physical" and t.nodes["pi"].ip == "192.168.7.2"
    assert t.nodes["b"].host == "host2" and t.nodes["a"].mem_bytes == 2**30
    assert len(t.links) == 2


def test_round_trip():
    t = Topology()
    t.add_node("a", cpu=0.25, mem="128M")
    t.add_node("b")
    t.add_link("a", "b", "7mbit", delay="1ms", jitter="1ms", loss="0.1%", queue=20)
    again = Topology.from_dict(json.loads(json.dumps(t.to_dict())))
    assert again.to_dict() == t.to_dict()


def test_default_links_json_is_valid():
    from pathlib import Path

    t = load_links(str(Path(__file__).resolve().parents[2] / "links.json"))
    assert len(t.nodes) == 8 and all(len(t.out_neighbours(n)) == 3 for n in t.nodes)
