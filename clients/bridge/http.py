"""The bridge's plain-HTTP side: the chat page's static files, the health check's answer, and the
checks every request must pass (Host against DNS rebinding, Origin, bearer token).

Pure checks on header values plus aiohttp response builders; no state of its own.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

WS_PATH = "/ws"
HEALTH_PATH = "/healthz"
STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def _static_files() -> dict[str, tuple[str, str]]:
    """URL path -> (file under STATIC_DIR, content type): the page's files and vendored libraries.

    Only files of the types above are served (not the vendored libraries' license texts).
    """
    files = {"/": ("index.html", STATIC_TYPES[".html"])}
    for file in sorted(STATIC_DIR.rglob("*")):
        if file.is_file() and file.suffix in STATIC_TYPES:
            name = file.relative_to(STATIC_DIR).as_posix()
            files["/" + name] = (name, STATIC_TYPES[file.suffix])
    return files


STATIC_FILES = _static_files()
# The page loads only its own files (no inline script or style, no remote image even if a model's
# answer names one), talks only to its own origin's websocket, and cannot be framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; connect-src 'self'; object-src 'none'; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


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


def bearer(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """A token offered by a client: `Authorization: Bearer` or the `token` query parameter."""
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return query.get("token")


def token_matches(offered: str, expected: str | None) -> bool:
    """Constant-time comparison of a client's token with the configured one."""
    return expected is not None and hmac.compare_digest(offered.encode(), expected.encode())


def json_response(
    status: int, payload: Mapping, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A JSON response with the security headers."""
    return web.Response(
        status=status,
        text=json.dumps(payload, ensure_ascii=False),
        content_type="application/json",
        headers={**SECURITY_HEADERS, **(headers or {})},
    )


def static_response(path: str) -> web.Response:
    """One of the chat page's files (path is a key of STATIC_FILES)."""
    name, content_type = STATIC_FILES[path]
    mime, _, charset = content_type.partition("; charset=")
    return web.Response(
        body=(STATIC_DIR / name).read_bytes(),
        content_type=mime,
        charset=charset or None,
        headers=SECURITY_HEADERS,
    )
