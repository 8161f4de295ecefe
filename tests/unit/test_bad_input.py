"""Malformed links and nodes files: each gives a TopologyError naming the file, the node and the field."""
import json

import pytest

from controller.model.topology import load_links, load_nodes
from worker.api.errors import ConfigError, TestbedError, TopologyError


def link(**fields):
    return {"dest": "b", "bw": "1mbit", **fields}


# (id, file content (JSON value or raw text), substrings the message must hold besides the file's path).
# An unknown dest is only an error when nodes are declared: see test_link_to_undeclared_node.
BAD_LINKS = [
    ("unit typo", {"a": [link(bw="10mbitt")]}, ["node 'a'", "link 0 (to 'b')", "field 'bw'", "10mbitt", "unit"]),
    ("bare number string", {"a": [link(bw="10")]}, ["node 'a'", "field 'bw'", "'10'", "unit"]),
    ("bare number", {"a": [link(bw=10)]}, ["node 'a'", "field 'bw'", "10"]),
    ("rate per second suffix", {"a": [link(bw="5mbit/s")]}, ["field 'bw'", "5mbit/s"]),
    ("zero rate", {"a": [link(bw="0mbit")]}, ["node 'a'", "field 'bw'", "positive"]),
    ("negative rate", {"a": [link(bw="-1mbit")]}, ["node 'a'", "field 'bw'", "positive"]),
    ("rate too high", {"a": [link(bw="200gbit")]}, ["node 'a'", "field 'bw'", "maximum"]),
    ("self link", {"a": [link(dest="a")]}, ["node 'a'", "field 'dest'", "itself"]),
    ("duplicate link", {"a": [link(), link(dest="c"), link(bw="2mbit")]}, ["node 'a'", "link 2 (to 'b')", "duplicate"]),
    ("missing dest", {"a": [{"bw": "1mbit"}]}, ["node 'a'", "link 0", "missing field 'dest'"]),
    ("missing bw", {"a": [{"dest": "b"}]}, ["node 'a'", "link 0", "needs 'bw'", "or 'trace'"]),
    ("field typo", {"a": [link(bandwith="2mbit")]}, ["node 'a'", "'bandwith'", "valid fields: dest, bw, delay"]),
    ("links not a list", {"a": {"dest": "b", "bw": "1mbit"}}, ["node 'a'", "list of links", "dict"]),
    ("link not an object", {"a": ["b"]}, ["node 'a'", "link 0", "expected an object"]),
    ("top level list", [{"a": []}], ["expected an object mapping"]),
    ("top level string", json.dumps("links"), ["expected an object mapping"]),
    ("shell metacharacters", {"n1; rm -rf /": [link()]}, ["'n1; rm -rf /'", "not allowed"]),
    ("command substitution dest", {"a": [link(dest="$(reboot)")]}, ["node 'a'", "field 'dest'", "$(reboot)"]),
    ("backticks dest", {"a": [link(dest="`id`")]}, ["field 'dest'", "`id`"]),
    ("name too long", {"abcdefghijklmnop": [link()]}, ["abcdefghijklmnop", "1-15"]),
    ("space in name", {"a b": [link()]}, ["'a b'", "not allowed"]),
    ("path in dest", {"a": [link(dest="../etc")]}, ["field 'dest'", "../etc"]),
    ("empty name", {"": [link()]}, ["''", "not allowed"]),
    ("newline in name", {"a\n": [link()]}, ["'a\\n'", "not allowed"]),
    ("dest not a string", {"a": [link(dest=7)]}, ["field 'dest'", "7"]),
    ("negative loss", {"a": [link(loss="-1%")]}, ["node 'a'", "field 'loss'", "-1%"]),
    ("loss over 100", {"a": [link(loss="150%")]}, ["node 'a'", "field 'loss'", "150%", "between 0% and 100%"]),
    ("numeric loss over 100", {"a": [link(loss=150)]}, ["field 'loss'", "150"]),
    ("loss without %", {"a": [link(loss="0.5")]}, ["node 'a'", "field 'loss'", "'0.5'"]),
    ("delay without unit", {"a": [link(delay="20")]}, ["node 'a'", "field 'delay'", "'20'"]),
    ("delay too long", {"a": [link(delay="61s")]}, ["node 'a'", "field 'delay'", "61s"]),
    ("negative delay", {"a": [link(delay="-5ms")]}, ["field 'delay'", "negative"]),
    ("jitter too long", {"a": [link(delay="1s", jitter="2min")]}, ["field 'jitter'", "2min"]),
    ("jitter without delay", {"a": [link(jitter="5ms")]}, ["node 'a'", "field 'jitter'", "needs a non-zero 'delay'"]),
    ("queue zero", {"a": [link(queue=0)]}, ["node 'a'", "field 'queue'", "got 0"]),
    ("queue string", {"a": [link(queue="100")]}, ["node 'a'", "field 'queue'", "'100'"]),
    ("queue fraction", {"a": [link(queue=1.5)]}, ["field 'queue'", "1.5"]),
    ("queue bool", {"a": [link(queue=True)]}, ["field 'queue'", "got true"]),
    ("invalid JSON", '{\n  "a": [{"dest": "b", "bw": "1mbit"}\n}', ["invalid JSON at line 3, column 1"]),
    ("empty file", "", ["invalid JSON at line 1, column 1"]),
    ("duplicate source key", '{"a": [], "a": [{"dest": "b", "bw": "1mbit"}]}', ["key 'a' appears twice"]),
    ("duplicate field", '{"a": [{"dest": "b", "bw": "1mbit", "bw": "2mbit"}]}', ["key 'bw' appears twice"]),
    ("NaN loss", '{"a": [{"dest": "b", "bw": "1mbit", "loss": NaN}]}', ["NaN"]),
    ("no links at all", {}, ["no nodes"]),
]


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def error_of(call, *args, **kwargs):
    with pytest.raises(TopologyError) as err:
        call(*args, **kwargs)
    assert isinstance(err.value, ConfigError) and isinstance(err.value, TestbedError)
    assert err.value.to_json()["error"] == "topology_error"
    return str(err.value)


