"""The chat page in headless Chromium (Debian's chromium) through a real bridge and server."""

from __future__ import annotations

import shutil
import socket
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from conftest import start_server

from clients import bridge as br

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

pytestmark = [
    pytest.mark.server,
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium package"),
]

# Records the answer's text length once per animation frame: how the user saw it grow.
SAMPLE_RENDERS = """() => {
  window.__lengths = [];
  const sample = () => {
    const el = document.querySelector('.msg.assistant:last-of-type .text');
    if (el) window.__lengths.push(el.textContent.length);
    requestAnimationFrame(sample);
  };
  requestAnimationFrame(sample);
}"""


@pytest.fixture(scope="module")
def paced_server(tiny_model_dir):
    """The tiny model with tokens at least 20 ms apart: its 200-token answer lasts about 4 s, so
    Stop lands mid-answer however slowly the page renders (unpaced, the answer could end first)."""
    server = start_server(tiny_model_dir, model_parameters={"test_token_delay_ms": "20"})
    try:
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def chat_page(triton_server, viewport=None):
    """A bridge to the real server and a Chromium page open on its chat page."""
    from playwright.async_api import async_playwright

    cfg = br.BridgeConfig(triton_url=triton_server.grpc_url, port=0, health_interval_s=0.5)
    async with br.Bridge(cfg) as bridge, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport=viewport or PHONE)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f"http://127.0.0.1:{bridge.port}/")
            await page.wait_for_selector('#status[data-state="open"]')
            yield page
            assert not errors, f"JavaScript errors: {errors}"
        finally:
            await browser.close()


async def ask(page, text: str, max_tokens: int, top_p: str = "0.95") -> None:
    """Send `text` greedily: a sampled answer of the random model could end early at EOS."""
    await page.click("#settings summary")
    await page.fill("#temperature", "0")
    await page.fill("#max-tokens", str(max_tokens))
    await page.fill("#top-p", top_p)
    await page.click("#settings summary")
    await page.fill("#prompt", text)
    await page.press("#prompt", "Enter")


async def test_answer_grows_then_stop_ends_it(paced_server, tmp_path):
    """The answer grows over several renders; Stop ends it as cancelled with TTFT and tok/s."""
    async with chat_page(paced_server) as page:
        await page.evaluate(SAMPLE_RENDERS)
        # 200: with the 41-token templated prompt it fits the tiny model's 256 positions
        await ask(page, "你好！Tell me a story 🙂", max_tokens=200)
        answer = page.locator(".msg.assistant").last
        await page.wait_for_function("() => new Set(window.__lengths).size >= 4")
        await page.click("#stop")
        await page.wait_for_selector('.msg.assistant[data-state="cancelled"]')
        lengths = await page.evaluate("window.__lengths")
        stats = await answer.locator(".stats").inner_text()
        text = await answer.locator(".text").inner_text()
        await page.screenshot(path=tmp_path / "chat-stopped.png", full_page=True)
        shutil.copy(tmp_path / "chat-stopped.png", Path("/tmp/tokenstream-chat-stopped.png"))

        assert len(set(lengths)) >= 4 and lengths == sorted(lengths)  # grew, never shrank
        assert "TTFT" in stats and "tok/s" in stats and "cancelled" in stats
        assert "200 tokens" not in stats and text
        assert await page.locator(".msg.user").first.inner_text() == "你好！Tell me a story 🙂"
        assert await page.is_enabled("#send") and not await page.is_enabled("#stop")
        overflow = await page.evaluate("document.documentElement.scrollWidth > innerWidth")
        assert not overflow, "the page is wider than a phone screen"


async def test_second_turn_and_server_error_shown(triton_server, tmp_path):
    """A finished turn is kept; a value the server refuses shows its message in the answer."""
    async with chat_page(triton_server, viewport={"width": 1000, "height": 700}) as page:
        await ask(page, "Hi", max_tokens=6)
        await page.wait_for_selector('.msg.assistant[data-state="done"]')
        assert "6 tokens" in await page.locator(".msg.assistant .stats").first.inner_text()

        await ask(page, "Again", max_tokens=6, top_p="2")
        error = page.locator('.msg.assistant[data-state="error"] .error')
        await error.wait_for()
        message = await error.inner_text()
        await page.screenshot(path=tmp_path / "chat-error.png")
        shutil.copy(tmp_path / "chat-error.png", Path("/tmp/tokenstream-chat-error.png"))
        assert "invalid_request" in message and "top_p" in message
