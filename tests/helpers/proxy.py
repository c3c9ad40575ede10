"""A TCP forwarder on a loopback port: a broker address that starts answering when a test says so."""
from __future__ import annotations

import contextlib
import socket
import threading


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def forward(port: int, target: str):
    """Accept on 127.0.0.1:port and forward each connection to target (host:port), until the block ends."""
    host, _, target_port = target.rpartition(":")
    server = socket.create_server(("127.0.0.1", port))
    server.settimeout(0.2)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            upstream = socket.create_connection((host, int(target_port)))
            conns.extend((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        server.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()