@pytest.mark.parametrize("content,expected", [c[1:] for c in BAD_LINKS], ids=[c[0] for c in BAD_LINKS])
def test_bad_links(tmp_path, content, expected):
    path = write(tmp_path, "links.json", content)
    message = error_of(load_links, path)
    assert message.startswith(path + ":"), message
    for part in expected:
        assert part in message, (part, message)


def test_file_errors_give_field_after_node(tmp_path):
    path = write(tmp_path, "links.json", {"n1": [link(dest="n2"), link(dest="n3"), link(dest="n2", bw="5mbit")]})
    assert error_of(load_links, path) == f"{path}: node 'n1', link 2 (to 'n2'): duplicate link n1 -> n2 " \
                                         "(each direction is declared once)"


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.json")
    assert error_of(load_links, path).startswith(f"{path}: cannot read")


def declared(tmp_path, *names):
    return load_nodes(write(tmp_path, "nodes.json", {"nodes": [{"name": n} for n in names]}))


def test_link_to_undeclared_node(tmp_path):
    links = write(tmp_path, "links.json", {"a": [link(), link(dest="n9")]})
    message = error_of(load_links, links, declared(tmp_path, "a", "b"), nodes_declared=True)
    assert message.startswith(f"{links}: node 'a', link 1 (to 'n9'), field 'dest': unknown node 'n9'"), message
    assert "declared nodes: a, b" in message


def test_link_from_undeclared_node(tmp_path):
    links = write(tmp_path, "links.json", {"a": [link()], "zz": []})
    message = error_of(load_links, links, declared(tmp_path, "a", "b"), nodes_declared=True)
    assert message.startswith(f"{links}: node 'zz': unknown node 'zz'"), message


