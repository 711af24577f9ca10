"""Helpers shared by the chat page's browser tests: headless Chromium (Debian's chromium) on a
bridge's page, and a scripted model that answers the page's websocket with exactly given texts."""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from clients import bridge as br
from clients.bridge import frames
from clients.bridge import protocol as p

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1100, "height": 800}
SCREENSHOTS = Path("/tmp")  # where the tests leave their screenshots for people to look at

# Skipped on a machine without Debian's chromium, except in CI (CI=true), where setup.sh --test
# installs it: there a missing browser fails the browser tests instead of hiding them.
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists() and not os.environ.get("CI"), reason="needs Debian's chromium package"
)


@dataclass
class Browser:
    """A page on the bridge, the JavaScript errors and console errors it raised, and every URL
    it requested."""

    page: object
    url: str
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


@asynccontextmanager
async def open_page(bridge, viewport=None, color_scheme="light", on_page=None):
    """Chromium on the bridge's chat page, once the page's websocket is open.

    `on_page(page)` runs before the page loads (to route its websocket). The test fails if the
    page raised a JavaScript error or logged a console error (a Content-Security-Policy
    violation is one).
    """
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(
                viewport=viewport or PHONE, color_scheme=color_scheme
            )
            page = await context.new_page()
            seen = Browser(page, f"http://127.0.0.1:{bridge.port}")
            page.on("pageerror", lambda exc: seen.errors.append(str(exc)))
            page.on("console", lambda m: m.type == "error" and seen.errors.append(m.text))
            page.on("request", lambda r: seen.requests.append(r.url))
            if on_page is not None:
                await on_page(page)
            await page.goto(seen.url + "/")
            await page.wait_for_selector('#status[data-state="open"]')
            yield seen
            assert not seen.errors, f"JavaScript errors: {seen.errors}"
        finally:
            await browser.close()


@asynccontextmanager
async def chat_page(triton_server, viewport=None, on_page=None):
    """A bridge to the real server and a Chromium page open on its chat page (`on_page` as in
    open_page)."""
    cfg = br.BridgeConfig(triton_url=triton_server.grpc_url, port=0, health_interval_s=0.5)
    async with br.Bridge(cfg) as bridge, open_page(bridge, viewport, on_page=on_page) as seen:
        yield seen.page


class Relay:
    """The page's websocket relayed to the real bridge by Playwright (before the page loads),
    with `params` added to each `generate` the page sends (keys the page has no setting for),
    and the bridge's frames kept in `frames` as they reach the page."""

    def __init__(self, **params):
        self.params = params
        self.frames: list[dict] = []

    async def attach(self, page) -> None:
        await page.route_web_socket(lambda url: url.endswith("/ws"), self._connected)

    def _connected(self, ws) -> None:
        bridge = ws.connect_to_server()
        ws.on_message(lambda message: bridge.send(self._to_bridge(message)))
        bridge.on_message(lambda message: self._to_page(ws, message))

    def _to_bridge(self, message: str) -> str:
        frame = json.loads(message)
        if frame.get(p.TYPE) == p.GENERATE:
            frame[p.PARAMS] = {**frame.get(p.PARAMS, {}), **self.params}
        return json.dumps(frame)

    def _to_page(self, ws, message: str) -> None:
        self.frames.append(json.loads(message))
        ws.send(message)

    def text(self) -> str:
        """The text of every token frame received, in order."""
        return "".join(f[p.TEXT] for f in self.frames if f.get(p.TYPE) == p.TOKEN)

    def done(self) -> dict:
        """The one `done` frame received."""
        (done,) = [f for f in self.frames if f.get(p.TYPE) == p.DONE]
        return done


