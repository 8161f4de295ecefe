"""Getting the controller's ``dml_app/`` and ``dataset/`` onto this host.

Two ways: ``sync_http`` mirrors the trees from the controller's ``/files`` routes
(content-hashed, changed files only; each fetch signed with the run's token, which itself never
crosses the plain-HTTP connection: ``worker.api.file_auth``), ``mount_nfs`` mounts an export read-only when the
kernel has an NFS client (``nfs_problem`` says why not otherwise).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any, Optional, Sequence
from urllib.parse import quote

import requests

from worker.api.errors import (AgentUnreachable, CapabilityError, ConfigError, NodeRuntimeError,
                               TestbedTimeout)
from worker.api import file_auth
from worker.api.protocol import TREES  # noqa: F401 - its name too

VERSION = 1
CHUNK = 1 << 20
SHA256_RE = re.compile(r"[0-9a-fA-F]{64}")
EXPORT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*:/[A-Za-z0-9._/-]*")
PROC_FILESYSTEMS = "/proc/filesystems"
MODULES_DIR = "/lib/modules"
MOUNT_HELPERS = ("/sbin/mount.nfs", "/usr/sbin/mount.nfs")
NFS_MODULES = tuple(f"nfs.ko{ext}" for ext in ("", ".xz", ".zst", ".gz"))


# --- HTTP ------------------------------------------------------------------------------------

def file_sha256(path: str) -> str:
    """The sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def skipped(name: str) -> bool:
    """Python's caches are no one's to sync (the controller never lists them)."""
    return name == "__pycache__" or name.endswith(".pyc")


