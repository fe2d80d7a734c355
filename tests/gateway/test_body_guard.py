"""Body limits (size and read time), against the real server on loopback with raw sockets.

Every test opens a few connections to 127.0.0.1 and bounds every wait with a socket timeout
(`WAIT_S`) or a byte count; the limits are made small so the tests stay short.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.middleware import GatewayMiddleware
from gateway.settings import Settings
from tests.gateway.console.support import console
from tests.gateway.support import (
    WAIT_S,
    connect,
    live,
    read_all,
    seed_tenant,
    send_quietly,
    settings,
    status_of,
)

BODY_TIMEOUT_S = 0.5
PATHS = (b"/console/login", b"/v1/chat/completions")  # a form and a JSON body


def limits(sqlite_url: str, tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {"server_header_read_timeout_s": 5,
                                 "body_read_timeout_s": BODY_TIMEOUT_S, **overrides}
    return settings(sqlite_url, tmp_path, **values)


def post_head(path: bytes, key: str, length: int) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer "
            + key.encode() + b"\r\ncontent-type: application/x-www-form-urlencoded\r\n"
            b"content-length: %d\r\n\r\n" % length)


def dribble(sock: socket.socket, *, most: int, every_s: float) -> int:
    """Send one byte every `every_s` until the server answers or closes, `most` at most; how
    many were sent."""
    sock.settimeout(every_s)
    try:
        for sent in range(most):
            if not send_quietly(sock, b"x"):
                return sent
            try:
                sock.recv(1, socket.MSG_PEEK)  # data or the close: the server is done
            except TimeoutError:
                continue
            except ConnectionResetError:
                pass
            return sent + 1
        return most
    finally:
        sock.settimeout(WAIT_S)


def split(response: bytes) -> tuple[bytes, bytes]:
    head, _, rest = response.partition(b"\r\n\r\n")
    return head.lower(), rest


async def test_a_body_that_stops_or_dribbles_is_408_and_closed(sqlite_url, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="switchboard.access")
    caplog.set_level(logging.INFO, logger="gateway.middleware")  # last: the handler's level
    tenant = await seed_tenant(sqlite_url, tmp_path, name="slow")
    with live(limits(sqlite_url, tmp_path)) as port:
        for path in PATHS:
            with connect(port) as stops:  # a third of its body, then nothing
                stops.sendall(post_head(path, tenant.key, 300) + b"key=" + b"a" * 96)
                head, rest = split(read_all(stops))
            assert status_of(head) == 408 and b"connection: close" in head
            assert json.loads(rest)["error"] == {
                "message": f"The request body did not arrive within {BODY_TIMEOUT_S:g} seconds.",
                "type": "invalid_request_error", "param": None, "code": "body_timeout"}
            with connect(port) as dribbles:  # never idle for long, but never done either
                dribbles.sendall(post_head(path, tenant.key, 1000))
                sent = dribble(dribbles, most=200, every_s=0.05)  # 10 s at most
                head, _ = split(read_all(dribbles))
            assert sent < 200  # cut by the deadline from the head, not by an idle timer
            assert status_of(head) == 408
        with connect(port) as prompt:  # a body sent in time is served as usual
            prompt.sendall(post_head(b"/v1/chat/completions", tenant.key, 2) + b"{}")
            head, _ = split(prompt.recv(65536))
            assert status_of(head) == 400  # the app read and judged it (no model)
    lines = [r.getMessage() for r in caplog.records]
    for path_ in ("/console/login", "/v1/chat/completions"):
        timed_out = [m for m in lines if m.startswith(
            f"request body not received within {BODY_TIMEOUT_S:g}s on POST {path_}")]
        assert len(timed_out) == 2 and all(m.endswith(": 408, connection closed")
                                           for m in timed_out)
        assert lines.count(f"POST {path_} 408") == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not [m for m in lines if m.endswith(" 500")]


async def test_adapter_uploads_have_their_own_body_timeout(sqlite_url, tmp_path):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="uploader")
    cfg = limits(sqlite_url, tmp_path, body_read_timeout_s=0.3,
                 adapter_upload_read_timeout_s=60)
    body = b'--xx\r\ncontent-disposition: form-data; name="name"\r\n\r\nslow\r\n--xx--\r\n'
    with live(cfg) as port, connect(port) as sock:
        sock.sendall(b"POST /v1/adapters/upload HTTP/1.1\r\nhost: gw\r\nauthorization: "
                     b"Bearer " + tenant.key.encode() + b"\r\ncontent-type: multipart/"
                     b"form-data; boundary=xx\r\ncontent-length: %d\r\n\r\n" % len(body)
                     + body[:10])
        time.sleep(1.0)  # past the body timeout of other routes
        sock.sendall(body[10:])
        head, _ = split(sock.recv(65536))
    assert status_of(head) == 400  # the upload route read and judged it (no files)


async def test_an_answer_before_the_body_is_read_closes_the_connection(sqlite_url, tmp_path):
    # A long body timeout: what closes the connection here is the early answer.
    with live(limits(sqlite_url, tmp_path, body_read_timeout_s=60)) as port:
        with connect(port) as sock:  # a wrong key is answered before the body is read
            sock.sendall(post_head(b"/v1/chat/completions", "sk-wrong", 1000) + b"{")
            sent = dribble(sock, most=200, every_s=0.05)
            head, _ = split(read_all(sock))  # else the dribble would hold it open
        assert sent < 200
        assert status_of(head) == 401 and b"connection: close" in head
        with connect(port) as sock:  # a request without a body keeps its connection
            sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: gw\r\n\r\n" * 2)
            answers = b""
            while answers.count(b"HTTP/1.1 200 ") < 2:
                chunk = sock.recv(65536)
                assert chunk, answers
                answers += chunk
        assert b"connection: close" not in answers.lower()


class StartThenRead(Response):
    """Starts its response, then reads the body: what the app sends after the body's
    deadline must not reach the client."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"started\n", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        await send({"type": "http.response.body", "body": b"after-the-deadline\n",
                    "more_body": False})


