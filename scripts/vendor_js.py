#!/usr/bin/env python3
"""Vendor the dashboard's JavaScript libraries: pinned, built files from the npm registry, with
their licences, under controller/web/static/vendor/, and VERSIONS.json recording each package's
version, tarball, the registry's integrity hash and every file's SHA-256.

    python3 scripts/vendor_js.py           # fetch the pinned versions (needs the npm registry)
    python3 scripts/vendor_js.py --check   # verify the vendored files against VERSIONS.json (offline)

The page needs no build step and no network: the files are committed. To move to a newer
version, change PACKAGES, run the script and commit what it wrote.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import sys
import tarfile
import urllib.request

REGISTRY = "https://registry.npmjs.org"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENDOR = os.path.join(ROOT, "controller", "web", "static", "vendor")
VERSIONS = os.path.join(VENDOR, "VERSIONS.json")
# package -> (version, files inside the tarball's package/ folder)
PACKAGES = {
    "uplot": ("1.6.32", ("dist/uPlot.iife.min.js", "dist/uPlot.min.css", "LICENSE")),
    "cytoscape": ("3.34.4", ("dist/cytoscape.min.js", "LICENSE")),
}
TIMEOUT_S = 60


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:  # noqa: S310 - a fixed https registry
        return answer.read()


def _check_integrity(data: bytes, integrity: str, what: str) -> None:
    """The registry's Subresource-Integrity string (``sha512-<base64>``) must match ``data``."""
    algorithm, _, expected = integrity.partition("-")
    if algorithm not in ("sha512", "sha384", "sha256"):
        raise SystemExit(f"{what}: unknown integrity algorithm {algorithm!r}")
    got = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
    if got != expected:
        raise SystemExit(f"{what}: the tarball does not match the registry's integrity {integrity}")


def fetch() -> dict:
    record: dict = {}
    for package, (version, files) in PACKAGES.items():
        meta = json.loads(_get(f"{REGISTRY}/{package}/{version}"))
        tarball, integrity = meta["dist"]["tarball"], meta["dist"]["integrity"]
        data = _get(tarball)
        _check_integrity(data, integrity, f"{package}@{version}")
        out = os.path.join(VENDOR, package)
        os.makedirs(out, exist_ok=True)
        hashes = {}
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for rel in files:
                member = tar.extractfile(f"package/{rel}")
                if member is None:
                    raise SystemExit(f"{package}@{version}: no file {rel} in the tarball")
                body = member.read()
                name = os.path.basename(rel)
                with open(os.path.join(out, name), "wb") as f:
                    f.write(body)
                hashes[name] = sha256(body)
        record[package] = {"version": version, "licence": meta.get("license"), "tarball": tarball,
                           "integrity": integrity, "files": hashes}
        print(f"vendored {package}@{version}: {', '.join(hashes)}")
    with open(VERSIONS, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    return record


def check() -> list[str]:
    """Problems with the vendored files (empty when every file matches VERSIONS.json and PACKAGES)."""
    try:
        with open(VERSIONS) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{VERSIONS}: {e}"]
    problems = []
    for package, (version, files) in PACKAGES.items():
        entry = record.get(package)
        if not entry or entry.get("version") != version:
            problems.append(f"{package}: VERSIONS.json records {entry and entry.get('version')}, PACKAGES pins "
                            f"{version}: run scripts/vendor_js.py")
            continue
        for name in (os.path.basename(rel) for rel in files):
            path = os.path.join(VENDOR, package, name)
            try:
                with open(path, "rb") as f:
                    digest = sha256(f.read())
            except OSError as e:
                problems.append(f"{path}: {e.strerror}")
                continue
            if digest != entry["files"].get(name):
                problems.append(f"{path}: SHA-256 {digest} is not the recorded {entry['files'].get(name)}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the vendored files (no network)")
    if parser.parse_args().check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        print("vendored files: " + ("mismatch" if problems else "match VERSIONS.json"))
        return 1 if problems else 0
    fetch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
