"""The API served by uvicorn on loopback, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ReadyServer(uvicorn.Server):
    """uvicorn's Server, saying when it listens (`ready`, set once its startup is done,
    or once it stopped without starting: `started` tells which)."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()

    def run(self, sockets=None) -> None:
        try:
            super().run(sockets=sockets)
        finally:
            self.ready.set()


class LiveServer:
    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self.server = ReadyServer(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        if not self.server.ready.wait(30) or not self.server.started:
            raise RuntimeError("uvicorn did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def serving(app, clock: Callable[[], float] | None = None) -> Iterator[LiveServer]:
    """`app` served as `python3 handler.py serve` serves handler.app (_cli_serve): the
    process's Runtime, built from the environment (with `clock`, if given), has
    SERVE_WORKER_THREADS worker threads (each with a connection of its own, started and
    warmed before the first request: handler.start_serving_threads), and uvicorn
    runs the app on loopback in a thread of this process (`server.thread` runs the event
    loop)."""
    import handler

    config = handler.load_settings()
    threads = handler.SERVE_WORKER_THREADS
    if clock is None:
        handler.use_runtime(handler.Runtime(config, worker_threads=threads))
    else:
        handler.use_runtime(handler.Runtime(config, clock=clock, worker_threads=threads))
    try:
        handler.start_serving_threads()
        with LiveServer(app) as server:
            yield server
    finally:
        handler.use_runtime(None)


class TcpProxy:
    """A loopback TCP proxy to a PostgreSQL (host and port, or unix_sock, as
    handler.connection_arguments gives them). It gives a socket-only server a TCP address,
    and it can stop forwarding (`blackhole`): bytes in both directions are then read and
    dropped, and new connections are accepted and never answered, as on a network path
    that lost its route (no reply, no reset). `cut_reply_after(marker)` loses one reply:
    the next time a client sends bytes holding `marker` (and then `more` further chunks),
    they reach the server, and the connection is cut before the server's answer comes
    back, as a network cut right after a COMMIT left would: the proxy cuts the client off
    once the server's answer has reached it (so the server has acted on those bytes), and
    drops that answer."""

    def __init__(self, target: dict):
        self.target = target
        self.blackhole = threading.Event()
        self.closing = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self._cut: tuple[bytes, int] | None = None
        self._lock = threading.Lock()
        self.cuts = 0

    def cut_reply_after(self, marker: bytes, more: int = 0) -> None:
        with self._lock:
            self._cut = (marker, more)

    def _cuts_here(self, data: bytes) -> bool:
        with self._lock:
            if self._cut is None:
                return False
            marker, more = self._cut
            if marker and marker not in data:
                return False
            if more:
                self._cut = (b"", more - 1)
                return False
            self._cut = None
            self.cuts += 1
            return True

    def _forward(self, client: socket.socket, upstream: socket.socket, dropped, answered) -> None:
        """Client to server, watching for the chunk after which the reply is lost."""
        try:
            while data := client.recv(65536):
                cut = self._cuts_here(data)
                if cut:
                    dropped.set()  # nothing more reaches the client from here on
                if not self.blackhole.is_set():
                    upstream.sendall(data)
                if cut:
                    # The server has the chunk and acts on it: its answer comes back (to
                    # be dropped here), or the connection is cut without it after a bound.
                    answered.wait(30)
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    return
        except OSError:
            pass

    def _reply(self, upstream: socket.socket, client: socket.socket, dropped, answered) -> None:
        try:
            while data := upstream.recv(65536):
                if dropped.is_set():
                    answered.set()
                elif not self.blackhole.is_set():
                    client.sendall(data)
        except OSError:
            pass
        finally:
            answered.set()  # the server closed: nothing more will come

    def _upstream(self) -> socket.socket:
        if "unix_sock" in self.target:
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.target["unix_sock"])
            return upstream
        return socket.create_connection((self.target["host"], self.target["port"]))

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self.blackhole.is_set():
                    sink.sendall(data)
        except OSError:
            pass

    def _serve(self) -> None:
        self.listener.settimeout(0.2)
        while not self.closing.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            self.sockets.append(client)
            if self.blackhole.is_set():
                threading.Thread(target=self._pump, args=(client, client), daemon=True).start()
                continue
            upstream = self._upstream()
            self.sockets.append(upstream)
            dropped, answered = threading.Event(), threading.Event()
            for pump, pair in (
                (self._forward, (client, upstream)),
                (self._reply, (upstream, client)),
            ):
                threading.Thread(target=pump, args=(*pair, dropped, answered), daemon=True).start()

    def __enter__(self) -> TcpProxy:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.closing.set()
        for sock in [*self.sockets, self.listener]:
            try:
                sock.close()
            except OSError:
                pass