def check_manifest(doc: Any, trees: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The ``files`` of a manifest, checked strictly; ConfigError names the bad entry."""
    if not isinstance(doc, dict) or doc.get("version") != VERSION or isinstance(doc.get("version"), bool):
        raise ConfigError(f"not a version {VERSION} manifest")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise ConfigError("manifest 'files' must be an object")
    dirs: set[str] = set()
    checked: dict[str, dict[str, Any]] = {}
    for path, entry in files.items():
        parts = path.split("/") if isinstance(path, str) else []
        if (len(parts) < 2 or parts[0] not in trees or "\\" in path or "\x00" in path
                or any(p in ("", ".", "..") for p in parts)):
            raise ConfigError(f"manifest entry {path!r}: not a relative path below {', '.join(trees)}")
        if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                or not SHA256_RE.fullmatch(entry["sha256"])):
            raise ConfigError(f"manifest entry {path!r}: sha256 must be 64 hex characters")
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(f"manifest entry {path!r}: size must be a non-negative integer")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        checked[path] = {"sha256": entry["sha256"].lower(), "size": size}
    clash = sorted(dirs.intersection(checked))
    if clash:
        raise ConfigError(f"manifest entry {clash[0]!r} is both a file and a directory")
    return checked


def _inside(path: str, dest_real: str) -> str:
    """``path``'s real path, if it stays inside ``dest_real``; else ConfigError."""
    real = os.path.realpath(path)
    if not real.startswith(dest_real + os.sep):
        raise ConfigError(f"{path} resolves to {real}, outside {dest_real}: refusing to write there")
    return real


def _prune(dest: str, trees: Sequence[str], keep: dict[str, Any]) -> int:
    """Delete what lies under ``dest/<tree>`` but not in ``keep`` (symlinks included, never
    followed), then empty directories below the trees; the number of entries removed."""
    removed = 0
    for tree in trees:
        top = os.path.join(dest, tree)
        if os.path.islink(top) or (os.path.lexists(top) and not os.path.isdir(top)):
            os.unlink(top)  # a tree is a real directory (a link left by an NFS mount goes)
            removed += 1
            continue
        if not os.path.isdir(top):
            continue
        for dirpath, dirnames, filenames in os.walk(top, topdown=False, followlinks=False):
            rel_dir = os.path.relpath(dirpath, dest).replace(os.sep, "/")
            for name in filenames + dirnames:
                path = os.path.join(dirpath, name)
                is_link = os.path.islink(path)
                if skipped(name) and not is_link:
                    continue
                if is_link or (name in filenames and f"{rel_dir}/{name}" not in keep):
                    os.unlink(path)
                    removed += 1
            if dirpath == top or skipped(os.path.basename(dirpath)):
                continue
            left = os.listdir(dirpath)
            if all(skipped(n) and not os.path.islink(os.path.join(dirpath, n)) for n in left):
                for name in left:  # only Python's caches are left: the directory is gone
                    path = os.path.join(dirpath, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
                os.rmdir(dirpath)
    return removed


def _signed_get(session: Any, token: str, url: str, signed_path: str, **kwargs: Any) -> Any:
    """GET ``url`` with a signature of ``signed_path`` (its decoded path) made with ``token``."""
    return session.get(url, headers={"Authorization": file_auth.header(token, "GET", signed_path)}, **kwargs)


def _fetch(session: Any, token: str, url: str, path: str, target: str, want: dict[str, Any], timeout_s: float) -> int:
    """Download ``url`` (the file ``path``) into a temp file beside ``target``, check it, move it into place."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".sync-")
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            try:
                with _signed_get(session, token, url, f"/files/{path}", stream=True, timeout=timeout_s) as resp:
                    if resp.status_code != 200:
                        raise AgentUnreachable(f"{url} answered {resp.status_code}: {resp.text[:200]}")
                    for chunk in resp.iter_content(CHUNK):
                        size += len(chunk)
                        if size > want["size"]:
                            break
                        digest.update(chunk)
                        out.write(chunk)
            except requests.RequestException as e:
                raise AgentUnreachable(f"could not fetch {url}: {e}") from None
        if size != want["size"] or digest.hexdigest() != want["sha256"]:
            raise ConfigError(f"{path}: the download does not match the manifest "
                              f"({size} bytes, sha256 {digest.hexdigest()[:12]}... ; "
                              f"expected {want['size']} bytes, {want['sha256'][:12]}...)")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        return size
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def code_hashes(files: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The sha256 of every ``dml_app/`` file of a checked manifest: what root may import."""
    return {path: want["sha256"].lower() for path, want in files.items() if path.startswith("dml_app/")}


def verify_code(root: str, hashes: dict[str, str]) -> None:
    """ConfigError naming the first file of ``root/dml_app`` that is not the manifest's (changed,
    missing, unlisted, or a link): checked before a root process imports the synced code.
    Python's caches aside: only root writes in a synced tree."""
    top = os.path.join(root, "dml_app")
    if os.path.islink(top) or not os.path.isdir(top):
        raise ConfigError(f"{top} is not a synced directory: sync the code again")
    seen = set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        dirnames[:] = [d for d in dirnames if not (skipped(d) and not os.path.islink(os.path.join(dirpath, d)))]
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if os.path.islink(path):
                raise ConfigError(f"{path} is a link, not a file of the controller's manifest: refusing to run "
                                  "the synced code")
            if name in dirnames or skipped(name):
                continue
            if rel not in hashes:
                raise ConfigError(f"{path} is not in the controller's manifest: refusing to run the synced code")
            if file_sha256(path) != hashes[rel]:
                raise ConfigError(f"{path} differs from the controller's manifest (sha256): refusing to run the "
                                  "synced code; sync it again")
            seen.add(rel)
    missing = sorted(set(hashes) - seen)
    if missing:
        raise ConfigError(f"{os.path.join(root, missing[0])} is missing from the synced code: sync it again")


def copy_verified(src_root: str, dest: str, tree: str, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Copy the manifest's files of ``src_root/tree`` (an NFS share) into ``dest/tree``, each
    checked against its sha256 and size as it is read: a share that changes later changes
    nothing a root process imports. Files the manifest lacks are removed from ``dest/tree``."""
    wanted = {p: w for p, w in files.items() if p.startswith(tree + "/")}
    os.makedirs(dest, exist_ok=True)
    dest_real = os.path.realpath(dest)
    removed = _prune(dest_real, [tree], wanted)
    copied = 0
    for path in sorted(wanted):
        want = wanted[path]
        source = os.path.join(src_root, *path.split("/"))
        try:
            fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(f"{source}: cannot read it from the share ({e.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            data = f.read(want["size"] + 1)
        if len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"].lower():
            raise ConfigError(f"{source}: the share's file does not match the manifest "
                              f"({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:12]}...)")
        target = _inside(os.path.join(dest_real, *path.split("/")), dest_real)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".sync-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        copied += 1
    return {"copied": copied, "removed": removed}


def _get_manifest(session: Any, token: str, url: str, trees: Sequence[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    try:
        resp = _signed_get(session, token, url, "/files/manifest", timeout=timeout_s)
    except requests.RequestException as e:
        raise AgentUnreachable(f"could not reach the controller at {url}: {e}") from None
    if resp.status_code != 200:
        raise AgentUnreachable(f"{url} answered {resp.status_code}: {resp.text[:200]}")
    try:
        doc = resp.json()
    except ValueError:
        raise ConfigError(f"{url} did not answer JSON") from None
    return check_manifest(doc, trees)


def sync_http(url: str, token: str, dest: str, trees: Sequence[str] = TREES, timeout_s: float = 60,
              manifest: Optional[dict] = None) -> dict:
    """Make ``dest/<tree>`` mirror the controller's trees at ``url`` (``http://host:3333``):
    fetch the files whose sha256 differs, delete those the manifest lacks. ``manifest``: the
    controller's, when it came over a trusted channel (the agent's pinned TLS), else it is
    fetched from ``url``. ``timeout_s`` bounds each request (connect and each read)."""
    trees = list(dict.fromkeys(trees))
    if not trees or any(t not in TREES for t in trees):
        raise ConfigError(f"trees must be among {', '.join(TREES)}, got {trees!r}")
    started = time.monotonic()
    base = url.rstrip("/")
    with requests.Session() as session:
        session.trust_env = False  # the controller directly: never through $HTTP_PROXY and friends
        if manifest is not None:
            files = check_manifest(manifest, trees)
        else:
            files = _get_manifest(session, token, f"{base}/files/manifest?trees={','.join(trees)}", trees, timeout_s)
        fetched = unchanged = downloaded = 0
        try:
            os.makedirs(dest, exist_ok=True)
            dest_real = os.path.realpath(dest)
            removed = _prune(dest_real, trees, files)
            for path in sorted(files):
                want = files[path]
                target = _inside(os.path.join(dest_real, *path.split("/")), dest_real)
                if (os.path.isfile(target) and not os.path.islink(target)
                        and os.path.getsize(target) == want["size"] and file_sha256(target) == want["sha256"]):
                    unchanged += 1
                    continue
                downloaded += _fetch(session, token, f"{base}/files/{quote(path)}", path, target, want, timeout_s)
                fetched += 1
        except OSError as e:
            raise NodeRuntimeError(f"could not write the synced files in {dest}: {e}") from None
    return {"version": VERSION, "method": "http", "dest": dest, "fetched": fetched, "unchanged": unchanged,
            "removed": removed, "bytes": downloaded, "seconds": round(time.monotonic() - started, 3)}


# --- NFS -------------------------------------------------------------------------------------

def _read_filesystems() -> str:
    try:
        with open(PROC_FILESYSTEMS) as f:
            return f.read()
    except OSError:
        return ""


def _nfs_module_installed(release: str) -> bool:
    top = os.path.join(MODULES_DIR, release)
    if any(os.path.exists(os.path.join(top, "kernel", "fs", "nfs", m)) for m in NFS_MODULES):
        return True
    for _, _, filenames in os.walk(top):  # distributions that lay modules out differently
        if any(m in filenames for m in NFS_MODULES):
            return True
    return False


def _mount_helper() -> Optional[str]:
    return shutil.which("mount.nfs") or next((p for p in MOUNT_HELPERS if os.path.exists(p)), None)


def nfs_problem() -> Optional[str]:
    """None when this host can mount NFS, else a one-line reason why not."""
    release = os.uname().release
    listed = {line.split()[-1] for line in _read_filesystems().splitlines() if line.split()}
    if not listed & {"nfs", "nfs4"} and not _nfs_module_installed(release):
        return (f"this kernel ({release}) has no NFS client (nfs is not in {PROC_FILESYSTEMS} "
                "and no nfs module is installed)")
    if not _mount_helper():
        return "mount.nfs is missing: install nfs-common (Debian/Ubuntu) or nfs-utils"
    return None


def check_export(export: str) -> str:
    """``host:/path`` with a plain host name or IPv4 address and a plain absolute path."""
    if not isinstance(export, str) or not EXPORT_RE.fullmatch(export):
        raise ConfigError(f"NFS export {export!r} must look like '10.254.0.1:/srv/edgetb' "
                          "(host name or IPv4 address, absolute path of letters, digits and ._/-)")
    return export


def mount_nfs(export: str, dest: str, timeout_s: float = 30) -> dict:
    """Mount ``export`` read-only on ``dest`` (created if missing)."""
    check_export(export)
    problem = nfs_problem()
    if problem:
        raise CapabilityError(f"cannot mount {export}: {problem}")
    os.makedirs(dest, exist_ok=True)
    argv = ["mount", "-t", "nfs", "-o", "ro,nolock,soft", export, dest]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TestbedTimeout(f"mounting {export} on {dest} took longer than {timeout_s:g}s") from None
    except FileNotFoundError:
        raise CapabilityError("the mount command is missing (install util-linux)") from None
    if done.returncode != 0:
        raise NodeRuntimeError(f"mounting {export} on {dest} failed: {done.stderr.strip() or done.returncode}")
    return {"version": VERSION, "method": "nfs", "dest": dest, "export": export}


def unmount(dest: str) -> bool:
    """Unmount ``dest`` if it is a mount point (lazily when it is busy); whether it was."""
    if not os.path.ismount(dest):
        return False
    done = subprocess.run(["umount", dest], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        lazy = subprocess.run(["umount", "-l", dest], capture_output=True, text=True, timeout=30)
        if lazy.returncode != 0:
            raise NodeRuntimeError(f"unmounting {dest} failed: {done.stderr.strip() or lazy.stderr.strip()}")
    return True
