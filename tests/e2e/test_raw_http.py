"""Raw HTTP oddities sent over sockets to a real ``wheelhouse serve`` (gunicorn): malformed
request lines, hosts, encodings, framing and bodies that no HTTP library would send.

Allowed answers: 2xx, 3xx, 4xx (from gunicorn or from us) or 503, each with a body that says
something; never a 500, never a hang. A curated table first, then a Hypothesis sample of
random request targets, header values and bodies. What was seen goes to
``test-artifacts/fuzz-raw.json``.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import IndexURL, start_index
from tests.web.buildhelpers import advertise_worker
from wheelhouse.config import Config
from wheelhouse.index.tokens import create_token
from wheelhouse.redisconn import queue_client

#: Seconds a request may take before it counts as a hang.
ANSWER_WITHIN = 10.0
#: Random requests sent after the table.
EXAMPLES = 150


def _request(line: bytes, *headers: bytes, body: bytes = b"") -> bytes:
    return line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def _close(*headers: bytes, host: bytes = b"Host: wheels.test") -> tuple[bytes, ...]:
    return (host, *headers, b"Connection: close")


def _json_post(path: bytes, body: bytes, *extra: bytes) -> bytes:
    return _request(b"POST " + path + b" HTTP/1.1", *_close(
        b"Content-Type: application/json", b"Content-Length: %d" % len(body), *extra),
        body=body)


TABLE: dict[str, bytes] = {
    "plain": _request(b"GET /healthz HTTP/1.1", *_close()),
    "Host punycode that isn't": _request(b"GET /login HTTP/1.1", *_close(host=b"Host: xn--a")),
    "Host '..'": _request(b"GET /login HTTP/1.1", *_close(host=b"Host: ..")),
    "Host 300 chars": _request(b"GET / HTTP/1.1", *_close(host=b"Host: " + b"a" * 300)),
    "Host Latin-1": _request(b"GET / HTTP/1.1", *_close(host=b"Host: ex\xe4mple")),
    "Host with a path": _request(b"GET / HTTP/1.1", *_close(host=b"Host: a/b@c")),
    "two Hosts": _request(b"GET / HTTP/1.1", b"Host: a", *_close(host=b"Host: b")),
    "no Host, HTTP/1.0": _request(b"GET /healthz HTTP/1.0"),
    "HTTP/0.9": b"GET /healthz\r\n\r\n",
    "bad method token": _request(b"G@T / HTTP/1.1", *_close()),
    "unknown method": _request(b"BREW /matrix HTTP/1.1", *_close()),
    "raw bytes in the path": _request(b"GET /torch2.8-cu128/simple/\xff\xfe/ HTTP/1.1", *_close()),
    "percent-encoded non-UTF-8": _request(b"GET /torch2.8-cu128/simple/%ff%fe/ HTTP/1.1",
                                          *_close()),
    "malformed escape in the path": _request(b"GET /login/%zz HTTP/1.1", *_close()),
    "malformed escape in the query": _request(b"GET /matrix?project=%zz HTTP/1.1", *_close()),
    "NUL in the path": _request(b"GET /he\x00althz HTTP/1.1", *_close()),
    "absolute-form target": _request(b"GET http://evil.example/healthz HTTP/1.1", *_close()),
    "broken absolute-form": _request(b"GET http://[::1/healthz HTTP/1.1", *_close()),
    "asterisk-form": _request(b"OPTIONS * HTTP/1.1", *_close()),
    "9 KB target": _request(b"GET /" + b"a" * 9000 + b" HTTP/1.1", *_close()),
    "9 KB header": _request(b"GET / HTTP/1.1", *_close(b"X-A: " + b"a" * 9000)),
    "200 headers": _request(b"GET / HTTP/1.1",
                            *_close(*(b"X-%d: 1" % i for i in range(200)))),
    "header without colon": _request(b"GET / HTTP/1.1", *_close(b"Broken")),
    "obsolete line folding": _request(b"GET / HTTP/1.1", *_close(b"X-A: a\r\n b")),
    "bare LF": b"GET /healthz HTTP/1.1\nHost: x\nConnection: close\n\n",
    "body shorter than Content-Length": _request(
        b"POST /api/builds HTTP/1.1", *_close(b"Content-Type: application/json",
                                              b"Content-Length: 100"), body=b"{}"),
    "negative Content-Length": _request(b"POST /login HTTP/1.1",
                                        *_close(b"Content-Length: -1")),
    "20-digit Content-Length": _request(b"POST /api/builds HTTP/1.1",
                                        *_close(b"Content-Length: 99999999999999999999")),
    "two Content-Lengths": _request(b"POST /login HTTP/1.1", *_close(
        b"Content-Length: 1", b"Content-Length: 2"), body=b"ab"),
    "Transfer-Encoding and Content-Length": _request(b"POST /login HTTP/1.1", *_close(
        b"Content-Length: 4", b"Transfer-Encoding: chunked"), body=b"0\r\n\r\n"),
    "bad chunk size": _request(b"POST /login HTTP/1.1", *_close(
        b"Transfer-Encoding: chunked"), body=b"zz\r\nabc\r\n0\r\n\r\n"),
    "chunked body past the limit": _request(b"POST /api/builds HTTP/1.1", *_close(
        b"Transfer-Encoding: chunked", b"Content-Type: application/json"),
        body=b"20000\r\n" + b"[" * 0x20000 + b"\r\n0\r\n\r\n"),
    "Transfer-Encoding gzip": _request(b"POST /login HTTP/1.1",
                                       *_close(b"Transfer-Encoding: gzip")),
    "1,000-deep JSON": _json_post(b"/api/builds", b"[" * 1000 + b"]" * 1000),
    "TLS handshake": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(256)),
    "empty lines only": b"\r\n\r\n",
    "Range of nonsense": _request(b"GET /healthz HTTP/1.1", *_close(b"Range: bytes=--1")),
    "HTTP/2.0 line": _request(b"GET /healthz HTTP/2.0", *_close()),
    "open redirect via tab": _request(b"GET /login?next=/%09/evil.example HTTP/1.1", *_close()),
    "open redirect via CRLF": _request(b"GET /login?next=/%0d%0aLocation:%20x HTTP/1.1",
                                       *_close()),
    "non-UTF-8 cookie": _request(b"GET /matrix HTTP/1.1",
                                 *_close(b"Cookie: wheelhouse_session=\xff\xfe; a")),
    "non-UTF-8 basic auth": _request(b"GET /api/workers HTTP/1.1",
                                     *_close(b"Authorization: Basic \xff\xff")),
    "bad Bearer": _request(b"POST /api/builds HTTP/1.1",
                           *_close(b"Authorization: Bearer \xff" + b"x" * 5000)),
}


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, redis_server: str) -> Iterator[IndexURL]:
    tmp = tmp_path_factory.mktemp("raw-http")
    url = f"{redis_server}/14"
    conn = queue_client(Config(redis_url=url))
    conn.flushdb()
    advertise_worker(conn, ttl=3600)
    create_token(conn, "raw")
    conn.close()
    config = Config(storage=str(tmp / "data"), redis_url=url, upstream="off",
                    login_rate_limit="100000/60", torch_check=False)
    with start_index(config, tmp) as served:
        yield served


@pytest.fixture(scope="module")
def seen(artifacts_dir: Path) -> Iterator[Counter[str]]:
    """The statuses the raw requests got, written to ``fuzz-raw.json`` once the module's tests
    are done, whichever ran and in whatever order."""
    statuses: Counter[str] = Counter()
    yield statuses
    (artifacts_dir / "fuzz-raw.json").write_text(json.dumps(
        {"requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items()))},
        indent=1))


def _exchange(index: IndexURL, raw: bytes) -> bytes:
    port = int(index.rsplit(":", 1)[1])
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN) as sock:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)  # a short body ends here, not at a timeout
        except TimeoutError:
            raise  # the server stopped reading without answering: a hang
        except OSError:
            pass  # it answered (a 413, say) and closed before the rest was sent: read that
        try:
            while chunk := sock.recv(65536):  # socket.timeout here is a hang
                answer += chunk
        except ConnectionResetError:
            pass  # what was read before the reset is the answer
    return answer


def _judge(seen: Counter[str], what: str, raw: bytes, answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0]
    parts = status_line.split(b" ", 2)
    assert len(parts) >= 2 and parts[0].startswith(b"HTTP/1."), (what, raw[:200], answer[:300])
    status = int(parts[1])
    seen[str(status)] += 1
    assert status < 500 or status == 503, (what, raw[:200], answer[:500])
    if status >= 400 and not raw.startswith(b"HEAD "):
        assert body.strip(), (what, answer[:300])  # says why
    if b"evil.example" in raw and 300 <= status < 400:
        location = [h for h in head.split(b"\r\n") if h.lower().startswith(b"location:")]
        assert not any(b"evil" in h for h in location), (what, location)


@pytest.mark.parametrize("what", list(TABLE))
def test_raw_oddities_get_a_4xx_or_an_answer(index: IndexURL, seen: Counter[str],
                                             what: str) -> None:
    _judge(seen, what, TABLE[what], _exchange(index, TABLE[what]))


_target = st.binary(min_size=1, max_size=300).map(
    lambda b: b"/" + b.replace(b" ", b"%20").replace(b"\r", b"").replace(b"\n", b""))
_header_value = st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_header_name = st.sampled_from([b"Host", b"Accept", b"Range", b"Authorization", b"Cookie",
                                b"If-None-Match", b"Content-Type", b"X-Request-ID", b"Origin"])
_path = st.sampled_from([b"/", b"/matrix", b"/login", b"/api/builds", b"/api/workers",
                         b"/torch2.8-cu128/simple/", b"/torch2.8-cu128/simple/x/",
                         b"/files/torch2.8-cu128/x/x-1-py3-none-any.whl", b"/request",
                         b"/builds/x", b"/healthz", b"/readyz"])


@given(method=st.sampled_from([b"GET", b"HEAD", b"POST", b"PUT", b"OPTIONS", b"DELETE"]),
       target=st.one_of(_target, _path, st.tuples(_path, st.binary(max_size=100)).map(
           lambda t: t[0] + b"?" + t[1].replace(b" ", b"+").replace(b"\r", b"")
           .replace(b"\n", b""))),
       headers=st.lists(st.tuples(_header_name, _header_value), max_size=4),
       body=st.binary(max_size=500))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_random_raw_requests(index: IndexURL, seen: Counter[str], method: bytes, target: bytes,
                             headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    lines = [name + b": " + value for name, value in headers]
    if not any(name == b"Host" for name, _ in headers):
        lines.insert(0, b"Host: wheels.test")
    raw = _request(method + b" " + target + b" HTTP/1.1", *lines,
                   b"Content-Length: %d" % len(body), b"Connection: close", body=body)
    _judge(seen, "random", raw, _exchange(index, raw))

