"""The topology model: building by API and from files, defaults, order, checks, round trips."""
import json
from pathlib import Path

import pytest

from controller.model.topology import Link, Topology, load_links, load_nodes, with_rate
from worker.api.errors import TopologyError
from worker.api.shape import Shape


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def three_nodes():
    t = Topology()
    for name in ("a", "b", "c"):
        t.add_node(name, cpu=0.5, mem="64M")
    return t


def test_api_and_symmetric_link():
    t = three_nodes()
    t.add_symmetric_link("a", "b", "10mbit", delay="5ms")
    t.add_link("a", "c", "1mbps", queue=10)
    assert t.links[("a", "b")].shape == t.links[("b", "a")].shape == Shape(10_000_000, delay_ms=5.0)
    assert t.links[("a", "c")].shape == Shape(8_000_000, queue_pkts=10)
    assert t.out_neighbours("a") == ["b", "c"] and t.out_neighbours("c") == []
    assert [link.dst for link in t.links_from("a")] == ["b", "c"]
    assert [n.index for n in t.nodes.values()] == [0, 1, 2]
    assert t.nodes["a"].mem_bytes == 64 * 2**20 and t.nodes["a"].cpu == 0.5
    t.validate()
    with pytest.raises(TopologyError, match="duplicate"):
        t.add_link("b", "a", "1mbit")


def test_a_rate_change_keeps_the_rest_of_the_shape_as_it_is():
    link = Link("a", "b", Shape(rate_bps=10**7, delay_ms=0.1234567, jitter_ms=0.05, loss_pct=1.5, queue_pkts=64))
    assert with_rate(link, "2mbps", "the link change") == Link("a", "b", Shape(
        rate_bps=16 * 10**6, delay_ms=0.1234567, jitter_ms=0.05, loss_pct=1.5, queue_pkts=64))  # not rounded by text
    for bw, says in (("fast", "rate 'fast' needs a number"), ("1" * 33, "longer than 32"),
                     ("200gbit", "'200gbit' is more than the maximum 100gbit"), (5, "expected a string")):
        with pytest.raises(TopologyError, match=f"^the link change: node 'a', link 0 \\(to 'b'\\), field 'bw': {says}"):
            with_rate(link, bw, "the link change")


def test_symmetric_link_is_all_or_nothing():
    t = three_nodes()
    t.add_link("b", "a", "1mbit")
    with pytest.raises(TopologyError, match=r"node 'b', link to 'a': duplicate"):
        t.add_symmetric_link("a", "b", "2mbit")
    assert list(t.links) == [("b", "a")]
    with pytest.raises(TopologyError, match="'jitter'"):
        t.add_symmetric_link("a", "c", "2mbit", jitter="1ms")
    assert list(t.links) == [("b", "a")]


def test_api_errors_name_node_and_field():
    t = three_nodes()
    with pytest.raises(TopologyError, match=r"topology: node 'd', field 'cpu'"):
        t.add_node("d", cpu=0)
    with pytest.raises(TopologyError, match=r"node 'd', field 'mem'"):
        t.add_node("d", mem="lots")
    with pytest.raises(TopologyError, match=r"node 'a', link to 'zz', field 'dest': unknown node 'zz'"):
        t.add_link("a", "zz", "1mbit")
    with pytest.raises(TopologyError, match=r"unknown node 'zz'; nodes: a, b, c"):
        t.node("zz")
    with pytest.raises(TopologyError, match="unknown node"):
        t.out_neighbours("zz")
    assert "d" not in t.nodes and not t.links


@pytest.mark.parametrize("name", ["n1\n", "", "a" * 16, "-a", "_a", "a.b", "a/b", "a b", "é", "n1;ls", 5, None])
def test_bad_node_names(name):
    with pytest.raises(TopologyError, match="not allowed"):
        Topology().add_node(name)


@pytest.mark.parametrize("name", ["a", "N1", "0", "a" * 15, "edge_node-01"])
def test_good_node_names(name):
    assert Topology().add_node(name).name == name


def test_physical_nodes():
    t = Topology()
    node = t.add_node("pi", "physical", ip="192.168.1.20")
    assert (node.kind, node.ip, node.cpu) == ("physical", "192.168.1.20", None)
    with pytest.raises(TopologyError, match=r"node 'pi2', field 'ip': 192.168.1.20 is already the address of node 'pi'"):
        t.add_node("pi2", "physical", ip="192.168.1.20")
    with pytest.raises(TopologyError, match=r"field 'ip'"):
        t.add_node("e", ip="10.0.0.1")  # emulated nodes get their address from the testbed


