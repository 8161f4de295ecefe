"""Docker hosts on one machine: each host namespace of a ``Lan`` runs its own dockerd (its own data
root, exec root, socket and cgroup parent), holds the node image, and its agent makes Docker
nodes on that engine (``DOCKER_HOST`` in the agent's environment).

These engines stand in for the Docker engines of separate machines: they can join one swarm,
whose VXLAN data path then crosses the LAN between the host namespaces. Teardown leaves
nothing behind, and says what it could not remove (``SwarmLan.leftovers``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from tests.e2e.lan import Lan, netns_holders
from worker.api.errors import TestbedError
from worker.kernel import nsfs
from worker.nodes.docker_exec import sdk

LINK_GONE_S = 90.0  # a veth whose namespace went is freed by the kernel a bit later
DATA_BASE = Path("/var/lib/edgetb-test-swarm")  # on the disk, as the root engine's /var/lib/docker (overlay2 works there)
EXEC_BASE = Path("/run/edgetb-test-swarm")  # sockets and pid files, short paths (a unix socket path has 108 bytes)
CGROUP_BASE = Path("/sys/fs/cgroup")
ENGINE_START_TIMEOUT_S = 60.0
ENGINE_STOP_TIMEOUT_S = 20.0
API_TIMEOUT_S = 120
LOG_TAIL_CHARS = 3000
OVERLAY_SUBNET = "10.80.0.0/20"


def root_api(timeout_s: float = API_TIMEOUT_S) -> Any:
    """The root engine's client (this namespace's: ``DOCKER_HOST`` or the default socket)."""
    from worker.nodes import docker as runtime_docker

    return runtime_docker.connect(timeout_s)


def root_swarm_state() -> str:
    """The root engine's swarm state (inactive, active, ...)."""
    from worker.nodes.docker_swarm import swarm_of

    api = root_api()
    try:
        return swarm_of(api.info())["state"]
    finally:
        api.close()


