"""hosts.json, node placement, the routes plan and the cluster's fan-out (pure logic, fake workers)."""
from __future__ import annotations

import json

import pytest

from controller.model.hosts import Host, Hosts, check_placement, load_hosts, plan_routes
from controller.model.topology import Topology
from controller.workers.cluster import Cluster
from controller.workers.deploy import node_requests, planned_ips
from worker.api.errors import ConfigError, NotFound, TopologyError


def write(tmp_path, data) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_hosts_file(tmp_path):
    hosts = load_hosts(write(tmp_path, {"version": 1, "hosts": [
        {"name": "local", "runtime": "docker"},
        {"name": "e1", "agent": "http://10.254.0.2:3334"},
        {"name": "pi", "agent": "http://pi.lan:3334", "ip": "10.254.0.9", "runtime": "physical",
         "nfs": "10.254.0.1:/srv/edgetb"}]}))
    assert hosts.controller_ip is None
    assert hosts.hosts["local"] == Host("local", "docker")
    assert hosts.hosts["e1"] == Host("e1", "netns", "http://10.254.0.2:3334", "10.254.0.2")
    assert hosts.hosts["pi"].ip == "10.254.0.9" and hosts.hosts["pi"].nfs == "10.254.0.1:/srv/edgetb"


@pytest.mark.parametrize("entry,words", [
    ({"name": "a;b"}, ["hosts[0]", "'name'"]),
    ({"name": "e", "runtime": "vm"}, ["hosts[0] (e)", "'runtime'", "vm"]),
    ({"name": "e", "agent": "ftp://x"}, ["'agent'", "ftp://x"]),
    ({"name": "e", "agent": "http://e1.lan:3334"}, ["'ip'", "e1.lan"]),
    ({"name": "e", "agent": "http://10.0.0.2:1", "ip": "10.0.0.300"}, ["'ip'", "10.0.0.300"]),
    ({"name": "pi", "runtime": "physical"}, ["'agent'", "own agent"]),
    ({"name": "e", "agent": "http://10.0.0.2:1", "nfs": "x:/a;reboot"}, ["'nfs'"]),
    ({"name": "e", "cpu": 2}, ["unknown field", "'cpu'"]),
])
def test_bad_hosts_say_what_and_where(tmp_path, entry, words):
    with pytest.raises(TopologyError) as e:
        load_hosts(write(tmp_path, {"hosts": [entry]}))
    assert all(w in e.value.message for w in words), e.value.message


def test_one_in_process_host_and_unique_names(tmp_path):
    with pytest.raises(TopologyError, match="only one host"):
        load_hosts(write(tmp_path, {"hosts": [{"name": "a"}, {"name": "b"}]}))
    with pytest.raises(TopologyError, match="only one host"):  # a loopback agent shares the machine too
        load_hosts(write(tmp_path, {"hosts": [{"name": "a"}, {"name": "b", "agent": "http://127.0.0.1:3334"}]}))
    with pytest.raises(TopologyError, match="declared twice"):
        load_hosts(write(tmp_path, {"hosts": [{"name": "a"}, {"name": "a", "agent": "http://1.2.3.4:1"}]}))


def topology() -> Topology:
    t = Topology()
    t.add_node("n1", host="e1")
    t.add_node("n2", host="local")
    t.add_node("n3", host="e1")
    t.add_node("pi", "physical", host="pi", ip="10.254.0.9")
    return t


HOSTS = Hosts({"local": Host("local", "docker"), "e1": Host("e1", "netns", "http://10.254.0.2:1", "10.254.0.2"),
               "pi": Host("pi", "physical", "http://10.254.0.9:1", "10.254.0.9")}, "10.254.0.1")


