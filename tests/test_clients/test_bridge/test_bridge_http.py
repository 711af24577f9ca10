"""Tests of clients/bridge/http.py: the page, /healthz and the handshake checks (no Triton)."""

from __future__ import annotations

import asyncio
import json

import pytest
from bridge_support import frame, http_get, next_frame, running_bridge, ws_url
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from clients.bridge.http import HEALTH_PATH, host_allowed, origin_allowed


@pytest.mark.parametrize(
    ("origin", "host", "origins", "ok"),
    [
        (None, "127.0.0.1:8080", (), True),
        ("http://127.0.0.1:8080", "127.0.0.1:8080", (), True),
        ("http://LOCALHOST:8080", "localhost:8080", (), True),
        ("http://evil.example", "127.0.0.1:8080", (), False),
        ("http://127.0.0.1:9999", "127.0.0.1:8080", (), False),
        ("https://app.example", "127.0.0.1:8080", ("https://app.example",), True),
        ("http://127.0.0.1:8080", "127.0.0.1:8080", ("https://app.example",), False),
        ("http://anything", "127.0.0.1:8080", ("*",), True),
    ],
)
def test_origin_allow_list(origin, host, origins, ok):
    """Same origin by default; an explicit list replaces it; '*' allows any."""
    assert origin_allowed(origin, host, origins) is ok


@pytest.mark.parametrize(
    ("host_header", "bind", "ok"),
    [
        ("127.0.0.1:8080", "127.0.0.1", True),
        ("localhost:8080", "127.0.0.1", True),
        ("[::1]:8080", "::1", True),
        ("evil.example:8080", "127.0.0.1", False),
        (None, "127.0.0.1", False),
        ("bridge.example:8080", "0.0.0.0", True),  # not loopback: names are the proxy's job
    ],
)
def test_host_allowed_only_loopback_names_on_loopback(host_header, bind, ok):
    """A loopback bridge answers only to loopback Host names (DNS rebinding)."""
    assert host_allowed(host_header, bind) is ok


async def test_page_static_files_and_404():
    """/ serves the chat page with a strict CSP (nothing inline, nothing from elsewhere); its
    scripts, styles and vendored libraries load (not their license texts); other paths are 404."""
    async with running_bridge() as bridge:
        status, headers, body = await http_get(bridge, "/")
        csp = headers["Content-Security-Policy"]
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert b'src="app.js"' in body and "default-src 'self'" in csp
        assert "unsafe" not in csp and "script-src" not in csp and "style-src" not in csp
        for path in ("/app.js", "/markdown.js", "/store.js", "/view.js", "/vendor/marked.min.js"):
            status, headers, _ = await http_get(bridge, path)
            assert status == 200 and headers["Content-Type"].startswith("text/javascript"), path
        assert (await http_get(bridge, "/style.css"))[0] == 200
        assert (await http_get(bridge, "/vendor/LICENSE.marked.txt"))[0] == 404
        assert (await http_get(bridge, "/v2/repository/index"))[0] == 404  # no model control
        assert (await http_get(bridge, "/../pyproject.toml"))[0] == 404


async def test_healthz_not_ready_without_triton():
    """/healthz answers 503 and says so while Triton is unreachable."""
    async with running_bridge() as bridge:
        status, _, body = await http_get(bridge, HEALTH_PATH)
        assert status == 503 and json.loads(body)["ready"] is False


async def test_foreign_host_header_refused():
    """A loopback bridge refuses Host names other than loopback ones (DNS rebinding)."""
    async with running_bridge() as bridge:
        status, _, _ = await http_get(bridge, "/", headers={"Host": f"evil.example:{bridge.port}"})
        assert status == 403


async def test_origin_rejected():
    """A browser Origin other than the page's own is refused at the handshake."""
    async with running_bridge() as bridge:
        with pytest.raises(InvalidStatus) as info:
            async with connect(ws_url(bridge), origin="http://evil.example"):
                pass
        assert info.value.response.status_code == 403
        async with connect(ws_url(bridge), origin=f"http://127.0.0.1:{bridge.port}") as ws:
            await ws.send(frame(type="cancel", id="nothing"))  # same origin is welcome


async def test_token_required_when_set():
    """With a token: wrong token 401; none -> must auth first; query, header, message all work."""
    async with running_bridge(token="s3cret", auth_timeout_s=1.0) as bridge:
        with pytest.raises(InvalidStatus) as info:
            async with connect(ws_url(bridge, "?token=wrong")):
                pass
        assert info.value.response.status_code == 401

        async with connect(ws_url(bridge)) as ws:  # no token: the first message must be auth
            await ws.send(frame(type="generate", id="a", prompt="hi"))
            got = await next_frame(ws)
            assert got["code"] == "unauthorized"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1008

        async with connect(ws_url(bridge)) as ws:  # nothing sent: closed at the auth deadline
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
            assert closed.value.rcvd.reason == "authentication timeout"

        for kwargs, first in [
            ({"uri": ws_url(bridge, "?token=s3cret")}, None),
            (
                {"uri": ws_url(bridge), "additional_headers": {"Authorization": "Bearer s3cret"}},
                None,
            ),
            ({"uri": ws_url(bridge)}, frame(type="auth", token="s3cret")),
        ]:
            async with connect(**kwargs) as ws:
                if first:
                    await ws.send(first)
                await ws.send(frame(type="generate", id="a", prompt="hi"))
                got = await next_frame(ws)  # past auth: Triton is down in this test
                assert (got["id"], got["code"]) == ("a", "unavailable")
