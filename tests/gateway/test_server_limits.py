"""Connection limits, against the real server on loopback with raw sockets (the body
limits are in test_body_guard.py).

Every test opens a bounded number of connections to 127.0.0.1 and bounds every wait with a
socket timeout; the limits are made small so the tests stay short.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.server import serve, uvicorn_config
from gateway.settings import Settings
from tests.gateway.support import (
    connect,
    live,
    read_all,
    seed_tenant,
    send_quietly,
    settings,
    status_of,
)


def limits(sqlite_url: str, tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "server_header_read_timeout_s": 0.5, "server_max_header_bytes": 8192,
        "server_max_connections": 50, "log_level": "warning", **overrides}
    return settings(sqlite_url, tmp_path, **values)


GET_LIVE = b"GET /health/live HTTP/1.1\r\nhost: gw\r\n\r\n"


async def test_half_sent_head_is_closed_after_the_timeout(sqlite_url, tmp_path):
    with live(limits(sqlite_url, tmp_path)) as port:
        half, silent = connect(port), connect(port)
        with half, silent:
            half.sendall(b"GET /health/live HTTP/1.1\r\nhost: gw\r\nx-slow: aaa")
            assert status_of(read_all(half)) == 408
            assert status_of(read_all(silent)) == 408  # never sent a byte
        with connect(port) as ok:  # a whole head in time is served as usual
            ok.sendall(GET_LIVE)
            assert status_of(ok.recv(65536)) == 200


async def test_a_slow_second_head_on_a_keep_alive_connection_times_out(sqlite_url, tmp_path):
    cfg = limits(sqlite_url, tmp_path, server_keep_alive_timeout_s=5)
    with live(cfg) as port, connect(port) as sock:
        sock.sendall(GET_LIVE)
        assert status_of(sock.recv(65536)) == 200
        sock.sendall(b"GET /health/live HTTP/1.1\r\n")  # then nothing more
        assert status_of(read_all(sock)) == 408


async def test_oversized_head_is_431_and_closed(sqlite_url, tmp_path):
    with live(limits(sqlite_url, tmp_path, server_header_read_timeout_s=5)) as port:
        with connect(port) as sock:  # one complete head over the limit
            sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: gw\r\nx-big: "
                         + b"a" * 20_000 + b"\r\n\r\n")
            assert status_of(read_all(sock)) == 431
        with connect(port) as sock:  # an unterminated header growing without end
            sent = 0
            while sent < 8 << 20 and send_quietly(sock, b"GET / HTTP/1.1\r\nx: " if not sent
                                                 else b"b" * 65536):
                sent += 65536
            assert sent < 8 << 20  # closed long before
            assert status_of(read_all(sock)) == 431


async def test_a_small_head_sent_with_a_large_body_is_not_refused(sqlite_url, tmp_path):
    # A valid key, so the app reads each body (an unread body would close the connection).
    tenant = await seed_tenant(sqlite_url, tmp_path, name="pipeliner")
    body = b"x" * 60_000  # in the same reads as the head, far past the head limit
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer "
               + tenant.key.encode() + b"\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))
    cfg = limits(sqlite_url, tmp_path, server_header_read_timeout_s=5)
    with live(cfg) as port, connect(port) as sock:
        sock.sendall(request + request)  # and again on the same connection, pipelined
        answers = b""
        while answers.count(b"HTTP/1.1 ") < 2:
            chunk = sock.recv(65536)
            assert chunk, answers
            answers += chunk
    assert answers.count(b"HTTP/1.1 400 ") == 2  # both read and answered by the app, no 431


async def test_unterminated_heads_do_not_grow_memory(sqlite_url, tmp_path):
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    with live(limits(sqlite_url, tmp_path, server_header_read_timeout_s=5)) as port:
        before = rss()
        socks = [connect(port) for _ in range(10)]
        try:
            for sock in socks:  # each would be 4 MiB of header
                send_quietly(sock, b"GET / HTTP/1.1\r\nx: ")
                for _ in range(64):
                    if not send_quietly(sock, b"c" * 65536):
                        break
            assert all(status_of(read_all(sock)) == 431 for sock in socks)
        finally:
            for sock in socks:
                sock.close()
        assert rss() - before < 16 << 20  # 40 MiB sent; held at most a read past 8 KiB each


async def test_connections_past_the_cap_are_refused(sqlite_url, tmp_path):
    cfg = limits(sqlite_url, tmp_path, server_max_connections=3,
                 server_header_read_timeout_s=5)
    with live(cfg) as port:
        held = [connect(port) for _ in range(3)]
        try:
            time.sleep(0.2)  # the server has accepted them
            with connect(port) as extra:
                assert status_of(read_all(extra)) == 503
            held.pop().close()
            time.sleep(0.2)
            with connect(port) as again:  # a freed place is usable again
                again.sendall(GET_LIVE)
                assert status_of(again.recv(65536)) == 200
        finally:
            for sock in held:
                sock.close()


@pytest.mark.parametrize("server", ["uvicorn"])
def test_serve_passes_the_limits_to_uvicorn(server, tmp_path):
    cfg = Settings(server=server, server_keep_alive_timeout_s=7, server_max_header_bytes=1234,
                   server_header_read_timeout_s=3, server_max_connections=9)
    config = uvicorn_config(create_app(cfg), cfg, host="127.0.0.1", port=1)
    assert config.timeout_keep_alive == 7
    limits_ = config.http.limits  # type: ignore[union-attr]
    assert (limits_.max_header_bytes, limits_.header_read_timeout_s,
            limits_.max_connections) == (1234, 3, 9)


def test_granian_gets_the_same_limits(monkeypatch):
    granian_server = pytest.importorskip("granian.server")
    seen = {}

    class Recorder:
        def __init__(self, target, **kwargs):
            seen.update(kwargs, target=target)

        def serve(self):
            seen["served"] = True

    monkeypatch.setattr(granian_server, "Server", Recorder)
    cfg = Settings(server="granian", server_max_header_bytes=100_000,
                   server_header_read_timeout_s=2.5, server_max_connections=40)
    serve(None, cfg, host="127.0.0.1", port=1)
    assert seen["target"] == "gateway.server:granian_app" and seen["factory"] and seen["served"]
    http1 = seen["http1_settings"]
    assert (http1.header_read_timeout, http1.max_buffer_size) == (2500, 100_000)
    assert seen["backpressure"] == 40