async def start_then_read(request: Request) -> Response:
    return StartThenRead()


@pytest.mark.parametrize("close_extension", [True, False])
async def test_a_late_body_after_the_response_started_cuts_the_connection(
        close_extension, tmp_path, caplog, monkeypatch):
    if not close_extension:  # a server without it: closed on the middleware's exception
        monkeypatch.setattr("gateway.middleware.CLOSE_CONNECTION", "no.such.extension")
    caplog.set_level(logging.INFO, logger="gateway.middleware")
    app = Starlette(routes=[Route("/late", start_then_read, methods=["POST"])],
                    middleware=[Middleware(GatewayMiddleware, max_body_bytes=1 << 20,
                                           body_timeout_s=BODY_TIMEOUT_S)])
    cfg = Settings(server_header_read_timeout_s=5, log_level="warning")
    with live(cfg, app) as port, connect(port) as sock:
        sock.sendall(post_head(b"/late", "none", 100) + b"abc")
        head, rest = split(read_all(sock))
    assert status_of(head) == 200 and b"transfer-encoding: chunked" in head
    assert rest == b"8\r\nstarted\n\r\n"  # no later chunk, no last chunk: cut
    assert [r.getMessage() for r in caplog.records if r.name == "gateway.middleware"] == [
        f"request body not received within {BODY_TIMEOUT_S:g}s on POST /late "
        "(3 bytes arrived): response cut, connection closed"]
    if close_extension:  # closed as a client disconnect: uvicorn logs nothing
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_chunked_login_body_over_the_limit_is_413_without_credentials(sqlite_url,
                                                                              tmp_path):
    """The sign-in form has its own small limit (64 KiB by default), far under the 4 MiB of
    other routes: a chunked body past it is refused as it arrives, the rest never read."""
    cfg = limits(sqlite_url, tmp_path, body_read_timeout_s=30)
    assert cfg.max_login_body_bytes == 64 << 10 < cfg.max_body_bytes
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
    assert sent < 32 << 20  # the server stopped reading (the rest sits in socket buffers)
    assert status_of(response) == 413
    assert b'"code":"body_too_large"' in response
    assert b"larger than 65536 bytes" in response
    assert b"connection: close" in response.lower()


async def test_login_reads_no_chunk_past_its_limit_and_a_normal_login_works(sqlite_url,
                                                                            tmp_path):
    pulled = 0

    async def body():  # 4 MiB in 16 KiB chunks, counted as the app pulls them
        nonlocal pulled
        for _ in range(256):
            pulled += 1
            yield b"key=" + b"k" * (16 << 10)

    async with console(sqlite_url, tmp_path, login=False) as c:
        response = await c.client.post("/console/login", content=body(), headers={
            "content-type": "application/x-www-form-urlencoded"})
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "body_too_large"
        assert pulled <= 5  # 64 KiB is the fifth chunk: nothing after it was read
        assert (await c.login()).status_code == 303  # a real sign-in fits well within it
        assert (await c.client.get("/console/tenants")).status_code == 200


async def test_login_body_announced_past_its_limit_is_413_unread(sqlite_url, tmp_path):
    cfg = limits(sqlite_url, tmp_path, max_login_body_bytes=4096, body_read_timeout_s=30)
    with live(cfg) as port, connect(port) as sock:
        sock.sendall(post_head(b"/console/login", "none", 5000))  # no body byte sent
        response = read_all(sock)
    assert status_of(response) == 413
    assert b"larger than 4096 bytes" in response
    assert b"connection: close" in response.lower()


async def test_client_leaving_mid_body_is_a_disconnect_not_a_500(sqlite_url, tmp_path,
                                                                 caplog):
    caplog.set_level(logging.INFO, logger="switchboard.access")
    caplog.set_level(logging.DEBUG, logger="gateway.middleware")  # last: the handler's level
    tenant = await seed_tenant(sqlite_url, tmp_path, name="leaver")
    with live(limits(sqlite_url, tmp_path, body_read_timeout_s=30)) as port:
        for path in PATHS:
            with connect(port) as sock:
                # within every limit, the sign-in form's 64 KiB included
                sock.sendall(post_head(path, tenant.key, 60000) + b"key=sk-sb-admin-")
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
