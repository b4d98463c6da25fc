"""The API served by uvicorn on loopback, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LiveServer:
    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class TcpProxy:
    """A loopback TCP proxy to a PostgreSQL (host and port, or unix_sock, as
    handler.connection_arguments gives them). It gives a socket-only server a TCP address,
    and it can stop forwarding (`blackhole`): bytes in both directions are then read and
    dropped, and new connections are accepted and never answered, as on a network path
    that lost its route (no reply, no reset)."""

    def __init__(self, target: dict):
        self.target = target
        self.blackhole = threading.Event()
        self.closing = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []

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
            for pair in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=pair, daemon=True).start()

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
