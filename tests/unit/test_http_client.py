"""The node's HTTP client against raw servers: every answer framing it may meet, and requests it refuses to write."""
from __future__ import annotations

import socket
import threading
from typing import Callable

import pytest

from dml_app.runtime.http import AnswerTooLarge, request


def serve_once(answer: Callable[[bytes], bytes]) -> tuple[str, list[bytes]]:
    """A server on a free port that reads one request (headers and a Content-Length body), answers
    ``answer(request)`` and closes; returns its URL and the requests it read."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    seen: list[bytes] = []

    def run() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(rest) < length:
                rest += conn.recv(65536)
            seen.append(head + b"\r\n\r\n" + rest)
            conn.sendall(answer(seen[-1]))

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", seen


def test_a_content_length_answer_and_the_request_as_written():
    url, seen = serve_once(lambda req: b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\nX-Edgetb-Answer-Sig: abc\r\n\r\nhello")
    got: dict[str, str] = {}
    status, body = request("POST", url + "/take?x=1", b"12345", "application/octet-stream", timeout_s=5,
                           headers={"X-Edgetb-From": "n1"}, answer_headers=got)
    assert (status, body) == (201, b"hello")
    assert got["x-edgetb-answer-sig"] == "abc"
    head, _, sent = seen[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /take?x=1 HTTP/1.1"
    assert b"Content-Length: 5" in lines and b"X-Edgetb-From: n1" in lines and b"Connection: close" in lines
    assert sent == b"12345"


def test_a_chunked_answer_an_interim_answer_and_one_ended_by_the_close():
    url, _ = serve_once(lambda req: b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                    b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n")
    assert request("GET", url + "/", timeout_s=5) == (200, b"abcde")
    url, _ = serve_once(lambda req: b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
    assert request("GET", url + "/", timeout_s=5) == (200, b"until the end")


def test_an_answer_over_the_limit_is_refused_unread():
    url, _ = serve_once(lambda req: b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 100)
    with pytest.raises(AnswerTooLarge):
        request("GET", url + "/", timeout_s=5, max_answer_bytes=1000)
    url, _ = serve_once(lambda req: b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 5000)
    with pytest.raises(AnswerTooLarge):
        request("GET", url + "/", timeout_s=5, max_answer_bytes=1000)


@pytest.mark.parametrize("headers, target", [({"X-A": "1\r\nX-Injected: 1"}, "/"), ({"Bad Name": "1"}, "/"),
                                             ({}, "/a b"), ({}, "/a\r\nX: 1")])
def test_a_header_or_target_that_would_smuggle_a_line_is_not_sent(headers, target):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    with srv, pytest.raises(ConnectionError, match="ValueError"):
        request("GET", f"http://127.0.0.1:{srv.getsockname()[1]}{target}", timeout_s=2, headers=headers)


def test_a_garbled_or_missing_answer_is_a_connection_error():
    url, _ = serve_once(lambda req: b"SSH-2.0-nope\r\n\r\n")
    with pytest.raises(ConnectionError, match="not an HTTP answer"):
        request("GET", url + "/", timeout_s=5)
    url, _ = serve_once(lambda req: b"")
    with pytest.raises(ConnectionError, match="closed before an answer"):
        request("GET", url + "/", timeout_s=5)
