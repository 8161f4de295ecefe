"""A small server for a node: GET /N answers N bytes (SIZE_BYTES, 1,000,000, without N), and
prints a line per request. Its port is $PORT. See docs/how-to/programs.md."""
import http.server
import os


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        size = int(self.path.strip("/") or os.environ.get("SIZE_BYTES", "1000000"))
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        self.wfile.write(b"x" * size)

    def log_message(self, fmt: str, *args: object) -> None:
        print(f"{self.client_address[0]} {fmt % args}", flush=True)


print(f"listening on port {os.environ['PORT']}", flush=True)
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), Handler).serve_forever()
