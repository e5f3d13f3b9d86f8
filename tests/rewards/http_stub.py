"""Test HTTP servers in a thread: a handler base that answers GET with 405 and logs nothing, and `serve`, which starts
a `ThreadingHTTPServer` on a free local port."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """POST is the subclass's; GET is refused with 405; nothing is logged."""

    def do_GET(self):  # noqa: N802
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """`handler` served on 127.0.0.1 at a free port, in a daemon thread."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd
