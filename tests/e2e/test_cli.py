"""The edgetb command as a user runs it: up, status, exec, shape, down; bad input creates nothing."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]


def run(args: list[str], env: dict[str, str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "controller", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=120, **kw)
    if check and done.returncode != 0:
        raise AssertionError(f"edgetb {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture
def cli(tmp_path):
    """An environment with its own testbed id, subnet and state dir; always taken down."""
    tb = "c" + secrets.token_hex(2)
    env = dict(os.environ, EDGETB_ID=tb, EDGETB_SUBNET="10.231.0.0/16", EDGETB_STATE_DIR=str(tmp_path / "state"))
    yield env
    run(["down"], env, check=False)
    from worker.nodes.netns import NetnsRuntime
    from worker.state import StateStore

    left = NetnsRuntime(StateStore(tb, str(tmp_path / "state")), "10.231.0.0/16").leftovers()
    assert not any(left.values()), left


def write(tmp_path: Path, name: str, data: object) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def netns_of(env: dict[str, str]) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"etb-{env['EDGETB_ID']}-")]


def test_up_status_exec_shape_down(cli, tmp_path):
    links = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "10mbit"}], "b": [{"dest": "a", "bw": "5mbps"}]})
    nodes = write(tmp_path, "nodes.json", {"nodes": [{"name": "a", "cpu": 0.5, "mem": "128M"}, {"name": "b"}]})
    up = run(["up", links, "--nodes", nodes], cli)
    assert "ready in" in up.stderr
    status = json.loads(run(["status", "--json"], cli).stdout)
    by_name = {n["name"]: n for n in status["nodes"]}
    assert by_name["a"]["ip"] == "10.231.0.2" and by_name["b"]["ip"] == "10.231.0.3"
    assert by_name["a"]["cpu"] == 0.5 and by_name["a"]["mem_bytes"] == 128 * 2**20
    assert all(n["shaped"] for n in status["nodes"])

    # exec passes output and exit code through
    addr = run(["exec", "a", "--", "ip", "-br", "addr", "show", "eth0"], cli)
    assert "10.231.0.2/16" in addr.stdout
    assert run(["exec", "a", "--", "sh", "-c", "exit 7"], cli, check=False).returncode == 7
    assert run(["exec", "b", "--", "ping-does-not-exist"], cli, check=False).returncode != 0

    # 5mbps is 40 Mbit/s: bytes per second, as in tc
    show = json.loads(run(["shape", "show", "b", "--json"], cli).stdout)
    assert show["verified"] is True
    assert show["kernel"]["classes"]["1:10"]["rate_bps"] == 40_000_000
    text = run(["shape", "show", "a"], cli).stdout
    assert "rate 10mbit" in text and "verified: yes" in text

    # change one link in place
    run(["shape", "set", "a", "b", "30mbit"], cli)
    show = json.loads(run(["shape", "show", "a", "--json"], cli).stdout)
    assert show["kernel"]["classes"]["1:10"]["rate_bps"] == 30_000_000 and show["verified"]

    # re-shape from an edited file: a->b changes, b->a is removed
    edited = write(tmp_path, "links2.json", {"a": [{"dest": "b", "bw": "2mbit"}]})
    run(["shape", "update", edited], cli)
    assert json.loads(run(["shape", "show", "a", "--json"], cli).stdout)["kernel"]["classes"]["1:10"]["rate_bps"] == 2_000_000
    assert json.loads(run(["status", "--json"], cli).stdout)["nodes"][1]["links"] == 0
    # b keeps its isolation (no link, no path) and answers a, which still links to it, unshaped
    show_b = json.loads(run(["shape", "show", "b", "--json"], cli).stdout)
    assert show_b["verified"] and [p["dest"] for p in show_b["plan"]["passes"]] == ["", "a"]

    # up twice is refused and leaves the running testbed alone
    again = run(["up", links], cli, check=False)
    assert again.returncode == 2 and "already up" in again.stderr
    assert len(netns_of(cli)) == 2

    down = run(["down"], cli)
    assert "removed 2 nodes" in down.stderr
    assert netns_of(cli) == []


def test_up_open_network_leaves_nodes_without_drop_filters(cli, tmp_path):
    links = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "10mbit"}], "b": [{"dest": "a", "bw": "5mbit"}],
                                           "c": []})
    run(["up", links, "--open-network"], cli)
    for node in "ab":
        plan = json.loads(run(["shape", "show", node, "--json"], cli).stdout)["plan"]
        assert plan["rules"] and not plan["drops"], plan
    run(["down"], cli)
    run(["up", links], cli)  # the default: no link, no path
    assert json.loads(run(["shape", "show", "a", "--json"], cli).stdout)["plan"]["drops"] == ["10.231.0.0/16"]


BAD_LINKS = [
    ({"a": [{"dest": "b", "bw": "10mbitt"}]}, ["links.json", "a", "bw", "10mbitt"]),
    ({"a": [{"dest": "b", "bw": "10"}]}, ["links.json", "a", "bw"]),
    ({"a; rm -rf /": [{"dest": "b", "bw": "1mbit"}]}, ["links.json", "a; rm -rf /"]),
    ({"a": [{"dest": "a", "bw": "1mbit"}]}, ["links.json", "a"]),
    ('{"a": [{"dest": "b", "bw": "1mbit"}', ["links.json"]),
]


@pytest.mark.parametrize("content,expected", BAD_LINKS)
def test_bad_links_create_nothing(cli, tmp_path, content, expected):
    links = write(tmp_path, "links.json", content)
    done = run(["up", links], cli, check=False)
    assert done.returncode == 2, done.stderr
    for part in expected:
        assert part in done.stderr, (part, done.stderr)
    assert netns_of(cli) == []


def test_unknown_node_in_nodes_file_creates_nothing(cli, tmp_path):
    links = write(tmp_path, "links.json", {"a": [{"dest": "zz", "bw": "1mbit"}]})
    nodes = write(tmp_path, "nodes.json", {"nodes": [{"name": "a"}]})
    done = run(["up", links, "--nodes", nodes], cli, check=False)
    assert done.returncode == 2 and "zz" in done.stderr
    assert netns_of(cli) == []


def test_delay_without_netem_is_refused_before_anything_exists(cli, tmp_path):
    from worker.shaping.apply import netem_available

    if netem_available():
        pytest.skip("this kernel has sch_netem: delay is supported here")
    links = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "1mbit", "delay": "20ms"}]})
    done = run(["up", links], cli, check=False)
    assert done.returncode == 1
    assert "sch_netem" in done.stderr and "a->b" in done.stderr
    assert netns_of(cli) == []


DROP_ALL_PRIVILEGES = ["setpriv", "--securebits", "+noroot,+noroot_locked,+no_setuid_fixup,+no_setuid_fixup_locked",
                       "--bounding-set", "-all", "--inh-caps", "-all", "--"]


@pytest.mark.skipif(not shutil.which("setpriv"), reason="setpriv (util-linux) not installed")
def test_dry_run_needs_no_privileges(tmp_path):
    """--dry-run prints the plan as tc commands with every capability dropped (so it touches nothing)."""
    links = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "5mbps", "queue": 50}]})
    env = dict(os.environ, EDGETB_ID="dry", EDGETB_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run([*DROP_ALL_PRIVILEGES, sys.executable, "-m", "controller", "up", links, "--dry-run"],
                          cwd=ROOT, env=env, text=True, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ip netns exec etb-dry-a tc class add dev eth0 parent 1:3 classid 1:10 htb rate 40mbit ceil 40mbit" in done.stdout
    assert "pfifo limit 50" in done.stdout
    assert "match ip dst 10.77.0.3/32 flowid 1:10" in done.stdout
    assert not (tmp_path / "state").exists()
    # the same process without --dry-run cannot do anything: the privileges really are gone
    real = subprocess.run([*DROP_ALL_PRIVILEGES, sys.executable, "-m", "controller", "up", links], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=60)
    assert real.returncode != 0


def test_access_links_from_the_nodes_file_and_changed_in_place(cli, tmp_path):
    links = write(tmp_path, "links.json", {"a": [{"dest": "b", "bw": "20mbit"}, {"dest": "c", "bw": "20mbit"}],
                                           "b": [{"dest": "a", "bw": "20mbit"}], "c": [{"dest": "a", "bw": "20mbit"}]})
    nodes = write(tmp_path, "nodes.json", {"defaults": {"downlink": "8mbit"},
                                           "nodes": [{"name": "a", "uplink": "10mbit"}, {"name": "b"}, {"name": "c"}]})
    dry = run(["up", links, "--nodes", nodes, "--dry-run"], cli).stdout
    assert "classid 1:3 htb rate 10mbit ceil 10mbit" in dry and "action mirred egress redirect" in dry
    run(["up", links, "--nodes", nodes], cli)
    show = json.loads(run(["shape", "show", "a", "--json"], cli).stdout)
    assert show["verified"], show["mismatches"]
    assert show["kernel"]["classes"]["1:3"]["rate_bps"] == 10_000_000
    assert show["kernel"]["classes"]["1:10"] == {"rate_bps": 5_000_000, "ceil_bps": 20_000_000, "parent": "1:3"}
    share = 8_000_000 // 3 // 8 * 8  # b, c and the default class
    down = show["kernel"]["downlink"]
    assert down["rate_bps"] == 8_000_000 and down["redirect"] and down["default_bps"] == share
    assert sorted(down["peers"].values()) == [share, share] and len(down["peers"]) == 2
    text = run(["shape", "show", "a"], cli).stdout
    assert "(access: the uplink)" in text and "downlink 8mbit: ingress redirected to an IFB: yes" in text
    assert "shared by 2 peers and the default class" in text
    run(["shape", "access", "a", "--uplink", "4mbit", "--downlink", "none"], cli)
    show = json.loads(run(["shape", "show", "a", "--json"], cli).stdout)
    assert show["verified"] and show["kernel"]["classes"]["1:3"]["rate_bps"] == 4_000_000
    assert show["kernel"]["classes"]["1:10"]["rate_bps"] == 2_000_000  # an equal share of the new uplink
    assert show["kernel"]["downlink"] == {"rate_bps": None, "redirect": False, "peers": {}, "default_bps": None}
    bad = run(["shape", "access", "a", "--uplink", "4mb"], cli, check=False)
    assert bad.returncode != 0 and "--uplink" in bad.stderr


def test_scenario_is_checked_against_the_testbed_that_is_up(cli, tmp_path):
    """A testbed up from some/dir/links.json (nodes s1, s2): ``edgetb scenario`` run where
    another links.json lies (the repository's: n1 ... n8) checks and plays the scenario
    against the testbed's own nodes and links; --links belongs to --dry-run."""
    topo = tmp_path / "some" / "dir"
    topo.mkdir(parents=True)
    links = write(topo, "links.json", {"s1": [{"dest": "s2", "bw": "10mbit"}], "s2": [{"dest": "s1", "bw": "10mbit"}]})
    run(["up", links, "--nodes", write(topo, "nodes.json", {"nodes": [{"name": "s1", "cpu": 0.5}, {"name": "s2"}]})],
        cli)
    scenario = write(tmp_path, "scenario.json", {"events": [
        {"at": 0.1, "link": {"src": "s1", "dst": "s2", "bw": "2mbit"}, "for": 0.5},
        {"at": 0.2, "cpu": {"node": "s1", "cores": 0.25}, "for": 0.5}]})
    played = run(["scenario", scenario], cli)  # cwd: the repository, whose links.json has n1 ... n8
    assert "unknown node" not in played.stderr, played.stderr
    assert "4 steps applied" in played.stderr and "0 failed" in played.stderr, played.stderr
    assert "cpu 0.5 cores" in played.stdout, played.stdout  # undone to the testbed's own limit
    show = json.loads(run(["shape", "show", "s1", "--json"], cli).stdout)
    assert show["kernel"]["classes"]["1:10"]["rate_bps"] == 10_000_000 and show["verified"]  # restored from the state
    refused = run(["scenario", scenario, "--links", links], cli, check=False)
    assert refused.returncode != 0 and "--links and --nodes are for --dry-run" in refused.stderr, refused.stderr
    dry = run(["scenario", scenario, "--dry-run", "--links", links], cli)
    assert "4 steps" in dry.stdout, dry.stdout
