"""Code and data sync: the controller's /files routes, sync_http against a real HTTP server,
and the NFS probe and mount (the mount command itself is never run)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
from urllib.parse import unquote, urlsplit

import pytest
from flask import Flask, jsonify, request
from werkzeug.serving import make_server

from controller.workers import files
from worker import sync
from worker.api.errors import (AgentUnreachable, AuthError, CapabilityError, ConfigError, NodeRuntimeError,
                               TestbedError)
from worker.api import file_auth
from worker.serving import json_errors

TOKEN = "node-token"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(root, rel: str, data: bytes = b"x") -> None:
    path = os.path.join(str(root), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def read(root, rel: str) -> bytes:
    with open(os.path.join(str(root), rel), "rb") as f:
        return f.read()


def tree(root) -> dict[str, bytes]:
    """Every file (or link) under root, relative, '/'-separated."""
    out = {}
    for dirpath, _, names in os.walk(str(root)):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, str(root)).replace(os.sep, "/")
            out[rel] = os.readlink(path).encode() if os.path.islink(path) else read(root, rel)
    return out


def check_token() -> None:
    """As the controller's: a fetch signed with the run's token (worker.api.file_auth)."""
    if not file_auth.verify(TOKEN, request.headers.get("Authorization", ""), request.method, request.path):
        raise AuthError("code sync needs a request signed with the run's token")


def signed_get(client, url: str):
    """``client.get(url)`` signed as an agent signs it."""
    path = unquote(urlsplit(url).path)
    return client.get(url, headers={"Authorization": file_auth.header(TOKEN, "GET", path)})


def files_app(root) -> Flask:
    app = Flask("test-files")
    json_errors(app, __import__("logging").getLogger("test"))
    files.register(app, str(root), check_token)
    return app


@pytest.fixture
def serve():
    """serve(app) -> base URL of a real threaded HTTP server on 127.0.0.1."""
    servers = []

    def start(app: Flask) -> str:
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def src(tmp_path):
    """A controller work directory with both trees, caches, symlinks and a secret beside them."""
    root = tmp_path / "src"
    put(root, "dml_app/node.py", b"print('node')\n")
    put(root, "dml_app/roles/gossip.py", b"ROLE = 'gl'\n")
    put(root, "dml_app/__pycache__/node.cpython-311.pyc", b"\0pyc")
    put(root, "dml_app/old.pyc", b"\0pyc")
    put(root, "dataset/digits/n1.npz", b"\x93NUMPY" + bytes(range(256)) * 8)
    put(root, "dataset/digits/manifest.json", b"{}")
    put(root, "dml_file/conf/n1_structure.json", b"{}")
    (tmp_path / "secret").write_bytes(b"top secret")
    os.symlink(str(tmp_path / "secret"), str(root / "dml_app" / "leak.py"))
    os.symlink(str(tmp_path), str(root / "dml_app" / "outside"))
    os.symlink("node.py", str(root / "dml_app" / "alias.py"))  # inside, but still a symlink
    return root


# --- controller/workers/files.py -------------------------------------------------------------------

def test_manifest_lists_regular_files_and_skips_caches_and_links(src):
    doc = files.manifest(str(src), ["dml_app", "dataset"])
    assert doc["version"] == 1
    assert sorted(doc["files"]) == ["dataset/digits/manifest.json", "dataset/digits/n1.npz",
                                    "dml_app/node.py", "dml_app/roles/gossip.py"]
    assert doc["files"]["dml_app/node.py"] == {"sha256": sha(b"print('node')\n"), "size": 14}
    npz = read(src, "dataset/digits/n1.npz")
    assert doc["files"]["dataset/digits/n1.npz"] == {"sha256": sha(npz), "size": len(npz)}
    assert list(files.manifest(str(src), ["dml_app"])["files"]) == ["dml_app/node.py", "dml_app/roles/gossip.py"]


def test_manifest_missing_tree_is_empty_and_unknown_tree_refused(tmp_path):
    assert files.manifest(str(tmp_path), ["dml_app", "dataset"]) == {"version": 1, "files": {}}
    for trees in (["dml_file"], ["dml_app", ".."], [], ["dml_app/x"]):
        with pytest.raises(ConfigError):
            files.manifest(str(tmp_path), trees)


def test_manifest_hashes_files_larger_than_a_chunk(tmp_path):
    data = os.urandom(sync.CHUNK * 2 + 17)
    put(tmp_path, "dataset/big.bin", data)
    assert files.manifest(str(tmp_path), ["dataset"])["files"]["dataset/big.bin"] == \
        {"sha256": sha(data), "size": len(data)}


def test_routes_serve_manifest_and_files_with_the_token(src):
    client = files_app(src).test_client()
    resp = signed_get(client, "/files/manifest?trees=dml_app,dataset")
    assert resp.status_code == 200
    assert resp.get_json() == files.manifest(str(src), ["dml_app", "dataset"])
    assert sorted(signed_get(client, "/files/manifest?trees=dataset").get_json()["files"]) == \
        ["dataset/digits/manifest.json", "dataset/digits/n1.npz"]
    resp = signed_get(client, "/files/dml_app/roles/gossip.py")
    assert resp.status_code == 200 and resp.data == b"ROLE = 'gl'\n"
    assert resp.mimetype == "application/octet-stream"
    assert signed_get(client, "/files/dataset/digits/n1.npz").data == read(src, "dataset/digits/n1.npz")
    resp = signed_get(client, "/files/manifest?trees=dml_app,dml_file")
    assert resp.status_code == 400 and resp.get_json()["error"] == "config_error"


@pytest.mark.parametrize("url", ["/files/manifest?trees=dml_app", "/files/dml_app/node.py"])
@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Bearer {TOKEN}", f"Basic {TOKEN}", TOKEN,
                                    file_auth.header("wrong token", "GET", "/files/dml_app/node.py"),
                                    file_auth.header(TOKEN, "GET", "/files/dml_app/other.py"),
                                    file_auth.header(TOKEN, "GET", "/files/dml_app/node.py", now=1e9)])
def test_routes_need_the_token(src, url, header):
    client = files_app(src).test_client()
    resp = client.get(url, headers={"Authorization": header} if header else {})
    assert resp.status_code == 401 and resp.get_json()["error"] == "unauthorized"


@pytest.mark.parametrize("relpath", [
    "dml_app/../dml_file/conf/n1_structure.json",  # ..
    "dml_app/roles/../node.py",
    "dml_app/./node.py",
    "dml_app//node.py",
    "dml_file/conf/n1_structure.json",  # not a tree
    "manifest.json",
    "dml_app",  # a tree, not a file
    "dml_app/roles",  # a directory
    "dml_app/missing.py",
    "dml_app/leak.py",  # symlink out of root
    "dml_app/outside/secret",  # through a symlinked directory
    "dml_app/alias.py",  # symlink inside: not listed, not served
    "dml_app/__pycache__/node.cpython-311.pyc",
    "dml_app/old.pyc",
])
def test_routes_serve_nothing_outside_the_listed_files(src, relpath):
    client = files_app(src).test_client()
    resp = signed_get(client, f"/files/{relpath}")
    assert resp.status_code == 404 and resp.get_json()["error"] == "not_found"
    with pytest.raises(TestbedError):
        files.resolve(str(src), relpath)


@pytest.mark.parametrize("relpath", ["/etc/passwd", str("/") + "dml_app/node.py", "dml_app/node.py\x00",
                                     "dml_app\\..\\secret"])
def test_resolve_refuses_absolute_and_odd_paths(src, relpath):
    with pytest.raises(TestbedError) as err:
        files.resolve(str(src), relpath)
    assert err.value.http_status == 404


def test_routes_absolute_path_is_not_served(src):
    client = files_app(src).test_client()
    for url in ("/files//etc/passwd", "/files/%2Fetc%2Fpasswd", "/files/%2e%2e/secret"):
        resp = signed_get(client, url)
        assert resp.status_code != 200 and b"root:" not in resp.data and b"top secret" not in resp.data


def test_a_symlinked_tree_is_served_but_nothing_below_it_escapes(tmp_path):
    checkout = tmp_path / "checkout"
    put(checkout, "dml_app/node.py", b"code")
    root = tmp_path / "exp"
    root.mkdir()
    os.symlink(str(checkout / "dml_app"), str(root / "dml_app"))
    client = files_app(root).test_client()
    assert list(files.manifest(str(root), ["dml_app"])["files"]) == ["dml_app/node.py"]
    assert signed_get(client, "/files/dml_app/node.py").data == b"code"
    assert signed_get(client, "/files/dml_app/../exp").status_code == 404


# --- worker/sync.py: sync_http ---------------------------------------------------------------

def test_sync_http_fetches_then_keeps_then_mirrors_changes(src, tmp_path, serve):
    url = serve(files_app(src))
    dest = tmp_path / "dest"
    first = sync.sync_http(url, TOKEN, str(dest))
    expected = {k: read(src, k) for k in files.manifest(str(src), ["dml_app", "dataset"])["files"]}
    assert tree(dest) == expected
    assert {k: first[k] for k in ("version", "method", "dest", "fetched", "unchanged", "removed", "bytes")} == \
        {"version": 1, "method": "http", "dest": str(dest), "fetched": 4, "unchanged": 0, "removed": 0,
         "bytes": sum(len(v) for v in expected.values())}
    assert isinstance(first["seconds"], float)
    assert oct(os.stat(dest / "dml_app" / "node.py").st_mode & 0o777) == oct(0o644)

    again = sync.sync_http(url, TOKEN, str(dest))
    assert (again["fetched"], again["unchanged"], again["removed"], again["bytes"]) == (0, 4, 0, 0)

    put(src, "dml_app/node.py", b"print('node v2')\n")  # changed
    os.unlink(src / "dml_app" / "roles" / "gossip.py")  # deleted (its directory empties)
    put(src, "dataset/digits/n2.npz", b"shard two")  # added
    put(dest, "dml_app/__pycache__/node.cpython-311.pyc", b"local cache")  # the node's own cache stays
    third = sync.sync_http(url, TOKEN, str(dest))
    assert (third["fetched"], third["unchanged"], third["removed"], third["bytes"]) == \
        (2, 2, 1, len(b"print('node v2')\n") + len(b"shard two"))
    assert read(dest, "dml_app/node.py") == b"print('node v2')\n"
    assert read(dest, "dataset/digits/n2.npz") == b"shard two"
    assert not os.path.exists(dest / "dml_app" / "roles")  # pruned
    assert read(dest, "dml_app/__pycache__/node.cpython-311.pyc") == b"local cache"


def test_sync_http_ignores_the_proxy_environment(src, tmp_path, serve, monkeypatch):
    url = serve(files_app(src))
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens: a proxied fetch fails
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert sync.sync_http(url, TOKEN, str(tmp_path / "dest"))["fetched"] == 4


def test_sync_http_same_size_change_is_fetched_and_extras_removed(src, tmp_path, serve):
    url = serve(files_app(src))
    dest = tmp_path / "dest"
    put(dest, "dml_app/node.py", b"print('NODE')\n")  # same size, other content
    put(dest, "dml_app/stale/mod.py", b"old")
    put(dest, "dml_app/stale/__pycache__/mod.cpython-311.pyc", b"old cache")
    put(dest, "dml_file/log/keep.jsonl", b"not a synced tree")
    result = sync.sync_http(url, TOKEN, str(dest), trees=["dml_app"])
    assert (result["fetched"], result["unchanged"], result["removed"]) == (2, 0, 1)
    assert read(dest, "dml_app/node.py") == b"print('node')\n"
    assert not os.path.exists(dest / "dml_app" / "stale")  # only caches were left: gone too
    assert read(dest, "dml_file/log/keep.jsonl") == b"not a synced tree"
    assert not os.path.exists(dest / "dataset")


def test_sync_http_never_follows_links_in_dest(src, tmp_path, serve):
    url = serve(files_app(src))
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    put(outside, "roles/gossip.py", b"outside, keep me")
    put(outside, "digits/n1.npz", b"outside too")
    put(dest, "dml_app/x", b"")
    os.symlink(str(outside), str(dest / "dml_app" / "roles"))  # a link inside a tree
    os.symlink(str(outside), str(dest / "dataset"))  # a tree that is a link (as NFS mode leaves)
    result = sync.sync_http(url, TOKEN, str(dest))
    assert result["fetched"] == 4
    assert not os.path.islink(dest / "dml_app" / "roles") and not os.path.islink(dest / "dataset")
    assert tree(outside) == {"roles/gossip.py": b"outside, keep me", "digits/n1.npz": b"outside too"}
    assert read(dest, "dml_app/roles/gossip.py") == b"ROLE = 'gl'\n"


def fake_controller(manifest_doc, blobs: dict[str, bytes]) -> Flask:
    app = Flask("fake-controller")

    @app.get("/files/manifest")
    def manifest():
        return jsonify(manifest_doc)

    @app.get("/files/<path:relpath>")
    def get(relpath):
        return blobs.get(relpath, b"not here"), 200 if relpath in blobs else 404

    return app


def test_sync_http_refuses_a_manifest_that_leaves_dest(tmp_path, serve):
    doc = {"version": 1, "files": {"../x": {"sha256": sha(b"evil"), "size": 4}}}
    url = serve(fake_controller(doc, {"../x": b"evil"}))
    (tmp_path / "dest").mkdir()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError, match=r"'\.\./x'"):
        sync.sync_http(url, TOKEN, str(tmp_path / "dest"))
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "dest") == []


GOOD = {"sha256": "a" * 64, "size": 1}


@pytest.mark.parametrize("doc,word", [
    ([], "version"),
    ({"files": {}}, "version"),
    ({"version": 2, "files": {}}, "version"),
    ({"version": True, "files": {}}, "version"),
    ({"version": 1, "files": []}, "files"),
    ({"version": 1, "files": {"../x": GOOD}}, "'../x'"),
    ({"version": 1, "files": {"dml_app/../../x": GOOD}}, "dml_app/../../x"),
    ({"version": 1, "files": {"/etc/passwd": GOOD}}, "/etc/passwd"),
    ({"version": 1, "files": {"dml_app//x": GOOD}}, "dml_app//x"),
    ({"version": 1, "files": {"dml_app/./x": GOOD}}, "dml_app/./x"),
    ({"version": 1, "files": {"dml_app/": GOOD}}, "'dml_app/'"),
    ({"version": 1, "files": {"dml_app": GOOD}}, "'dml_app'"),
    ({"version": 1, "files": {"dml_app\\..\\x": GOOD}}, "dml_app"),
    ({"version": 1, "files": {"dml_file/x": GOOD}}, "dml_file/x"),
    ({"version": 1, "files": {"dataset/x": GOOD}}, "dataset/x"),  # not a requested tree
    ({"version": 1, "files": {"dml_app/x": {"size": 1}}}, "sha256"),
    ({"version": 1, "files": {"dml_app/x": {"sha256": "g" * 64, "size": 1}}}, "sha256"),
    ({"version": 1, "files": {"dml_app/x": {"sha256": "a" * 63, "size": 1}}}, "sha256"),
    ({"version": 1, "files": {"dml_app/x": {"sha256": "a" * 64 + "\n", "size": 1}}}, "sha256"),
    ({"version": 1, "files": {"dml_app/x": {"sha256": "a" * 64, "size": -1}}}, "size"),
    ({"version": 1, "files": {"dml_app/x": {"sha256": "a" * 64, "size": 1.0}}}, "size"),
    ({"version": 1, "files": {"dml_app/x": {"sha256": "a" * 64, "size": True}}}, "size"),
    ({"version": 1, "files": {"dml_app/x": {"sha256": "a" * 64}}}, "size"),
    ({"version": 1, "files": {"dml_app/x": "a" * 64}}, "dml_app/x"),
    ({"version": 1, "files": {"dml_app/x": GOOD, "dml_app/x/y": GOOD}}, "both a file and a directory"),
])
def test_check_manifest_table(doc, word):
    with pytest.raises(ConfigError) as err:
        sync.check_manifest(doc, ["dml_app"])
    assert word in err.value.message


def test_check_manifest_accepts_and_normalises():
    files_ = sync.check_manifest({"version": 1, "files": {"dml_app/a/b.py": {"sha256": "AB" * 32, "size": 0}}},
                                 ["dml_app", "dataset"])
    assert files_ == {"dml_app/a/b.py": {"sha256": "ab" * 32, "size": 0}}


@pytest.mark.parametrize("served", [b"other", b"ol", b"old contents, longer than the manifest says"])
def test_sync_http_corrupted_download_leaves_the_old_file(tmp_path, serve, served):
    doc = {"version": 1, "files": {"dml_app/node.py": {"sha256": sha(b"new"), "size": 3}}}
    url = serve(fake_controller(doc, {"dml_app/node.py": served}))
    dest = tmp_path / "dest"
    put(dest, "dml_app/node.py", b"old contents")
    with pytest.raises(ConfigError, match="does not match the manifest"):
        sync.sync_http(url, TOKEN, str(dest), trees=["dml_app"])
    assert tree(dest) == {"dml_app/node.py": b"old contents"}  # no temp file left either


def test_sync_http_file_gone_on_the_controller(tmp_path, serve):
    doc = {"version": 1, "files": {"dml_app/node.py": {"sha256": sha(b"new"), "size": 3}}}
    url = serve(fake_controller(doc, {}))
    with pytest.raises(AgentUnreachable, match="404"):
        sync.sync_http(url, TOKEN, str(tmp_path / "dest"), trees=["dml_app"])
    assert tree(tmp_path / "dest") == {}


def test_sync_http_unreachable_and_refused(src, tmp_path, serve):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(AgentUnreachable) as err:
        sync.sync_http(url, TOKEN, str(tmp_path / "dest"), timeout_s=5)
    assert url in err.value.message
    good = serve(files_app(src))
    with pytest.raises(AgentUnreachable, match="401"):
        sync.sync_http(good, "wrong token", str(tmp_path / "dest"))
    with pytest.raises(ConfigError):
        sync.sync_http(good, TOKEN, str(tmp_path / "dest"), trees=["dml_file"])
    not_json = Flask("not-json")
    not_json.get("/files/manifest")(lambda: "hello")
    with pytest.raises(ConfigError, match="JSON"):
        sync.sync_http(serve(not_json), TOKEN, str(tmp_path / "dest"))


def test_sync_http_signs_each_request_and_never_sends_the_token(tmp_path, serve):
    seen = []
    app = Flask("spy")
    token = "t0k-" + "s" * 20

    @app.get("/files/manifest")
    def manifest():
        seen.append((request.path, request.headers.get("Authorization"), request.args.get("trees")))
        return jsonify({"version": 1, "files": {"dml_app/a b.py": {"sha256": sha(b"x"), "size": 1}}})

    @app.get("/files/<path:relpath>")
    def get(relpath):
        seen.append((request.path, request.headers.get("Authorization"), None))
        return b"x"

    sync.sync_http(serve(app) + "/", token, str(tmp_path / "dest"))
    assert [(path, trees) for path, _, trees in seen] == [("/files/manifest", "dml_app,dataset,dml_user"),
                                                          ("/files/dml_app/a b.py", None)]
    for path, header, _ in seen:
        assert token not in header and file_auth.verify(token, header, "GET", path), header
    assert not file_auth.verify(token, seen[0][1], "GET", seen[1][0])  # one path's signature signs no other


# --- worker/sync.py: NFS ---------------------------------------------------------------------

def test_nfs_problem_on_this_machine():
    with open("/proc/filesystems") as f:
        listed = {line.split()[-1] for line in f if line.split()}
    problem = sync.nfs_problem()
    if not listed & {"nfs", "nfs4"}:
        modules = f"/lib/modules/{os.uname().release}"
        if not os.path.isdir(modules):
            assert isinstance(problem, str) and "no NFS client" in problem and os.uname().release in problem
    assert problem is None or (isinstance(problem, str) and problem and "\n" not in problem)


@pytest.mark.parametrize("filesystems,module,helper,expect", [
    ("nodev\tproc\n\text4\n", None, True, "no NFS client"),
    ("nodev\tproc\n\text4\n", None, False, "no NFS client"),
    ("nodev\tproc\nnodev\tnfs\nnodev\tnfs4\n", None, True, None),
    ("nodev\tnfs4\n", None, True, None),
    ("nodev\tnfsd\n", None, True, "no NFS client"),  # the server's filesystem is no client
    ("nodev\tproc\n", "kernel/fs/nfs/nfs.ko", True, None),
    ("nodev\tproc\n", "kernel/fs/nfs/nfs.ko.xz", True, None),
    ("nodev\tproc\n", "kernel/fs/nfs/nfs.ko.zst", True, None),
    ("nodev\tproc\n", "updates/dkms/nfs.ko.gz", True, None),
    ("nodev\tproc\n", "kernel/fs/nfsd/nfsd.ko", True, "no NFS client"),
    ("nodev\tnfs\n", None, False, "mount.nfs is missing: install nfs-common"),
    ("nodev\tproc\n", "kernel/fs/nfs/nfs.ko", False, "mount.nfs is missing"),
    (None, None, True, "no NFS client"),  # /proc/filesystems unreadable
])
def test_nfs_problem_table(tmp_path, monkeypatch, filesystems, module, helper, expect):
    release = os.uname().release
    proc = tmp_path / "filesystems"
    if filesystems is not None:
        proc.write_text(filesystems)
    modules = tmp_path / "modules"
    (modules / release).mkdir(parents=True)
    if module:
        put(modules / release, module, b"\x7fELF")
    monkeypatch.setattr(sync, "PROC_FILESYSTEMS", str(proc))
    monkeypatch.setattr(sync, "MODULES_DIR", str(modules))
    monkeypatch.setattr(sync.shutil, "which", lambda name: "/usr/sbin/mount.nfs" if helper else None)
    monkeypatch.setattr(sync, "MOUNT_HELPERS", (str(tmp_path / "no-such-helper"),))
    problem = sync.nfs_problem()
    if expect is None:
        assert problem is None
    else:
        assert isinstance(problem, str) and expect in problem and "\n" not in problem


@pytest.fixture
def fake_mount(monkeypatch):
    """subprocess.run replaced: records argv lists, answers with ``calls.answer``."""
    calls = []

    def run(argv, **kwargs):
        assert isinstance(argv, list) and not kwargs.get("shell")
        calls.append(argv)
        return subprocess.CompletedProcess(argv, calls_answer[0], "", calls_answer[1])

    calls_answer = [0, ""]
    monkeypatch.setattr(sync.subprocess, "run", run)
    monkeypatch.setattr(sync, "nfs_problem", lambda: None)
    return calls, calls_answer


@pytest.mark.parametrize("export", ["1.2.3.4:/srv/x", "10.254.0.1:/srv/edgetb", "nas.lan:/exports/edge-tb_1.0",
                                     "NAS-2:/"])
def test_mount_nfs_accepts(tmp_path, fake_mount, export):
    calls, _ = fake_mount
    dest = str(tmp_path / "share")
    assert sync.mount_nfs(export, dest) == {"version": 1, "method": "nfs", "dest": dest, "export": export}
    assert calls == [["mount", "-t", "nfs", "-o", "ro,nolock,soft", export, dest]]
    assert os.path.isdir(dest)


@pytest.mark.parametrize("export", ["h:/a;rm -rf /", "h:rel", "-o x:/a", "-ox:/a", "h:/a b", "h:/a$(id)",
                                    ":/srv", "h/srv", "h:", "h:/a\n", "1.2.3.4:/srv\n", "\n1.2.3.4:/srv",
                                    "[::1]:/srv", "h:/a,rw", "h:/a'", "", "user@h:/srv", 42, None])
def test_mount_nfs_refuses_odd_exports(tmp_path, fake_mount, export):
    calls, _ = fake_mount
    with pytest.raises(ConfigError, match="NFS export"):
        sync.mount_nfs(export, str(tmp_path / "share"))
    assert calls == [] and not os.path.exists(tmp_path / "share")


def test_mount_nfs_failure_carries_stderr(tmp_path, fake_mount):
    calls, answer = fake_mount
    answer[:] = [32, "mount.nfs: access denied by server while mounting 1.2.3.4:/srv/x\n"]
    with pytest.raises(NodeRuntimeError, match="access denied by server"):
        sync.mount_nfs("1.2.3.4:/srv/x", str(tmp_path / "share"))
    assert len(calls) == 1


def test_mount_nfs_refused_when_the_kernel_cannot(tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "nfs_problem", lambda: "mount.nfs is missing: install nfs-common")
    monkeypatch.setattr(sync.subprocess, "run", lambda *a, **k: pytest.fail("mount ran"))
    with pytest.raises(CapabilityError, match="install nfs-common"):
        sync.mount_nfs("1.2.3.4:/srv/x", str(tmp_path / "share"))


def test_mount_nfs_on_this_machine_is_a_capability_error(tmp_path):
    if sync.nfs_problem() is None:
        pytest.skip("this machine can mount NFS")
    with pytest.raises(CapabilityError) as err:
        sync.mount_nfs("127.0.0.1:/srv/edgetb", str(tmp_path / "share"))
    assert err.value.http_status == 422 and sync.nfs_problem() in err.value.message


def test_unmount_only_mount_points(tmp_path, fake_mount, monkeypatch):
    calls, answer = fake_mount
    assert sync.unmount(str(tmp_path)) is False and calls == []
    monkeypatch.setattr(sync.os.path, "ismount", lambda p: p == "/mnt/share")
    assert sync.unmount("/mnt/share") is True and calls == [["umount", "/mnt/share"]]
    answer[:] = [32, "target is busy"]
    with pytest.raises(NodeRuntimeError, match="target is busy"):
        sync.unmount("/mnt/share")
    assert calls[1:] == [["umount", "/mnt/share"], ["umount", "-l", "/mnt/share"]]


def test_results_are_json(src, tmp_path, serve):
    result = sync.sync_http(serve(files_app(src)), TOKEN, str(tmp_path / "dest"))
    assert json.loads(json.dumps(result)) == result


def test_sync_http_unwritable_dest_is_a_runtime_error(src, tmp_path, serve):
    (tmp_path / "dest").write_bytes(b"a file, not a directory")
    with pytest.raises(NodeRuntimeError, match="could not write"):
        sync.sync_http(serve(files_app(src)), TOKEN, str(tmp_path / "dest"))
