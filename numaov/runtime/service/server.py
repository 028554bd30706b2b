"""Running the application: a socket bound before the models load, then uvicorn until a
signal, and a stop that is always bounded.

The first SIGTERM or SIGINT stops admitting (the socket closes; idle connections are closed),
calls ``on_stop`` (the video service cancels its jobs and kills its worker at once) and lets
the requests in flight finish (LM streams run to their end) for ``timeout_s`` less
``CLOSE_RESERVE_S``; what is still running then is cancelled, and the caller closes the
workers. A second signal, of either kind, stops at once: the requests in flight are
cancelled. Either way the process has exited ``timeout_s`` after the first signal: past it, a
watchdog kills the worker processes and exits (status 1).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from numaov.runtime.service.lm_service import ServiceError

GIL_SWITCH_S = 0.0005
SHUTDOWN_TIMEOUT_S = 30.0
# Of the bound, what is kept after the drain for closing the workers (they stop in about a
# second; the engine finishes its step first).
CLOSE_RESERVE_S = 5.0

logger = logging.getLogger(__name__)


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


def drain_seconds(timeout_s: float) -> float:
    """How long the requests in flight may run on after the first signal."""
    return max(timeout_s - CLOSE_RESERVE_S, timeout_s / 2)


class _StopMessages(logging.Filter):
    """uvicorn's words for the stop, in numaov's: an answer cancelled by it (past the drain,
    or forced) is logged as an "Exception in ASGI application" with a CancelledError
    traceback, and the cancel at the drain's end as an error; the cancel is the stop's own
    doing, said on the console once."""

    def __init__(self, tell: Callable[[str], None], drain: float) -> None:
        super().__init__()
        self.tell = tell
        self.drain = drain

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            return False
        if str(record.msg).startswith("Cancel %s running task(s)"):
            self.tell(f"cancelling {record.args[0] if record.args else 'the'} request(s) still "
                      f"in flight after {self.drain:g} s")
            return False
        return True


def _watchdog(deadline: float, tell: Callable[[str], None]) -> None:
    """Past ``deadline``, kill this process's worker processes and exit: the bound holds even
    if closing them hangs."""
    time.sleep(max(0.0, deadline - time.monotonic()))
    tell("did not stop in time; killing the workers and exiting")
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(1)


def serve_forever(app: Any, sock: socket.socket, notify: Callable[[str], None] | None = None,
                  *, on_stop: Callable[[], None] | None = None,
                  timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Serve ``app`` with uvicorn on ``sock`` until SIGINT or SIGTERM, then return (see the
    module's docstring); ``notify`` is told what happens, ``on_stop`` is called at the first
    signal. The caller closes its services after it returns: the process is killed if that
    is not done ``timeout_s`` after the first signal."""
    import uvicorn

    tell = notify or (lambda _msg: None)
    drain = drain_seconds(timeout_s)

    class Server(uvicorn.Server):
        # The signal handler only sets flags (printing or taking a lock there could
        # deadlock with the code it interrupted); on_tick, on the event loop, acts on them.
        # Signals are not re-raised after the stop (uvicorn would, as KeyboardInterrupt).
        stop_seen = False
        forced: asyncio.Future | None = None
        forced_said = False

        def handle_exit(self, sig: int, frame: object) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        async def on_tick(self, counter: int) -> bool:
            should_exit = await super().on_tick(counter)
            if should_exit and not self.stop_seen:
                self.stop_seen = True
                threading.Thread(target=_watchdog, args=(time.monotonic() + timeout_s, tell),
                                 name="numaov-stop-watchdog", daemon=True).start()
                tell(f"stopping: no new requests; the ones in flight have {drain:g} s to "
                     "finish (a second signal stops at once)")
                if on_stop is not None:
                    on_stop()
                self.forced = asyncio.ensure_future(self.say_forced())
            return should_exit

        async def say_forced(self) -> None:
            while not self.force_exit:
                await asyncio.sleep(0.05)
            self.said_forced()

        def said_forced(self) -> None:
            if not self.forced_said:
                self.forced_said = True
                tell("stopping now: the requests in flight are cancelled")

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)
            if self.force_exit:  # said here too: the task above may not get its turn
                self.said_forced()

    server = Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                   timeout_graceful_shutdown=drain))
    # A request crosses threads several times (event loop -> parsing thread -> engine loop
    # thread -> event loop); each hand-over of the GIL can wait out the switch interval
    # (5 ms by default) while another thread computes, which added ~20 ms to the first token.
    sys.setswitchinterval(GIL_SWITCH_S)
    quiet = _StopMessages(tell, drain)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    try:
        server.run(sockets=[sock])
    finally:
        uvicorn_log.removeFilter(quiet)
