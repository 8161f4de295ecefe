"""Malformed links and nodes files: each gives a TopologyError naming the file, node and field."""
import json

import pytest

from controller.topology import load_links, load_nodes
from worker.errors import TopologyError

BAD_LINKS = [
    ("unit typo", {"a": [{"dest": "b", "bw": "10mbitt"}]}, ["'a'", "'bw'", "10mbitt"]),
    ("bare number", {"a": [{"dest": "b", "bw": "10"}]}, ["'a'", "'bw'", "unit"]),
    ("numeric bw", {"a": [{"dest": "b", "bw": 10}]}, ["'a'", "'bw'"]),
    ("zero rate", {"a": [{"dest": "b", "bw": "0mbit"}]}, ["'a'", "'bw'", "positive"]),
    ("negative rate", {"a": [{"dest": "b", "bw": "-1mbit"}]}, ["'a'", "'bw'"]),
    ("self link", {"a": [{"dest": "a", "bw": "1mbit"}]}, ["'a'", "itself"]),
    ("duplicate link", {"a": [{"dest": "b", "bw": "1mbit"}, {"dest": "b", "bw": "2mbit"}]}, ["'a'", "duplicate"]),
    ("missing dest", {"a": [{"bw": "1mbit"}]}, ["'a'", "link 0", "'dest'"]),
    ("missing bw", {"a": [{"dest": "b"}]}, ["'a'", "'bw'"]),
    ("field typo", {"a": [{"dest": "b", "bw": "1mbit", "bandwith": "2mbit"}]}, ["'a'", "'bandwith'", "allowed"]),
    ("links not a list", {"a": {"dest": "b", "bw": "1mbit"}}, ["'a'", "list"]),
    ("link not an object", {"a": ["b"]}, ["'a'", "link 0"]),
    ("top level list", [{"a": []}], ["expected an object"]),
    ("shell metacharacters", {"a; rm -rf /": [{"dest": "b", "bw": "1mbit"}]}, ["a; rm -rf /", "not allowed"]),
    ("command substitution dest", {"a": [{"dest": "$(reboot)", "bw": "1mbit"}]}, ["$(reboot)", "'dest'"]),
    ("name too long", {"abcdefghijklmnop": [{"dest": "b", "bw": "1mbit"}]}, ["abcdefghijklmnop"]),
    ("space in name", {"a b": [{"dest": "b", "bw": "1mbit"}]}, ["'a b'"]),
    ("dot in name", {"a": [{"dest": "../etc", "bw": "1mbit"}]}, ["../etc"]),
    ("negative loss", {"a": [{"dest": "b", "bw": "1mbit", "loss": "-1%"}]}, ["'a'", "'loss'"]),
    ("loss over 100", {"a": [{"dest": "b", "bw": "1mbit", "loss": "150%"}]}, ["'a'", "'loss'", "150%"]),
    ("loss without %", {"a": [{"dest": "b", "bw": "1mbit", "loss": "0.5"}]}, ["'a'", "'loss'"]),
    ("delay without unit", {"a": [{"dest": "b", "bw": "1mbit", "delay": "20"}]}, ["'a'", "'delay'"]),
    ("delay too long", {"a": [{"dest": "b", "bw": "1mbit", "delay": "61s"}]}, ["'a'", "'delay'"]),
    ("jitter without delay", {"a": [{"dest": "b", "bw": "1mbit", "jitter": "5ms"}]}, ["'a'", "'jitter'", "delay"]),
    ("queue zero", {"a": [{"dest": "b", "bw": "1mbit", "queue": 0}]}, ["'a'", "'queue'"]),
    ("queue string", {"a": [{"dest": "b", "bw": "1mbit", "queue": "100"}]}, ["'a'", "'queue'"]),
]


@pytest.mark.parametrize("label,content,expected", BAD_LINKS, ids=[c[0] for c in BAD_LINKS])
def test_bad_links(tmp_path, label, content, expected):
    path = tmp_path / "links.json"
    path.write_text(json.dumps(content))
    with pytest.raises(TopologyError) as err:
        load_links(str(path))
    message = str(err.value)
    assert str(path) in message, message
    for part in expected:
        assert part in message, (part, message)


def test_invalid_json_names_line_and_column(tmp_path):
    path = tmp_path / "links.json"
    path.write_text('{\n  "a": [{"dest": "b", "bw": "1mbit"}\n}')
    with pytest.raises(TopologyError, match=r"links.json: invalid JSON at line 3, column 1"):
        load_links(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(TopologyError, match="cannot read"):
        load_links(str(tmp_path / "nope.json"))


BAD_NODES = [
    ("duplicate node", {"nodes": [{"name": "a"}, {"name": "a"}]}, ["'a'", "twice"]),
    ("cpu zero", {"nodes": [{"name": "a", "cpu": 0}]}, ["'a'", "'cpu'"]),
    ("cpu string", {"nodes": [{"name": "a", "cpu": "half"}]}, ["'a'", "'cpu'"]),
    ("mem unit", {"nodes": [{"name": "a", "mem": "256X"}]}, ["'a'", "'mem'"]),
    ("mem tiny", {"nodes": [{"name": "a", "mem": "1K"}]}, ["'a'", "'mem'"]),
    ("kind", {"nodes": [{"name": "a", "kind": "virtual"}]}, ["'a'", "'kind'", "virtual"]),
    ("physical without ip", {"nodes": [{"name": "a", "kind": "physical"}]}, ["'a'", "'ip'"]),
    ("bad ip", {"nodes": [{"name": "a", "kind": "physical", "ip": "10.0.0.300"}]}, ["'a'", "'ip'"]),
    ("unknown field", {"nodes": [{"name": "a", "cores": 2}]}, ["nodes[0]", "'cores'"]),
    ("no name", {"nodes": [{"cpu": 1}]}, ["nodes[0]", "'name'"]),
    ("not a list", {"nodes": {"name": "a"}}, ["'nodes'"]),
    ("bad host", {"nodes": [{"name": "a", "host": "x y"}]}, ["'a'", "'host'"]),
]


@pytest.mark.parametrize("label,content,expected", BAD_NODES, ids=[c[0] for c in BAD_NODES])
def test_bad_nodes(tmp_path, label, content, expected):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(content))
    with pytest.raises(TopologyError) as err:
        load_nodes(str(path))
    message = str(err.value)
    assert str(path) in message, message
    for part in expected:
        assert part in message, (part, message)


def test_link_to_undeclared_node(tmp_path):
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps({"nodes": [{"name": "a"}]}))
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"a": [{"dest": "zz", "bw": "1mbit"}]}))
    with pytest.raises(TopologyError) as err:
        load_links(str(links), load_nodes(str(nodes)), nodes_declared=True)
    assert "links.json" in str(err.value) and "'zz'" in str(err.value) and "'dest'" in str(err.value)