BAD_NODES = [
    ("duplicate node", {"nodes": [{"name": "a"}, {"name": "a"}]}, ["node 'a'", "declared twice"]),
    ("cpu zero", {"nodes": [{"name": "a", "cpu": 0}]}, ["node 'a'", "field 'cpu'", "got 0"]),
    ("cpu negative", {"nodes": [{"name": "a", "cpu": -1}]}, ["node 'a'", "field 'cpu'"]),
    ("cpu too many", {"nodes": [{"name": "a", "cpu": 2000}]}, ["node 'a'", "field 'cpu'", "1024"]),
    ("cpu string", {"nodes": [{"name": "a", "cpu": "half"}]}, ["node 'a'", "field 'cpu'", "'half'"]),
    ("cpu bool", {"nodes": [{"name": "a", "cpu": True}]}, ["node 'a'", "field 'cpu'"]),
    ("mem unit", {"nodes": [{"name": "a", "mem": "256X"}]}, ["node 'a'", "field 'mem'", "256X"]),
    ("mem negative", {"nodes": [{"name": "a", "mem": "-1M"}]}, ["node 'a'", "field 'mem'"]),
    ("mem tiny", {"nodes": [{"name": "a", "mem": "1K"}]}, ["node 'a'", "field 'mem'", "4M"]),
    ("kind", {"nodes": [{"name": "a", "kind": "virtual"}]}, ["node 'a'", "field 'kind'", "virtual"]),
    ("physical without ip", {"nodes": [{"name": "a", "kind": "physical"}]}, ["node 'a'", "field 'ip'"]),
    ("bad ip", {"nodes": [{"name": "a", "kind": "physical", "ip": "10.0.0.300"}]}, ["node 'a'", "field 'ip'", "300"]),
    ("ip as number", {"nodes": [{"name": "a", "kind": "physical", "ip": 167772161}]}, ["field 'ip'", "167772161"]),
    ("ip with shell", {"nodes": [{"name": "a", "kind": "physical", "ip": "1.2.3.4; reboot"}]}, ["field 'ip'"]),
    ("unspecified ip", {"nodes": [{"name": "a", "kind": "physical", "ip": "0.0.0.0"}]}, ["field 'ip'"]),
    ("duplicate ip", {"nodes": [{"name": "p", "kind": "physical", "ip": "10.0.0.2"},
                                {"name": "q", "kind": "physical", "ip": "10.0.0.2"}]},
     ["node 'q'", "field 'ip'", "node 'p'"]),
    ("physical with cpu", {"nodes": [{"name": "a", "kind": "physical", "ip": "10.0.0.2", "cpu": 1}]},
     ["node 'a'", "field 'cpu'", "emulated nodes only"]),
    ("emulated with ip", {"nodes": [{"name": "a", "ip": "10.0.0.2"}]}, ["node 'a'", "field 'ip'"]),
    ("unknown field", {"nodes": [{"name": "a", "cores": 2}]}, ["nodes[0]", "'cores'", "valid fields: name"]),
    ("no name", {"nodes": [{"cpu": 1}]}, ["nodes[0]", "missing field 'name'"]),
    ("shell name", {"nodes": [{"name": "$(reboot)"}]}, ["nodes[0]", "field 'name'", "$(reboot)"]),
    ("bad host", {"nodes": [{"name": "a", "host": "x y"}]}, ["node 'a'", "field 'host'", "'x y'"]),
    ("entry not an object", {"nodes": ["a"]}, ["nodes[0]", "expected an object"]),
    ("nodes not a list", {"nodes": {"name": "a"}}, ["field 'nodes'", "list"]),
    ("no nodes", {"nodes": []}, ["declares no nodes"]),
    ("no nodes key", {"node": []}, ["expected an object like"]),
    ("bad version", {"version": 2, "nodes": [{"name": "a"}]}, ["field 'version'", "2"]),
    ("invalid JSON", '{"nodes": [{"name": "a",}]}', ["invalid JSON at line 1, column 25"]),
]


@pytest.mark.parametrize("content,expected", [c[1:] for c in BAD_NODES], ids=[c[0] for c in BAD_NODES])
def test_bad_nodes(tmp_path, content, expected):
    path = write(tmp_path, "nodes.json", content)
    message = error_of(load_nodes, path)
    assert message.startswith(path), message
    for part in expected:
        assert part in message, (part, message)
