"""A TCP proxy on 127.0.0.1 in front of a test server, that a test can take down or make hang.

``StoreProxy(port)`` forwards every connection to ``127.0.0.1:port`` while ``up``. ``down()``
cuts every open connection and answers new ones by closing them at once (a server that is
unreachable); ``hang()`` cuts every open connection and accepts new ones without ever
answering (a server that accepts connections and never replies); ``up()`` forwards again.
Used by the ``s3_proxy`` fixture (``conftest.py``); it stops with ``close()``.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class StoreProxy:
    def __init__(self, target_port: int):
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._mode = "up"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []  # every socket of every connection, to cut them
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="store-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        self._set("up")

    def down(self) -> None:
        self._set("down")

    def hang(self) -> None:
        self._set("hang")

    def _set(self, mode: str) -> None:
        with self._lock:
            self._mode = mode
            cut, self._open = self._open, []
        for sock in cut:
            _close(sock)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._set("down")
        _close(self._listener)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                mode = self._mode
                self.accepted += 1
                if mode == "hang":
                    self._open.append(client)  # held, never read or answered
                    continue
            if mode == "down":
                _close(client)
                continue
            try:
                server = socket.create_connection(self._target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=_pump, args=(client, server), daemon=True).start()


def _pump(a: socket.socket, b: socket.socket) -> None:
    """Copies bytes both ways until either side closes (or the proxy cuts them)."""
    with selectors.DefaultSelector() as sel:
        try:
            sel.register(a, selectors.EVENT_READ, b)
            sel.register(b, selectors.EVENT_READ, a)
            while True:
                for key, _ in sel.select(timeout=1.0):
                    data = key.fileobj.recv(1 << 16)
                    if not data:
                        return
                    key.data.sendall(data)
        except (OSError, ValueError):
            return
        finally:
            _close(a)
            _close(b)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