def test_placement_and_requests():
    t = topology()
    assert check_placement(t, HOSTS) == {"n1": "e1", "n2": "local", "n3": "e1", "pi": "pi"}
    assert node_requests(t)["nodes"][3] == {"name": "pi", "cpu": None, "mem_bytes": None, "ip": "10.254.0.9"}
    ips = planned_ips(t, "10.77.0.0/16", {"e1": "10.78.0.0/16"})
    assert ips == {"n1": "10.78.0.2", "n2": "10.77.0.2", "n3": "10.78.0.3", "pi": "10.254.0.9"}
    t.add_node("n4", host="nowhere")
    with pytest.raises(TopologyError, match="unknown host 'nowhere'"):
        check_placement(t, HOSTS)
    t = Topology()
    t.add_node("x", host="pi")
    with pytest.raises(TopologyError, match="need a physical host|need an emulator host"):
        check_placement(t, HOSTS)
    t = Topology()
    t.add_node("p1", "physical", host="pi", ip="10.254.0.9")
    t.add_node("p2", "physical", host="pi", ip="10.254.0.10")
    with pytest.raises(TopologyError, match="one physical device"):
        check_placement(t, HOSTS)
    with pytest.raises(TopologyError, match="single"):
        check_placement(t, Hosts.single(), "the single-host default")


def test_routes_plan():
    plan = plan_routes({"local": "10.77.0.0/16", "e1": "10.78.0.0/16"},
                       {"local": "10.254.0.1", "e1": "10.254.0.2", "pi": "10.254.0.9"}, "10.254.0.1", "local")
    assert set(plan) == {"local", "e1", "pi"}  # the controller shares the local host's stack
    assert plan["local"]["routes"] == [{"subnet": "10.78.0.0/16", "via": "10.254.0.2"}]
    assert plan["e1"]["routes"] == [{"subnet": "10.77.0.0/16", "via": "10.254.0.1"}]
    assert plan["pi"]["routes"] == [{"subnet": "10.78.0.0/16", "via": "10.254.0.2"},
                                    {"subnet": "10.77.0.0/16", "via": "10.254.0.1"}]
    assert "10.78.0.0/16" not in plan["e1"]["peers"] and "10.254.0.9/32" in plan["e1"]["peers"]
    alone = plan_routes({"e1": "10.78.0.0/16"}, {"e1": "10.254.0.2"}, "10.254.0.1", None)
    assert alone[None]["routes"] == [{"subnet": "10.78.0.0/16", "via": "10.254.0.2"}]


class FakeWorker:
    def __init__(self, runtime: str, subnet: str | None, fail: bool = False) -> None:
        self.runtime, self.subnet, self.fail = runtime, subnet, fail
        self.calls: list[tuple] = []

    def capabilities(self):
        return {"runtime": self.runtime, "subnet": self.subnet, "netem": False, "cgroup_version": 1, "kernel": "k"}

    def create_nodes(self, body):
        self.calls.append(("create", [n["name"] for n in body["nodes"]]))
        if self.fail:
            raise NotFound("boom")
        return {"nodes": [{"name": n["name"], "ip": "ip-" + n["name"]} for n in body["nodes"]]}

    def set_routes(self, body):
        self.calls.append(("routes", body["routes"]))
        return {}

    def set_links(self, body, merge=False):
        self.calls.append(("links", [(l["src"], l["dst"]) for l in body["links"]]))
        return {"nodes": [l["src"] for l in body["links"]], "seconds": 0.1}

    def reset(self):
        self.calls.append(("reset",))
        if self.fail:
            raise NotFound("gone")
        return {"removed": {"nodes": 1}}


def cluster(fail_e1: bool = False) -> tuple[Cluster, dict[str, FakeWorker]]:
    workers = {"local": FakeWorker("docker", "10.77.0.0/16"), "e1": FakeWorker("netns", "10.78.0.0/16", fail_e1),
               "pi": FakeWorker("physical", None)}
    return Cluster(HOSTS, check_placement(topology(), HOSTS), dict(workers), workers["local"], "10.254.0.1"), workers