def test_links_file_declares_nodes_in_order(tmp_path):
    path = write(tmp_path, "links.json", {"n2": [{"dest": "n9", "bw": "1mbit"}, {"dest": "n1", "bw": "2mbit"}],
                                          "n1": [{"dest": "n2", "bw": "3mbit", "loss": "1%"}],
                                          "n3": [{"dest": "n7", "bw": "1mbit"}, {"dest": "n9", "bw": "1mbit"}]})
    t = load_links(path)
    assert list(t.nodes) == ["n2", "n1", "n3", "n9", "n7"]
    assert [n.index for n in t.nodes.values()] == [0, 1, 2, 3, 4]
    assert all(n.kind == "emulated" and n.host == "local" and n.cpu is None and n.mem_bytes is None
               for n in t.nodes.values())
    assert t.links[("n1", "n2")].shape == Shape(3_000_000, loss_pct=1.0)
    assert [link.dst for link in t.links_from("n2")] == ["n9", "n1"]
    assert t.out_neighbours("n9") == []
    t.validate()


def test_full_link_fields(tmp_path):
    path = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "5mbps", "delay": "20ms", "jitter": "5ms",
                                                 "loss": 0.5, "queue": 100}]})
    assert load_links(path).links[("a", "b")] == Link("a", "b", Shape(40_000_000, 20.0, 5.0, 0.5, 100))


def test_nodes_file_then_links(tmp_path):
    nodes = write(tmp_path, "nodes.json", {"nodes": [{"name": "a", "cpu": 1, "mem": "1G"},
                                                     {"name": "pi", "kind": "physical", "ip": "192.168.7.2"},
                                                     {"name": "b", "host": "host2"}]})
    links = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "10mbit"}], "pi": [{"dest": "a", "bw": "1mbit"}]})
    declared = load_nodes(nodes)
    t = load_links(links, declared, nodes_declared=True)
    assert t is declared
    assert list(t.nodes) == ["a", "pi", "b"]
    assert t.nodes["pi"].kind == "physical" and t.nodes["pi"].ip == "192.168.7.2"
    assert t.nodes["b"].host == "host2" and t.nodes["a"].mem_bytes == 2**30 and t.nodes["a"].cpu == 1.0
    assert len(t.links) == 2


def test_load_links_into_topology_is_all_or_nothing(tmp_path):
    t = three_nodes()
    links = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "1mbit"}, {"dest": "zz", "bw": "1mbit"}]})
    with pytest.raises(TopologyError, match="'zz'"):
        load_links(links, t, nodes_declared=True)
    assert list(t.nodes) == ["a", "b", "c"] and not t.links
    ok = write(tmp_path, "ok.json", {"a": [{"dest": "b", "bw": "1mbit"}], "d": [{"dest": "a", "bw": "1mbit"}]})
    load_links(ok, t)  # undeclared nodes are added after the existing ones
    assert list(t.nodes) == ["a", "b", "c", "d"] and t.nodes["d"].index == 3
    assert set(t.links) == {("a", "b"), ("d", "a")}


def test_loading_reads_only_its_file(tmp_path):
    path = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "1mbit"}]})
    load_links(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["links.json"]


def test_round_trip():
    t = Topology()
    t.add_node("a", cpu=0.25, mem="128M")
    t.add_node("b")
    t.add_node("pi", "physical", ip="10.1.2.3")
    t.add_link("a", "b", "7mbit", delay="1ms", jitter="1ms", loss="0.1%", queue=20)
    t.add_link("pi", "a", "1gbps")
    data = t.to_dict()
    assert data["version"] == 1
    again = Topology.from_dict(json.loads(json.dumps(data)))
    assert again.to_dict() == data
    assert again.nodes == t.nodes and again.links == t.links


@pytest.mark.parametrize("mutate,says", [
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(extra=1), "'extra'"),
    (lambda d: d["nodes"].append({"name": "a"}), "declared twice"),
    (lambda d: d["nodes"][0].update(cpu=-1), "'cpu'"),
    (lambda d: d["links"].append({"src": "a", "dst": "a", "shape": {"rate_bps": 1}}), "itself"),
    (lambda d: d["links"][0]["shape"].update(rate_bps="fast"), "'shape'"),
    (lambda d: d["links"][0].pop("dst"), "'dst'"),
    (lambda d: d["links"][0].update(dst=["b"]), "links\\[0\\], field 'dst': expected a string"),
])
def test_from_dict_rejects(mutate, says):
    t = Topology()
    t.add_node("a")
    t.add_node("b")
    t.add_link("a", "b", "1mbit")
    data = t.to_dict()
    mutate(data)
    with pytest.raises(TopologyError, match=says):
        Topology.from_dict(data)


def test_validate_catches_direct_edits():
    t = three_nodes()
    t.add_link("a", "b", "1mbit")
    t.validate()
    t.links[("a", "zz")] = Link("a", "zz", Shape(1000))
    with pytest.raises(TopologyError, match="unknown node 'zz'"):
        t.validate()
    del t.links[("a", "zz")]
    t.nodes["c"].cpu = 0
    with pytest.raises(TopologyError, match=r"node 'c', field 'cpu'"):
        t.validate()
    with pytest.raises(TopologyError, match="no nodes"):
        Topology().validate()


def test_default_links_json_is_valid():
    t = load_links(str(Path(__file__).resolve().parents[2] / "links.json"))
    assert len(t.nodes) == 8 and all(len(t.out_neighbours(n)) == 3 for n in t.nodes)
    t.validate()
