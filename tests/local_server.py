"""A local HTTP server on 127.0.0.1 for the tests that fake a Google service.

`serving(server)` runs `server.serve_forever` on a daemon thread and, on exit, stops and closes
it. The poll interval is short because `shutdown()` waits out one poll: the library default
(0.5 s) made each fake-server test half a second longer than its work.

  with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as server:
    url = f"http://127.0.0.1:{server.server_address[1]}"
"""
from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def serving(server):
  """Serves `server` (a `socketserver.BaseServer`) while the block runs; yields it."""
  thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01},
                            daemon=True)
  thread.start()
  try:
    yield server
  finally:
    server.shutdown()
    server.server_close()
    thread.join()