def save_image(api: Any, image: str, path: Path) -> Path:
    """``docker save`` of ``image`` from engine ``api`` into the tar file ``path``."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        for chunk in api.get_image(image):
            f.write(chunk)
    tmp.rename(path)
    return path


def _unescape_mountinfo(field_text: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded."""
    out, i = [], 0
    while i < len(field_text):
        if field_text[i] == "\\" and i + 3 < len(field_text) and field_text[i + 1:i + 4].isdigit():
            out.append(chr(int(field_text[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field_text[i])
            i += 1
    return "".join(out)


def mounts_under(roots: Sequence[Path]) -> list[str]:
    """The mount points of this mount namespace at or below one of ``roots``, deepest first."""
    prefixes = [str(r).rstrip("/") for r in roots]
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = _unescape_mountinfo(line.split()[4])
            if any(point == p or point.startswith(p + "/") for p in prefixes):
                found.append(point)
    return sorted(set(found), key=len, reverse=True)


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    return " ".join(_argv(pid))


def _cgroups_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


@dataclass
class Engine:
    """One dockerd in host namespace ``netns``; every path of it is its own."""

    host: str
    netns: str
    data_root: Path
    exec_root: Path
    cgroup_parent: str
    log_path: Path
    proc: Optional[subprocess.Popen] = None
    problems: list[str] = field(default_factory=list)

    @property
    def socket_path(self) -> Path:
        return self.exec_root / "docker.sock"

    @property
    def docker_host(self) -> str:
        """The engine's address, as ``DOCKER_HOST`` takes it."""
        return f"unix://{self.socket_path}"

    @property
    def pidfile(self) -> Path:
        return self.exec_root / "docker.pid"

    def argv(self, storage_driver: str) -> list[str]:
        return ["nsenter", f"--net={nsfs.netns_path(self.netns)}", "dockerd", "--data-root", str(self.data_root),
                "--exec-root", str(self.exec_root), "-H", self.docker_host, "--pidfile", str(self.pidfile),
                "--cgroup-parent", self.cgroup_parent, "--storage-driver", storage_driver,
                "--config-file", str(self.config_path)]

    @property
    def config_path(self) -> Path:
        """Its daemon.json: its own identity key (the ``docker info`` ID), not the one in
        /etc/docker/key.json every engine of this machine reads (a setting with no flag)."""
        return self.exec_root / "daemon.json"

    def start(self, storage_driver: str) -> None:
        """Start dockerd (not waiting for it: see ``wait``); its log goes to ``log_path``."""
        self.data_root.mkdir(parents=True, exist_ok=False)
        self.exec_root.mkdir(parents=True, exist_ok=False)
        self.config_path.write_text(json.dumps({"deprecated-key-path": str(self.data_root / "key.json")}))
        self._spawn(storage_driver, "wb")

    def _spawn(self, storage_driver: str, log_mode: str) -> None:
        """dockerd on this engine's roots, its log to ``log_path`` (``wb``: a new log, ``ab``: appended)."""
        with open(self.log_path, log_mode) as log:
            self.proc = subprocess.Popen(self.argv(storage_driver), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")})

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no log: {e})"

    def api(self, timeout_s: float = API_TIMEOUT_S) -> Any:
        """A low-level client of this engine (not checked: see ``wait``)."""
        return sdk().APIClient(base_url=self.docker_host, version="auto", timeout=timeout_s)

    def wait(self, timeout_s: float = ENGINE_START_TIMEOUT_S) -> float:
        """Wait until the engine answers a ping; the seconds it took. AssertionError with the
        log's tail when it exits or does not answer in time."""
        assert self.proc is not None, f"the engine of {self.host} was not started"
        t0 = time.monotonic()
        last = "no answer yet"
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise AssertionError(f"the dockerd of {self.host} exited with {self.proc.returncode} "
                                     f"(log {self.log_path}):\n{self.log_tail()}")
            if self.socket_path.exists():
                try:
                    api = self.api(timeout_s=2)
                    try:
                        if api.ping():
                            return time.monotonic() - t0
                    finally:
                        api.close()
                except Exception as e:  # not listening yet, or answering 5xx while it starts
                    last = f"{type(e).__name__}: {e}"
            time.sleep(0.1)
        raise AssertionError(f"the dockerd of {self.host} did not answer at {self.docker_host} in {timeout_s:.0f} s "
                             f"({last}; log {self.log_path}):\n{self.log_tail()}")

    def load_image(self, tar: Path, image: str, image_id: Optional[str] = None) -> float:
        """``docker load`` of the tar into this engine; the seconds it took. AssertionError when the
        engine refuses it or then lacks ``image`` (or has it with another ID than ``image_id``)."""
        t0 = time.monotonic()
        api = self.api()
        try:
            with open(tar, "rb") as f:
                for message in api.load_image(f):
                    if isinstance(message, dict) and message.get("error"):
                        raise AssertionError(f"the engine of {self.host} did not load {tar}: {message['error']}")
            loaded = api.inspect_image(image)["Id"]
        finally:
            api.close()
        if image_id is not None and loaded != image_id:
            raise AssertionError(f"the engine of {self.host} has {image} as {loaded}, not {image_id}")
        return time.monotonic() - t0

    def gossip_listening(self) -> bool:
        """Whether this engine listens on the swarm's gossip port, 7946/tcp, in its namespace (an
        engine that has left a swarm can go on listening for minutes; a join meanwhile fails)."""
        out = subprocess.run(["nsenter", f"--net={nsfs.netns_path(self.netns)}", "ss", "-Htln", "sport", "=",
                              ":7946"], capture_output=True, text=True, timeout=10)
        return bool(out.stdout.strip())

    def restart(self, storage_driver: str) -> float:
        """Stop dockerd (it closes what it listens on) and start it again on the same roots, its
        images kept; the seconds it took."""
        t0 = time.monotonic()
        assert self.proc is not None, f"the engine of {self.host} was not started"
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=ENGINE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._kill_processes()
        self._spawn(storage_driver, "ab")
        self.wait()
        return time.monotonic() - t0

    # teardown ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Leave the swarm, remove every container, stop dockerd, then kill, unmount and remove
        whatever it left (shims, mounts, directories, cgroups). What failed is in ``problems``."""
        if self.proc is not None and self.proc.poll() is None:
            self._empty()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=ENGINE_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.problems.append(f"dockerd of {self.host} ignored SIGTERM for {ENGINE_STOP_TIMEOUT_S:.0f} s")
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._kill_processes()
        for _ in range(3):
            points = mounts_under([self.data_root, self.exec_root])
            if not points:
                break
            for point in points:
                nsfs.libc.umount2(point.encode(), nsfs.MNT_DETACH)
        for root in (self.data_root, self.exec_root):
            shutil.rmtree(root, ignore_errors=True)
        for path in self.cgroups():
            for dirpath, _dirs, _files in os.walk(path, topdown=False):
                try:
                    os.rmdir(dirpath)
                except OSError as e:
                    self.problems.append(f"cannot remove cgroup {dirpath}: {e.strerror}")

    def _empty(self) -> None:
        docker = sdk()
        try:
            api = self.api(timeout_s=30)
        except Exception as e:
            self.problems.append(f"no client of the engine of {self.host}: {e}")
            return
        try:
            if api.info()["Swarm"].get("LocalNodeState", "inactive") not in ("inactive", ""):
                api.leave_swarm(force=True)
            for container in api.containers(all=True):
                try:
                    api.remove_container(container["Id"], force=True)
                except docker.errors.NotFound:
                    pass
        except Exception as e:  # an engine that does not answer is stopped all the same
            self.problems.append(f"the engine of {self.host} did not empty: {e}")
        finally:
            api.close()

    def _owned(self, pid: int) -> bool:
        """Whether process ``pid`` belongs to this engine: its command line names one of its roots
        (dockerd, containerd, the shims), or it runs in one of its containers' cgroups."""
        roots = (str(self.data_root), str(self.exec_root))
        if any(word == root or word.startswith(root + "/") for word in _argv(pid) for root in roots):
            return True
        return any(self.cgroup_parent in line.rsplit(":", 1)[-1].split("/") for line in _cgroups_of(pid).splitlines())

    def processes(self) -> list[str]:
        """This engine's live processes, as ``pid command line``."""
        me = os.getpid()
        return [f"{pid} {_cmdline(pid)}" for pid in _pids() if pid != me and self._owned(pid) and _cmdline(pid)]

    def _kill_processes(self) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = [int(p.split(" ", 1)[0]) for p in self.processes()]
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def cgroups(self) -> list[str]:
        """The cgroup directories named for this engine (under any hierarchy, a few levels down:
        a relative cgroup parent lands under the cgroup of the engine in each hierarchy)."""
        found, seen = [], set()
        for hierarchy in sorted(CGROUP_BASE.iterdir()) if CGROUP_BASE.is_dir() else []:
            real = os.path.realpath(hierarchy)
            if real in seen or not os.path.isdir(real):
                continue
            seen.add(real)
            base_depth = real.count("/")
            for dirpath, dirs, _files in os.walk(real):
                if os.path.basename(dirpath) == self.cgroup_parent:
                    found.append(dirpath)
                    dirs[:] = []
                elif dirpath.count("/") - base_depth >= 3:
                    dirs[:] = []
        return found

    def leftovers(self) -> dict[str, list[str]]:
        """What is left of this engine: mounts, processes, directories, cgroups."""
        return {"mounts": mounts_under([self.data_root, self.exec_root]), "processes": self.processes(),
                "dirs": [str(p) for p in (self.data_root, self.exec_root) if p.exists()], "cgroups": self.cgroups()}


_environ_lock = threading.Lock()


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """This process's environment with ``values`` set for the body (``Lan.add_host`` copies it
    into the agent's)."""
    with _environ_lock:
        before = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _start_ticks(pid: int) -> Optional[str]:
    """When process ``pid`` started (clock ticks since boot): with the pid, names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(tag_dir: Path) -> bool:
    """Whether the process that made the engines under ``tag_dir`` (its ``owner`` file) lives."""
    try:
        pid, ticks = (tag_dir / "owner").read_text().split()
    except (OSError, ValueError):
        return False
    return _start_ticks(int(pid)) == ticks


def sweep_stale(grace_s: float = 60.0) -> list[str]:
    """Stop and remove the engines of test runs that died without their teardown (their owner
    process is gone); the tags swept. A tag directory with no owner file yet is left alone for
    ``grace_s`` (it may be being made)."""
    swept = []
    for tag_dir in sorted(DATA_BASE.iterdir()) if DATA_BASE.is_dir() else []:
        if _owner_alive(tag_dir):
            continue
        if not (tag_dir / "owner").exists() and time.time() - tag_dir.stat().st_mtime < grace_s:
            continue
        tag = tag_dir.name
        hosts = {p.name for base in (DATA_BASE, EXEC_BASE) if (base / tag).is_dir()
                 for p in (base / tag).iterdir() if p.is_dir()}
        for name in sorted(hosts):
            Engine(host=name, netns=f"mh{tag}{name}", data_root=DATA_BASE / tag / name,
                   exec_root=EXEC_BASE / tag / name, cgroup_parent=f"edgetb-test-swarm-{tag}-{name}",
                   log_path=Path(os.devnull)).stop()
        for base in (DATA_BASE, EXEC_BASE):
            shutil.rmtree(base / tag, ignore_errors=True)
        swept.append(tag)
    return swept


class SwarmLan(Lan):
    """A ``Lan`` whose hosts are Docker hosts: each its own dockerd in its namespace, with the node
    image, and an agent (``--runtime docker``) on that engine.

    Each host dict has Lan's keys (name, netns, ip, url, id, token, token_file, fingerprint, state,
    proc, log) and ``engine`` (an ``Engine``) and ``docker_host`` (its ``unix://`` address)."""

    def __init__(self, tmp: Path, image: Optional[str] = None, storage_driver: Optional[str] = None) -> None:
        super().__init__(tmp)
        from worker.nodes import docker as runtime_docker

        self.image = image or runtime_docker.node_image()
        # whose engines these are: ``sweep_stale`` removes them once this process is gone
        self.owner = DATA_BASE / self.tag / "owner"
        self.owner.parent.mkdir(parents=True, exist_ok=False)
        self.owner.with_suffix(".part").write_text(f"{os.getpid()} {_start_ticks(os.getpid())}\n")
        self.owner.with_suffix(".part").rename(self.owner)
        self.storage_driver = storage_driver
        self.engines: list[Engine] = []
        self.timings_s: dict[str, float] = {}
        self.problems: list[str] = []

    def add_docker_hosts(self, count: int, image_tar: Optional[Path], image_id: Optional[str] = None) -> list[dict]:
        """``count`` Docker hosts: their agents, then their engines started and loaded with the
        image in ``image_tar`` in parallel (``image_id``: the ID they must then have it with;
        no tar: no image)."""
        if self.storage_driver is None:
            api = root_api()
            try:
                self.storage_driver = api.info()["Driver"]
            finally:
                api.close()
        t0 = time.monotonic()
        new = []
        for _ in range(count):
            i = len(self.hosts)
            engine = Engine(host=f"h{i}", netns=f"mh{self.tag}h{i}", data_root=DATA_BASE / self.tag / f"h{i}",
                            exec_root=EXEC_BASE / self.tag / f"h{i}", cgroup_parent=f"edgetb-test-swarm-{self.tag}-h{i}",
                            log_path=self.tmp / f"dockerd-h{i}-{self.tag}.log")
            self.engines.append(engine)
            # the agent starts before its engine (the namespace is made with it): the agent's Docker
            # runtime connects on first use, and says "cannot be created yet" meanwhile
            with _environ(DOCKER_HOST=engine.docker_host):
                host = self.add_host("docker", None)
            assert host["netns"] == engine.netns, (host["netns"], engine.netns)
            host.update(engine=engine, docker_host=engine.docker_host)
            new.append(host)
        self.timings_s["agents"] = time.monotonic() - t0
        engines = [h["engine"] for h in new]
        t0 = time.monotonic()
        for engine in engines:
            engine.start(self.storage_driver)
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda e: e.wait(), engines))
        self.timings_s["engines_start"] = time.monotonic() - t0
        if image_tar is not None:
            t0 = time.monotonic()
            with ThreadPoolExecutor(len(engines)) as pool:
                list(pool.map(lambda e: e.load_image(image_tar, self.image, image_id), engines))
            self.timings_s["image_load"] = time.monotonic() - t0
        return new

    def close(self) -> list[str]:
        """Reset the agents, stop and remove the engines, then what ``Lan.close`` does; every
        leftover, one line each (empty when the teardown was clean)."""
        t0 = time.monotonic()
        for host in self.hosts:
            try:
                self.client(host, timeout_s=60, tries=1).reset()
            except TestbedError as e:
                self.problems.append(f"the agent of {host['name']} did not reset: {e.message}")
        with ThreadPoolExecutor(max(1, len(self.engines))) as pool:
            list(pool.map(lambda e: e.stop(), self.engines))
        left = [f"namespace {n} (left by an agent)" for n in super().close()]
        self.owner.unlink(missing_ok=True)
        for base in (DATA_BASE, EXEC_BASE):
            try:
                (base / self.tag).rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                self.problems.append(f"cannot remove {base / self.tag}: {e.strerror}")
        self.timings_s["teardown"] = time.monotonic() - t0
        deadline = time.monotonic() + LINK_GONE_S  # a veth whose namespace went is freed by the kernel a bit later
        while self.leftovers()["links"] and time.monotonic() < deadline:
            time.sleep(0.5)
        for kind, items in self.leftovers().items():
            left += [f"{kind}: {item}" for item in items]
        names = set(self.leftovers()["links"])
        for i, host in enumerate(self.hosts):
            if f"mh{self.tag}v{i}" in names and "inode" in host:
                left.append(f"what holds the namespace of {host['name']}: {netns_holders(host['inode']) or 'nothing /proc shows'};"
                            f" its sockets when it was removed:\n{host['sockets_at_close']}")
                print(left[-1], file=sys.stderr)
        return left

    def leftovers(self) -> dict[str, list[str]]:
        """What is left of the engines and the LAN: mounts, processes, directories, cgroups,
        namespaces, interfaces, and the problems met while stopping."""
        out: dict[str, list[str]] = {"mounts": [], "processes": [], "dirs": [], "cgroups": []}
        for engine in self.engines:
            for kind, items in engine.leftovers().items():
                out[kind] += items
        out["dirs"] += [str(p) for p in (DATA_BASE / self.tag, EXEC_BASE / self.tag) if p.exists()]
        out["netns"] = [n for n in nsfs.list_netns() if n.startswith(f"mh{self.tag}")]
        out["links"] = [name for _, name in socket.if_nameindex() if name.startswith(f"mh{self.tag}")]
        out["problems"] = self.problems + [p for e in self.engines for p in e.problems]
        return out


def hosts_document(lan: Lan, hosts: Sequence[dict], overlay_subnet: str = OVERLAY_SUBNET,
                   overlay_mtu: Optional[int] = None) -> dict[str, Any]:
    """The hosts.json of a swarm experiment over ``hosts`` (the controller is the LAN's ``.1``)."""
    doc: dict[str, Any] = {"version": 1, "engine": "swarm", "controller_ip": lan.ip(None),
                           "overlay_subnet": overlay_subnet}
    if overlay_mtu is not None:
        doc["overlay_mtu"] = overlay_mtu
    doc["hosts"] = [{"name": h["name"], "agent": h["url"], "runtime": "docker", "token_file": str(h["token_file"]),
                     "tls_fingerprint": h["fingerprint"]} for h in hosts]
    return doc


def write_hosts_json(path: Path, lan: Lan, hosts: Sequence[dict], overlay_subnet: str = OVERLAY_SUBNET,
                     overlay_mtu: Optional[int] = None) -> Path:
    """Write ``hosts_document`` to ``path``; the path."""
    path.write_text(json.dumps(hosts_document(lan, hosts, overlay_subnet, overlay_mtu), indent=2) + "\n")
    return path
