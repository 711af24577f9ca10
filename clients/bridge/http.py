"""The bridge's plain-HTTP side: the chat page's static files, the health check, and the checks a
websocket handshake must pass (Host against DNS rebinding, Origin, bearer token).

Everything here answers or vets one `websockets` Request; no state of its own.
"""

from __future__ import annotations

import hmac
import http
import ipaddress
import json
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

WS_PATH = "/ws"
HEALTH_PATH = "/healthz"
STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
STATIC_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
# The page loads only its own files and talks only to its own origin's websocket.
SECURITY_HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'self'; connect-src 'self'; base-uri 'none'; frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-cache"),
]
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def request_path(request: Request) -> str:
    """The path of a request without its query string."""
    return urlsplit(request.path).path


def host_allowed(host_header: str | None, bind_host: str) -> bool:
    """Guard against DNS rebinding: a loopback bridge answers only to loopback host names."""
    if not is_loopback(bind_host):
        return True
    if not host_header:
        return False
    hostname = urlsplit("//" + host_header).hostname or ""
    return hostname.lower() in LOOPBACK_NAMES


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str | None, host_header: str | None, origins: tuple[str, ...]) -> bool:
    """Same origin by default, else the allow-list; clients without Origin (not browsers) pass."""
    if origin is None:
        return True
    if "*" in origins or origin in origins:
        return True
    if origins or not host_header:
        return False
    return urlsplit(origin).netloc.lower() == host_header.lower()


def bearer(request: Request) -> str | None:
    """A token offered in the handshake: `Authorization: Bearer` or the `token` query param."""
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    values = parse_qs(urlsplit(request.path).query).get("token")
    return values[0] if values else None


def token_matches(offered: str, expected: str | None) -> bool:
    """Constant-time comparison of a client's token with the configured one."""
    return expected is not None and hmac.compare_digest(offered.encode(), expected.encode())


def response(status: int, body: bytes, content_type: str) -> Response:
    """A complete HTTP response with the security headers; the connection closes after it."""
    status = http.HTTPStatus(status)
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
            *SECURITY_HEADERS,
        ]
    )
    return Response(status.value, status.phrase, headers, body)


def json_response(status: int, payload: Mapping) -> Response:
    """A JSON response."""
    return response(status, json.dumps(payload).encode(), "application/json")


def static_response(path: str) -> Response:
    """One of the chat page's files (path is a key of STATIC_FILES)."""
    name, content_type = STATIC_FILES[path]
    return response(200, (STATIC_DIR / name).read_bytes(), content_type)
