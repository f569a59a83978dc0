"""The gunicorn worker ``wheelhouse serve`` runs: gevent's, with ``sendfile(2)`` kept.

A thread-per-connection worker (gthread, sync) hands a connection a thread as soon as it is
accepted, before its request has arrived: a few clients that trickle their headers hold every
thread, and ``/healthz`` stops answering (issue 26). gevent's worker gives each connection a
greenlet instead, parked on the socket until bytes come, so a thousand slow clients cost a
thousand small stacks and the index keeps answering.

One thing gevent takes away: its socket's ``sendfile`` reads the file through Python in 8 KiB
blocks (``os.sendfile`` on a blocking descriptor would stall every greenlet of the worker),
which would cost local wheel downloads several times their CPU (docs/downloads.md). The
connection's socket here sends with ``os.sendfile`` on its non-blocking descriptor and waits in
gevent's hub whenever the kernel's send buffer is full: one system call per buffer, no byte
through Python, and other connections keep being served meanwhile.

Nothing here is imported before the worker forks and gevent patches the process
(``GeventWorker.init_process``); ``web.cli`` builds the application after that, in the worker,
so the clients it holds (boto3's, redis-py's) are made of patched sockets, locks and TLS.
"""

from __future__ import annotations

import os
from typing import IO, Any

from gevent import socket as gsocket
from gunicorn.workers import ggevent


class _SendfileSocket(gsocket.socket):  # type: ignore[misc]
    """A gevent socket whose ``sendfile`` is the kernel's, cooperatively."""

    def sendfile(self, file: IO[bytes], offset: int = 0, count: int | None = None) -> int:
        out_fd, in_fd = self.fileno(), file.fileno()
        sent = 0
        while count is None or sent < count:
            # Linux caps one call near 2 GiB whatever is asked; the loop sends the rest.
            want = (count - sent) if count is not None else 0x7FFFF000
            try:
                n = os.sendfile(out_fd, in_fd, offset + sent, want)
            except BlockingIOError:
                # The descriptor is non-blocking (gevent keeps it so): wait in the hub for
                # room in the send buffer, within the socket's own timeout, then go on.
                self._wait(self._write_event)
                continue
            if n == 0:  # end of file (the file shrank): send no more than there is
                break
            sent += n
        # As socket.sendfile does, the descriptor's position ends after what was sent (through
        # the descriptor: gunicorn hands over file-likes that have no ``seek``).
        os.lseek(in_fd, offset + sent, os.SEEK_SET)
        return sent


class GeventWorker(ggevent.GeventWorker):  # type: ignore[misc]
    """gunicorn's gevent worker, its connections on :class:`_SendfileSocket`."""

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        own = _SendfileSocket(client.family, client.type, client.proto, fileno=client.detach())
        super().handle(listener, own, addr)
