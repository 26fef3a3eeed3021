"""A test's in-process HTTP server, served from a thread and stopped at once."""

from __future__ import annotations

import contextlib
import socketserver
import threading
from collections.abc import Iterator

# How often a test's HTTP server looks for a shutdown request: shutdown() waits for the next
# look, and serve_forever's default (0.5 s) made each stop cost half a second.
SERVER_POLL_S = 0.01


@contextlib.contextmanager
def http_served(server: socketserver.BaseServer) -> Iterator[str]:
    """Serve `server` (bound to 127.0.0.1) from a daemon thread; yields its URL. On exit it
    stops within SERVER_POLL_S and frees its port."""
    threading.Thread(target=server.serve_forever, args=(SERVER_POLL_S,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
