"""The bridge's one aiohttp application: which path goes where, and the checks every request
passes first (the Host header, plain JSON for 404 and 405).

  /                       the chat page (and its scripts, styles and vendor/ libraries)
  /healthz                200 when Triton and the model are ready, else 503
  /ws                     the websocket protocol (server.py, connection.py)
  /v1/...                 the OpenAI-compatible API (openai_api.py)
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

from aiohttp import web

from clients.bridge import http, openai_api
from clients.bridge.upstream import Upstream


class Site(Upstream, Protocol):
    """The bridge as its application sees it (server.py's Bridge is one): what the API's
    handlers need, plus the health answer, the websocket handler and the shutdown hook."""

    def health(self) -> dict[str, Any]:
        """The /healthz body; its "ready" decides the status."""
        ...

    async def handle_websocket(self, request: web.Request) -> web.StreamResponse:
        """Run one websocket connection until it ends."""
        ...

    async def close_connections(self) -> None:
        """Close every websocket as the server goes away."""
        ...


def build_app(bridge: Site) -> web.Application:
    """The application of one bridge."""
    app = web.Application(
        middlewares=[_guard(bridge)],
        client_max_size=bridge.cfg.max_body_bytes,
    )
    app.router.add_get(http.HEALTH_PATH, functools.partial(_health, bridge))
    for path in http.STATIC_FILES:
        app.router.add_get(path, _static)
    app.router.add_get(http.WS_PATH, bridge.handle_websocket)
    openai_api.add_routes(app, bridge)
    app.on_shutdown.append(lambda _: bridge.close_connections())
    return app


def _guard(bridge: Site):
    """The middleware every request passes first."""

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        """Refuse foreign Host names (DNS rebinding); turn aiohttp's 404/405 pages into JSON."""
        if not http.host_allowed(request.headers.get("Host"), bridge.cfg.host):
            return http.json_response(403, {"error": "host not allowed"})
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status not in (404, 405):
                raise
            if openai_api.is_api_path(request.path):
                return openai_api.path_error(exc.status, request)
            return http.json_response(exc.status, {"error": exc.reason.lower()})

    return guard


async def _health(bridge: Site, request: web.Request) -> web.Response:
    health = bridge.health()
    return http.json_response(200 if health["ready"] else 503, health)


async def _static(request: web.Request) -> web.Response:
    return http.static_response(request.path)
