"""Connection and body limits, against the real server on loopback with raw sockets.

Every test opens a bounded number of connections to 127.0.0.1 and bounds every wait with a
socket timeout; the limits are made small so the tests stay short.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from gateway.app import create_app
from gateway.server import serve, uvicorn_config
from gateway.settings import Settings
from tests.gateway.support import free_port, seed_tenant, settings

WAIT_S = 10.0  # the most any socket read waits in these tests


@contextmanager
def live(cfg: Settings) -> Iterator[int]:
    """The gateway served by uvicorn (with `gateway.server`'s limits) in a thread; its port."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(create_app(cfg), cfg, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(15)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (a read timeout fails the test)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """False once the server has closed the connection."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


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
    body = b"x" * 60_000  # in the same reads as the head, far past the head limit
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
               b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
               % (len(body), body))
    cfg = limits(sqlite_url, tmp_path, server_header_read_timeout_s=5)
    with live(cfg) as port, connect(port) as sock:
        sock.sendall(request + request)  # and again on the same connection, pipelined
        answers = b""
        while answers.count(b"HTTP/1.1 ") < 2:
            chunk = sock.recv(65536)
            assert chunk, answers
            answers += chunk
    assert answers.count(b"HTTP/1.1 401 ") == 2  # both answered by the app, no 431


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


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_chunked_login_body_over_the_limit_is_413_without_credentials(sqlite_url,
                                                                              tmp_path):
    cfg = limits(sqlite_url, tmp_path, max_body_bytes=64 << 10,
                 server_header_read_timeout_s=5)
    with live(cfg) as port, connect(port) as sock:
        sock.sendall(b"POST /console/login HTTP/1.1\r\nhost: gw\r\n"
                     b"content-type: multipart/form-data; boundary=xx\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        send_quietly(sock, chunked(b'--xx\r\ncontent-disposition: form-data; name="f"; '
                                   b'filename="a.bin"\r\n\r\n'))
        sent = 0
        while sent < 32 << 20 and send_quietly(sock, chunked(b"z" * 65536)):
            sent += 65536
        response = read_all(sock)
    assert sent < 32 << 20  # the server stopped reading: nothing near it was received
    assert status_of(response) == 413
    assert b'"code":"body_too_large"' in response
    assert b"connection: close" in response.lower()


async def test_client_leaving_mid_body_is_a_disconnect_not_a_500(sqlite_url, tmp_path,
                                                                 caplog):
    caplog.set_level(logging.INFO, logger="switchboard.access")
    caplog.set_level(logging.DEBUG, logger="gateway.middleware")  # last: the handler's level
    tenant = await seed_tenant(sqlite_url, tmp_path, name="leaver")
    with live(limits(sqlite_url, tmp_path, server_header_read_timeout_s=5)) as port:
        for path in (b"/console/login", b"/v1/chat/completions"):
            with connect(port) as sock:
                sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: gw\r\n"
                             b"authorization: Bearer " + tenant.key.encode() + b"\r\n"
                             b"content-type: application/x-www-form-urlencoded\r\n"
                             b"content-length: 100000\r\n\r\nkey=sk-sb-admin-")
                time.sleep(0.2)  # the app is reading the body
        deadline = time.monotonic() + WAIT_S
        while sum("client disconnected mid-body" in r.getMessage()
                  for r in caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records]
    for path_ in ("/console/login", "/v1/chat/completions"):
        assert any(f"client disconnected mid-body on POST {path_}" in m for m in lines)
        assert f"POST {path_} 499" in lines
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if r.exc_info]
    assert not [m for m in lines if m.endswith(" 500")]


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
