"""Ports, waiting for things, and small real servers on loopback."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:

    pass



@contextlib.contextmanager
def moto_s3_server() -> Iterator[str]:
    """moto's S3 API in server mode over HTTP on loopback, until the block ends; yields its
    endpoint URL (the tests' ``s3_server`` fixture, the benches)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds. The
    deadline only bounds a hang: a test waits for the event, never for a fixed time."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


class Listener:
    """A TCP listener on every host address that counts the connections it accepts; with
    ``abstract``, a unix socket of that name in the abstract namespace instead."""

    def __init__(self, abstract: str | None = None) -> None:
        if abstract is None:
            self.sock = socket.socket()
            self.sock.bind(("0.0.0.0", 0))  # reachable on every address
        else:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.bind("\0" + abstract)
        self.sock.listen(16)
        self.port: int = self.sock.getsockname()[1] if abstract is None else 0
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self._thread.join(timeout=5)


def host_addresses() -> list[str]:
    """This host's IPv4 addresses besides loopback (a build must reach none of them)."""
    found = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                found.append(addr.address)
    return found


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler for small test servers: ``send_body`` and no access log on stderr."""

    def send_body(self, body: bytes, content_type: str, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_http(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server on a free loopback port in a thread; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def simple_index(wheels: dict[str, list[Path]]) -> type[BaseHTTPRequestHandler]:
    """A PEP 691 upstream index serving ``wheels`` (project -> its files, read per request: a
    test may add a project while it serves, as an outsider registering a name would), with
    ``HEAD`` on files as uv asks before a ranged metadata read."""

    def files() -> dict[str, Path]:
        return {w.name: w for ws in wheels.values() for w in ws}

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            name = self.path.strip("/").removeprefix("simple/")
            found = files()
            if self.path.startswith("/files/") and self.path[7:] in found:
                self.send_body(found[self.path[7:]].read_bytes(), "application/octet-stream")
            elif name in wheels:
                page = {"meta": {"api-version": "1.1"}, "name": name, "files": [
                    {"filename": w.name, "url": f"/files/{w.name}",
                     "hashes": {"sha256": hashlib.sha256(w.read_bytes()).hexdigest()}}
                    for w in wheels[name]]}
                self.send_body(json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json")
            else:
                self.send_error(404)

        def do_HEAD(self) -> None:
            wheel = files().get(self.path.removeprefix("/files/"))
            if wheel is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(wheel.stat().st_size))
            self.end_headers()

    return Handler