def test_cluster_splits_work_by_host_and_routes_after_creating():
    c, w = cluster()
    c.check_hosts()
    created = c.create_nodes(node_requests(topology()))
    assert [n["name"] for n in created["nodes"]] == ["n1", "n2", "n3", "pi"]
    assert created["nodes"][0]["host"] == "e1"
    assert w["e1"].calls == [("create", ["n1", "n3"]), ("routes", [{"subnet": "10.77.0.0/16", "via": "10.254.0.1"}])]
    assert w["local"].calls[1] == ("routes", [{"subnet": "10.78.0.0/16", "via": "10.254.0.2"}])
    c.set_links({"version": 1, "links": [{"src": "n1", "dst": "pi"}, {"src": "pi", "dst": "n2"}]})
    assert w["e1"].calls[-1] == ("links", [("n1", "pi")]) and w["pi"].calls[-1] == ("links", [("pi", "n2")])
    with pytest.raises(NotFound):
        c.set_links({"version": 1, "links": [{"src": "ghost", "dst": "n1"}]})


def test_cluster_checks_runtimes_and_subnets():
    c, w = cluster()
    w["e1"].runtime = "docker"
    with pytest.raises(ConfigError, match="--runtime netns"):
        c.check_hosts()
    c, w = cluster()
    w["e1"].subnet = "10.77.128.0/17"
    with pytest.raises(ConfigError, match="overlapping"):
        c.check_hosts()


def test_cluster_failure_names_the_host_and_reset_reaches_every_host():
    c, w = cluster(fail_e1=True)
    c.check_hosts()
    with pytest.raises(NotFound, match="host e1: boom"):
        c.create_nodes(node_requests(topology()))
    with pytest.raises(NotFound, match="reset failed on e1: gone") as failed:  # an error, after trying every host
        c.reset()
    removed = failed.value.detail["removed"]
    assert removed["e1"] == {"error": "gone"} and removed["pi"] == {"nodes": 1} and removed["local"] == {"nodes": 1}


def test_a_loopback_agent_shares_the_controllers_stack(tmp_path):
    hosts = load_hosts(write(tmp_path, {"hosts": [
        {"name": "local", "agent": "http://127.0.0.1:3334", "runtime": "docker"},
        {"name": "e1", "agent": "http://10.254.0.2:3334"}]}))
    assert hosts.hosts["local"].local and hosts.hosts["local"].ip is None and not hosts.hosts["e1"].local
    assert Host("x", agent="http://localhost:1").local and Host("x").local


def test_a_cluster_of_one_loopback_agent_reaches_the_controller_by_its_bridge():
    hosts = Hosts({"local": Host("local", "docker", "http://127.0.0.1:3334")})
    fake = FakeWorker("docker", "10.77.0.0/16")
    fake.sync = lambda body: fake.calls.append(("sync", body["url"])) or {"method": "http", "fetched": 1, "bytes": 1,
                                                                          "unchanged": 0}
    c = Cluster(hosts, {"n1": "local"}, {"local": fake}, fake, "10.77.0.1")
    c.sync_code("http://10.77.0.1:3333", "t", lambda m: None)
    assert fake.calls == [("sync", "http://127.0.0.1:3333")]  # the bridge is not up before its nodes
    c.check_hosts()
    c.install_routes()
    assert fake.calls[-1] == ("routes", [])  # nothing to route: one stack
    assert c.reset()["removed"] == {"local": {"nodes": 1}}  # no second reset of the same stack


def test_a_run_is_refused_before_anything_is_made_when_a_worker_cannot_shape_it_or_does_not_answer():
    from controller.workers.deploy import refusal
    from worker.api.errors import TestbedError

    class Worker:
        def __init__(self, caps):
            self.caps = caps

        def capabilities(self):
            if self.caps is None:
                raise TestbedError("agent gone (https://10.0.0.7:3334): GET /capabilities: no route to host")
            return self.caps

    t = Topology()
    t.add_node("n1", cpu=0.5)
    assert refusal(t, Worker({"netem": False, "cgroup_version": 2})) is None
    assert refusal(t, Worker({"netem": True, "cgroup_version": None})) == (
        2, "the worker has no usable cgroups, so the limits of n1 cannot be set")  # (bad input's code)
    code, why = refusal(t, Worker(None))  # (a failed deploy's code: nothing was made either)
    assert code == 1 and "agent gone" in why
