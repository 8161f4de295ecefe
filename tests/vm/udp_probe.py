"""A UDP echo and its prober, run inside nodes by the vm tier: round-trip times per probe and
how many probes came back (``python udp_probe.py serve PORT`` / ``probe IP PORT COUNT INTERVAL_S``).
The prober prints one JSON document: ``{"sent": n, "rtts_ms": [...], "sent_s": [...]}`` (the
answered probes in send order, each sent at ``time.monotonic()`` ``sent_s``), and the line
``probing`` on stderr as it sends its first probe.
"""
import json
import socket
import struct
import sys
import time


def serve(port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    while True:
        data, peer = sock.recvfrom(2048)
        sock.sendto(data, peer)


def probe(ip: str, port: int, count: int, interval_s: float, linger_s: float = 3.0) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sent_at: dict[int, float] = {}
    rtts: dict[int, float] = {}
    print("probing", file=sys.stderr, flush=True)
    start = time.monotonic()
    seq = 0
    while True:
        now = time.monotonic()
        if seq < count and now >= start + seq * interval_s:
            sock.sendto(struct.pack("!I", seq) + b"x" * 60, (ip, port))
            sent_at[seq] = time.monotonic()
            seq += 1
            continue
        if seq >= count and (len(rtts) == count or now > start + count * interval_s + linger_s):
            break
        try:
            data = sock.recv(2048)
            got = time.monotonic()
            n = struct.unpack("!I", data[:4])[0]
            rtts.setdefault(n, (got - sent_at[n]) * 1000)
        except BlockingIOError:
            time.sleep(0.0005)
    return {"sent": count, "rtts_ms": [rtts[n] for n in sorted(rtts)], "seqs": sorted(rtts),
            "sent_s": [sent_at[n] for n in sorted(rtts)]}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        print(json.dumps(probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))))
