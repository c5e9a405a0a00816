"""Test helper: an HTTP server on 127.0.0.1:PORT that answers 503 to everything, forever.

It stands for an engine that is up but never becomes healthy (stuck loading weights)."""

import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 — the http.server spelling
        body = b"loading weights\n"
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):
        print("unhealthy_server:", fmt % args, flush=True)


port = int(sys.argv[sys.argv.index("--port") + 1])
print(f"unhealthy_server: listening on {port}", flush=True)
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