async def ask(page, text: str, max_tokens: int, top_p: str = "0.95") -> None:
    """Send `text` greedily: a sampled answer of the random model could end early at EOS."""
    await page.click("#settings summary")
    await page.fill("#temperature", "0")
    await page.fill("#max-tokens", str(max_tokens))
    await page.fill("#top-p", top_p)
    await page.click("#settings summary")
    await page.fill("#prompt", text)
    await page.press("#prompt", "Enter")


PAUSE = object()  # in a scripted answer: stop there until ScriptedModel.resume is set


class ScriptedModel:
    """Stands in for the bridge's websocket (Playwright routes it): each `generate` the page
    sends is answered with the next of `answers`, as the bridge's frames, a few characters per
    token frame, `tokens_per_s` of them a second (as fast as they can be sent when None).

    An answer is a text, a list of texts and PAUSE, or ("error", code, message). The page's
    generate frames are kept in `requests`, its cancels in `cancels`; a cancel ends a paused
    answer there, as `cancelled`. `drop` closes the page's websocket; while `online` is clear,
    the page's new websockets do not open (they wait, connecting).
    """

    def __init__(self, answers, chars_per_token: int = 3, tokens_per_s: float | None = None):
        self.answers = list(answers)
        self.chars_per_token = chars_per_token
        self.tokens_per_s = tokens_per_s
        self.requests: list[dict] = []
        self.cancels: list[str] = []
        self.resume = asyncio.Event()
        self.paused = asyncio.Event()
        self.online = asyncio.Event()
        self.online.set()
        self._sockets: list = []
        self._tasks: set[asyncio.Task] = set()

    async def attach(self, page) -> None:
        """Route the page's websocket to this model (before the page loads)."""
        await page.route_web_socket(lambda url: url.endswith("/ws"), self._connected)

    async def _connected(self, ws) -> None:
        """A websocket the page opened: it opens when this returns (Playwright's mock)."""
        ws.on_message(lambda message: self._on_message(ws, message))
        self._sockets.append(ws)
        await self.online.wait()

    async def drop(self, reason: str) -> None:
        """Close the page's latest websocket, as a lost connection, and go offline."""
        self.online.clear()
        await self._sockets[-1].close(code=1011, reason=reason)

    def _on_message(self, ws, message) -> None:
        frame = json.loads(message)
        if frame["type"] == "cancel":
            self.cancels.append(frame["id"])
            self.resume.set()
        elif frame["type"] == "generate":
            self.requests.append(frame)
            task = asyncio.get_running_loop().create_task(
                self._answer(ws, frame["id"], self.answers.pop(0))
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, ws, gen_id: str, answer) -> None:
        if isinstance(answer, tuple):
            _, code, message = answer
            ws.send(json.dumps(frames.error_frame(gen_id, code, message)))
            return
        trace = frames.Trace(accepted_ns=time.monotonic_ns())
        loop = asyncio.get_running_loop()
        start = loop.time()
        n = 0
        for part in [answer] if isinstance(answer, str) else answer:
            if part is PAUSE:
                self.paused.set()
                await self.resume.wait()
                if gen_id in self.cancels:
                    break
                continue
            for piece in self.tokens(part):
                if self.tokens_per_s:  # on a schedule from the start: no drift from late wakeups
                    await asyncio.sleep(start + n / self.tokens_per_s - loop.time())
                n += 1
                ws.send(json.dumps(frames.token_frame(gen_id, piece, n)))
        trace.completion_tokens = n
        reason = "cancelled" if gen_id in self.cancels else "length"
        ws.send(json.dumps(frames.done_frame(gen_id, reason, trace, time.monotonic_ns())))

    def tokens(self, text: str) -> list[str]:
        """`text` cut into token-sized pieces (markup gets cut mid-way, as real tokens do)."""
        step = self.chars_per_token
        return [text[i : i + step] for i in range(0, len(text), step)]

    def messages(self, i: int) -> list[tuple[str, str]]:
        """The conversation the page sent with its i-th generate, as (role, content)."""
        return [(m["role"], m["content"]) for m in self.requests[i]["messages"]]
