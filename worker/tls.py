"""The agent's TLS identity: a self-signed certificate made on its first start, pinned by the
controller through its SHA-256 fingerprint (hosts.json, ``tls_fingerprint``).

The certificate and its key live in ``<state dir>/tls/`` (the key mode 0600, the directory
0700); they are made with the ``openssl`` command (an argument list, no shell).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import ssl
import stat
import subprocess
import tempfile
from typing import Optional

from worker.api.errors import CapabilityError, ConfigError
from worker.state import state_root

CERT_FILE = "agent.crt"
KEY_FILE = "agent.key"
VALID_DAYS = 3650


def tls_dir(root: Optional[str] = None) -> str:
    return os.path.join(root or state_root(), "tls")


def _check_key_mode(path: str) -> None:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise ConfigError(f"{path} is readable by others (mode {mode:o}): chmod 600 {path}")


def ensure_certificate(directory: Optional[str] = None) -> tuple[str, str]:
    """(certificate path, key path), made on first use: an EC P-256 key and a self-signed
    certificate valid for ten years."""
    directory = directory or tls_dir()
    cert, key = os.path.join(directory, CERT_FILE), os.path.join(directory, KEY_FILE)
    if os.path.exists(cert) and os.path.exists(key):
        _check_key_mode(key)
        return cert, key
    openssl = shutil.which("openssl")
    if openssl is None:
        raise CapabilityError("the openssl command is missing (install openssl): the agent makes its TLS "
                              "certificate with it")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    work = tempfile.mkdtemp(dir=directory, prefix=".new-")
    try:
        new_cert, new_key = os.path.join(work, CERT_FILE), os.path.join(work, KEY_FILE)
        argv = [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", new_key, "-out", new_cert, "-days", str(VALID_DAYS), "-subj", "/CN=edgetb-agent"]
        old_umask = os.umask(0o077)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        finally:
            os.umask(old_umask)
        if done.returncode != 0:
            raise CapabilityError(f"openssl could not make the agent's certificate: {done.stderr.strip()[-300:]}")
        os.chmod(new_key, 0o600)
        os.chmod(new_cert, 0o644)
        os.replace(new_key, key)
        os.replace(new_cert, cert)  # last: a certificate on disk means its key is there too
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return cert, key


def fingerprint_der(der: bytes) -> str:
    """64 lower-case hex digits."""
    return hashlib.sha256(der).hexdigest()


def fingerprint_file(cert_path: str) -> str:
    with open(cert_path) as f:
        return fingerprint_der(ssl.PEM_cert_to_DER_cert(f.read()))


def pretty(fingerprint: str) -> str:
    """``AB:CD:...`` as ``openssl x509 -fingerprint -sha256`` prints it."""
    return ":".join(fingerprint[i:i + 2] for i in range(0, len(fingerprint), 2)).upper()


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """The agent's server context (gevent's: its sockets yield to other connections while
    they wait): TLS 1.2 or later, its own certificate."""
    from gevent import ssl as gevent_ssl

    context = gevent_ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context
