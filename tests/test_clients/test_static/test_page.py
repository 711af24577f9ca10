"""The chat page in headless Chromium (Debian's chromium) through a real bridge and server."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from page_support import ask, chat_page, needs_chromium

pytestmark = [pytest.mark.server, pytest.mark.browser, needs_chromium]

# Records, once per animation frame, how many characters of the answer were rendered: how the user
# saw it grow (its text on screen may shrink for a moment, as when `**` turns into bold).
SAMPLE_RENDERS = """() => {
  window.__lengths = [];
  const sample = () => {
    const el = document.querySelector('.msg.assistant[data-state="streaming"]');
    if (el && el.dataset.rendered) window.__lengths.push(Number(el.dataset.rendered));
    requestAnimationFrame(sample);
  };
  requestAnimationFrame(sample);
}"""


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
        await page.screenshot(path=tmp_path / "chat-stopped.png", full_page=True)
        shutil.copy(tmp_path / "chat-stopped.png", Path("/tmp/tokenstream-chat-stopped.png"))

        assert len(set(lengths)) >= 4 and lengths == sorted(lengths)  # grew, never shrank
        assert "TTFT" in stats and "tok/s" in stats and "cancelled" in stats
        assert "200 tokens" not in stats
        # kept, with its Copy button (the random model's text may be blank lines: nothing to see)
        assert await answer.locator(".copy-answer").count() == 1
        question = page.locator(".msg.user .text").first
        assert await question.inner_text() == "你好！Tell me a story 🙂"
        assert await page.is_enabled("#send") and not await page.is_enabled("#stop")
        overflow = await page.evaluate("document.documentElement.scrollWidth > innerWidth")
        assert not overflow, "the page is wider than a phone screen"


async def test_second_turn_error_reload_and_retry(triton_server, tmp_path):
    """A finished turn is kept; a value the server refuses shows its message in the answer; a
    reload shows both again as they were; Retry with a valid value answers in place."""
    async with chat_page(triton_server, viewport={"width": 1000, "height": 700}) as page:
        await ask(page, "Hi", max_tokens=6)
        await page.wait_for_selector('.msg.assistant[data-state="done"]')
        first = page.locator(".msg.assistant").first
        assert "6 tokens" in await first.locator(".stats").inner_text()
        first_text = await first.locator(".text").inner_text()

        await ask(page, "Again", max_tokens=6, top_p="2")
        error = page.locator('.msg.assistant[data-state="error"] .error')
        await error.wait_for()
        message = await error.inner_text()
        await page.screenshot(path=tmp_path / "chat-error.png")
        shutil.copy(tmp_path / "chat-error.png", Path("/tmp/tokenstream-chat-error.png"))
        assert "invalid_request" in message and "top_p" in message

        await page.reload()
        await page.wait_for_selector('#status[data-state="open"]')
        assert await first.locator(".text").inner_text() == first_text
        assert await error.inner_text() == message
        await page.click("#settings summary")
        await page.fill("#top-p", "0.95")
        await page.click(".msg.assistant .retry")
        await page.wait_for_function(
            "() => document.querySelectorAll('.msg.assistant[data-state=\"done\"]').length === 2"
        )
        assert await page.locator(".msg.user .text").all_inner_texts() == ["Hi", "Again"]
        assert "6 tokens" in await page.locator(".msg.assistant .stats").last.inner_text()
