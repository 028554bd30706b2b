"""Running the application: a socket bound before the models load, then uvicorn until a
signal, draining the requests in flight."""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from numaov.runtime.service.lm_service import ServiceError

GIL_SWITCH_S = 0.0005


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0 picks a free port); bind it before starting the
    workers, so a taken port fails in a second rather than after loading the model."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: an answer's headers and body (or a stream's
        # chunks) go out at once instead of the body waiting for the client's delayed ACK of
        # the headers (40 ms on Linux, measured on every answer after a connection's first).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        # listening from here on: a client that connects once the URL is printed waits in the
        # backlog until uvicorn accepts, instead of being refused
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ServiceError(f"cannot listen on {host}:{port} ({exc.strerror}); expected a free "
                           "port on a local address", parameter="port") from None
    return sock


def serve_forever(app: Any, sock: socket.socket,
                  notify: Callable[[str], None] | None = None) -> None:
    """Serve ``app`` with uvicorn on ``sock`` until SIGINT or SIGTERM, then return.

    The first signal stops once the request in flight is answered (``notify`` is told so);
    a second one forces. SIGTERM is handled like Ctrl-C for the time of the call, so the
    caller's cleanup (closing the service and its workers) runs either way.
    """
    import uvicorn

    tell = notify or (lambda _msg: None)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            if not self.should_exit:  # the first signal drains; a second one forces
                tell("stopping once the request in flight is answered (again to force)")
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    # A request crosses threads several times (event loop -> parsing thread -> engine loop
    # thread -> event loop); each hand-over of the GIL can wait out the switch interval
    # (5 ms by default) while another thread computes, which added ~20 ms to the first token.
    sys.setswitchinterval(GIL_SWITCH_S)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
