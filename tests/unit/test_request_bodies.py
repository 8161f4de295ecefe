"""The agent's request bodies are checked by worker.api.schema: errors name the request and the field."""
import pytest

from worker.api import bodies
from worker.api.errors import ConfigError
from worker.api.schema import ABSENT, IPV4_ADDRESS, Field, Schema
from worker.nodes.runtime import NodeSpec

LINK = {"src": "a", "dst": "b", "dst_ip": "10.0.0.3", "shape": {"rate_bps": 10**6}}


def check(schema, body):
    return schema.validate(body, bodies.REQUEST)


def test_a_links_update_is_filled_in():
    body = check(bodies.SET_LINKS, {"version": 1, "links": [LINK], "access": {"a": {"uplink_bps": None}},
                                      "unshaped": {"b": [{"dst": "a", "dst_ip": "10.0.0.2"}]}})
    assert body["links"] == [LINK] and "isolation" not in body  # absent: each node keeps its own
    assert body["access"] == {"a": {"uplink_bps": None}}  # a side left out keeps its rate
    assert check(bodies.SET_LINKS, {"version": 1, "links": []})["unshaped"] == {}


@pytest.mark.parametrize("body,says", [
    ({"version": 1}, "request: missing field 'links'"),
    ({"version": 1, "links": {}}, "field 'links': expected a list"),
    ({"version": 1, "links": [{**LINK, "dst_ip": "10.0.0"}]}, "links\\[0\\], field 'dst_ip': '10.0.0' is not an IPv4"),
    ({"version": 1, "links": [{"src": "a", "dst": "b", "shape": None}]}, "links\\[0\\]: missing field 'dst_ip'"),
    ({"version": 1, "links": [{**LINK, "shap": {}}]}, "field 'shap': unknown field; did you mean 'shape'"),
    ({"version": 1, "links": [], "access": {"a": {"uplink_bps": 4}}},
     "request: access, a, field 'uplink_bps': must be an integer in \\[8, "),
    ({"version": 1, "links": [], "access": {"a": {"uplink": 10**6}}}, "did you mean 'uplink_bps'"),
    ({"version": 1, "links": [], "unshaped": {"a": [{"dst": "b"}]}}, "missing field 'dst_ip'"),
    ({"version": 1, "links": [], "unshaped": {"a": [{"dst": "b", "dst_ip": "x", }]}}, "'x' is not an IPv4 address"),
    ({"version": 1, "links": [], "isolaton": {"open": True}}, "did you mean 'isolation'"),
])
def test_bad_links_updates_name_the_field(body, says):
    with pytest.raises(ConfigError, match=says):
        check(bodies.SET_LINKS, body)


@pytest.mark.parametrize("schema,body,says", [
    (bodies.START_PROCESS, {"version": 1, "argv": []}, "field 'argv': must hold at least 1"),
    (bodies.START_PROCESS, {"version": 1, "argv": ["sh", 1]}, "field 'argv\\[1\\]': expected a string"),
    (bodies.START_PROCESS, {"version": 1, "argv": ["sh"], "env": {"A": 1}}, "env, field 'A': expected a string"),
    (bodies.START_NODE, {"version": 1}, "missing field 'args'"),
    (bodies.START_NODE, {"version": 1, "args": "--name a"}, "field 'args': expected a list"),
    (bodies.EXEC, {"version": 1, "argv": ["true"], "timeout_s": "soon"}, "field 'timeout_s': expected a number"),
    (bodies.EXEC, {"version": 1, "argv": ["true"], "timeout_s": 0}, "field 'timeout_s': must be a number in \\(0,"),
    (bodies.START_CAPTURE, {"version": 1, "snap_bytes": True}, "field 'snap_bytes': expected an integer"),
    (bodies.SET_LINKS, {"version": 1, "links": [], "access": {"a": {"uplink_bps": "1mbit"}}},
     "access, a, field 'uplink_bps': expected an integer"),
    (bodies.SET_LINKS, {"version": 1, "links": [], "access": {"a": {"up": 10**6}}}, "access, a, field 'up': unknown field"),
    (bodies.CREATE_NODES, {"version": 1, "nodes": {}}, "field 'nodes': expected a list"),
])
def test_bad_requests_name_the_field(schema, body, says):
    with pytest.raises(ConfigError, match=says):
        check(schema, body)


def test_process_requests_normalise():
    assert check(bodies.START_PROCESS, {"version": 1, "argv": ["sh"], "env": None})["env"] is None
    assert check(bodies.EXEC, {"version": 1, "argv": ["true"]})["timeout_s"] == 60.0
    assert "snap_bytes" not in check(bodies.START_CAPTURE, {"version": 1})


def test_a_node_of_a_request_is_named_by_index_and_name():
    with pytest.raises(ConfigError, match="request: nodes\\[2\\] \\(n3\\), field 'cpus': unknown field; did you mean"):
        NodeSpec.from_dict({"name": "n3", "cpus": 1}, "request: nodes[2]")
    with pytest.raises(ConfigError, match="node 'n3': field 'mem_bytes'"):
        NodeSpec("n3", mem_bytes=10).check()


def test_schema_nullable_absent_map_and_parse():
    schema = Schema({"a": Field(int, nullable=True, low=0, high=9), "b": Field(int, default=ABSENT),
                     "m": Field(dict, values=Field(int), default={}), "ip": IPV4_ADDRESS})
    assert schema.validate({"a": None, "ip": "10.0.0.1"}, "x") == {"a": None, "m": {}, "ip": "10.0.0.1"}
    assert schema.validate({"b": 3, "m": {"k": 1}}, "x") == {"a": None, "b": 3, "m": {"k": 1}, "ip": None}
    with pytest.raises(ConfigError, match="x: field 'a': expected an integer in \\[0, 9\\] or null, got the string"):
        schema.validate({"a": "no"}, "x")
    with pytest.raises(ConfigError, match="x: m, field 'k': expected an integer"):
        schema.validate({"m": {"k": "1"}}, "x")
    with pytest.raises(ConfigError, match="x: field 'ip': '10.0.0.256' is not an IPv4 address"):
        schema.validate({"ip": "10.0.0.256"}, "x")


def test_check_keys_leaves_values_alone():
    schema = Schema({"name": Field(str, required=True), "n": Field(int)})
    assert schema.check_keys({"name": 3, "n": "x"}, "f") == {"name": 3, "n": "x"}
    with pytest.raises(ConfigError, match="f: missing field 'name'"):
        schema.check_keys({"n": 1}, "f")
    with pytest.raises(ConfigError, match="f: field 'nme': unknown field; did you mean 'name'"):
        schema.check_keys({"nme": 1}, "f")
