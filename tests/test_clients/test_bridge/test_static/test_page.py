"""The chat page in headless Chromium (Debian's chromium) through a real bridge and server."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import save_tiny_model, served
from page_support import DESKTOP, Relay, ask, chat_page, needs_chromium

pytestmark = [pytest.mark.server, pytest.mark.browser, needs_chromium]

# Records, once per animation frame, how many characters of the streaming answer are on screen:
# how the user saw it grow (it may shrink for a moment, as when `**` turns into bold).
SAMPLE_RENDERS = """() => {
  window.__lengths = [];
  const sample = () => {
    const el = document.querySelector('.msg.assistant[data-state="streaming"] .text');
    if (el) window.__lengths.push(el.textContent.length);
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

        assert len(set(lengths)) >= 4 and lengths[-1] > lengths[0]  # grew over several renders
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


# The class of the first code block seen in a streaming answer, sampled once per animation frame
# until an answer is done ('' while none was seen).
WATCH_CODE = """() => {
  window.__codeWhileStreaming = '';
  const sample = () => {
    const code = document.querySelector(
      '.msg.assistant[data-state="streaming"] pre code[class*="language-"]');
    if (code && !window.__codeWhileStreaming) window.__codeWhileStreaming = code.className;
    if (!document.querySelector('.msg.assistant[data-state="done"]')) requestAnimationFrame(sample);
  };
  requestAnimationFrame(sample);
}"""
CODE_QUESTION = "Write a short Python function that adds two numbers, in a code block."


async def test_the_default_models_code_renders_while_it_streams(default_server, tmp_path):
    """The default model (SmolLM2), asked greedily for code: its fenced block is a <pre><code>
    with the language's class while the answer streams and after, highlighted, with the code's
    and the answer's Copy buttons, and no fence is left on screen as text."""
    async with chat_page(default_server, viewport=DESKTOP) as page:
        await page.evaluate(WATCH_CODE)
        await ask(page, CODE_QUESTION, max_tokens=160)
        answer = page.locator('.msg.assistant[data-state="done"]')
        await answer.wait_for(timeout=180_000)
        await page.screenshot(path=tmp_path / "chat-code.png", full_page=True)
        shutil.copy(tmp_path / "chat-code.png", Path("/tmp/tokenstream-chat-code.png"))
        assert "language-python" in await page.evaluate("window.__codeWhileStreaming")
        code = answer.locator("pre code.language-python")
        assert await code.count() >= 1
        assert "def " in await code.first.inner_text() and "return" in await code.first.inner_text()
        assert await code.first.locator("span[class^='hljs-']").count() > 0  # highlighted
        assert await answer.locator(".code-block .code-lang").first.inner_text() == "python"
        assert await answer.locator(".copy-code").count() == await code.count()
        assert await answer.locator(".copy-answer").count() == 1
        assert "```" not in await answer.locator(".text").inner_text()


@pytest.fixture(scope="module")
def long_server(tmp_path_factory, default_model_dir):
    """The tiny random model with 4,096 positions (room for a 2,000-token answer), unpaced."""
    model = save_tiny_model(tmp_path_factory.mktemp("tiny-4k"), default_model_dir, context=4096)
    yield from served(model, max_streams=2, queue_limit=4)


# The answer's text on screen the moment the page shows it done (before any repaint), and the
# answer the page keeps in its stored conversation.
RECORD_DONE = """() => {
  window.__done = null;
  new MutationObserver((records) => {
    for (const r of records) for (const node of r.addedNodes) {
      if (node.matches && node.matches('.msg.assistant[data-state="done"]') && !window.__done) {
        window.__done = node.querySelector('.text').textContent;
      }
    }
  }).observe(document.getElementById('log'), { childList: true });
}"""
STORED_ANSWER = """() => {
  const chats = JSON.parse(localStorage.getItem('tokenstream-chats')).chats;
  return chats[0].messages.at(-1).content;
}"""

# The page's own renderer given the whole text at once (as after a reload): what a finished
# answer must show.
RENDER_AT_ONCE = """async (text) => {
  const { renderMarkdown } = await import('/markdown.js');
  const box = document.createElement('div');
  renderMarkdown(box, text);
  return box.textContent;
}"""


async def test_two_thousand_real_tokens_are_all_on_screen_when_done_arrives(long_server):
    """2,000 tokens from a real server as fast as it makes them (ignore_eos added to the page's
    request on its way to the bridge): when the page marks the answer done, all 2,000 are
    counted, and the answer shows what rendering the whole text at once shows."""
    relay = Relay(ignore_eos=True)
    async with chat_page(long_server, viewport=DESKTOP, on_page=relay.attach) as page:
        await page.evaluate(RECORD_DONE)
        await ask(page, "Go on and on", max_tokens=2000)
        answer = page.locator('.msg.assistant[data-state="done"]')
        await answer.wait_for(timeout=300_000)  # 48 s here with both cores busy elsewhere
        shown = await page.evaluate("window.__done")
        text = relay.text()
        done = relay.done()
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 2000
        assert "2000 tokens" in await answer.locator(".stats").inner_text()
        assert await page.evaluate(STORED_ANSWER) == text  # every character reached the page
        assert shown == await page.evaluate(RENDER_AT_ONCE, text)
