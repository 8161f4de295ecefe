"""The WSGI server's connections and the state snapshot: small pieces on the hot path of calls."""
import json
import os
import socket

from worker import serving
from worker.state import StateStore


def test_server_turns_nagle_off_on_each_connection(monkeypatch):
    cls = serving._server_class()
    seen = []
    monkeypatch.setattr(cls.__mro__[1], "handle", lambda self, sock, address: seen.append(sock))
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    conn, addr = listener.accept()
    try:
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        cls.handle(object.__new__(cls), conn, addr)
        assert seen == [conn] and conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        for s in (conn, client, listener):
            s.close()


def test_snapshot_is_parsed_again_only_after_a_save(tmp_path):
    store = StateStore("tb1", root=str(tmp_path))
    with store.locked() as state:
        state["nodes"]["a"] = {"index": 0}
    first = store.snapshot()
    assert first["nodes"] == {"a": {"index": 0}} and store.snapshot() is first
    with store.locked() as state:
        state["nodes"]["b"] = {"index": 1}
    assert set(store.snapshot()["nodes"]) == {"a", "b"}
    with open(store.path) as f:
        assert json.load(f)["nodes"]["b"] == {"index": 1}
    os.remove(store.path)
    assert store.snapshot()["nodes"] == {}
