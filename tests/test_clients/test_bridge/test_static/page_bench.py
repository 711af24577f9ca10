"""How long the chat page takes to bring a streaming answer up to date, per frame (a benchmark,
not a test: it prints figures and asserts none).

    PYTHONPATH=tests .venv/bin/python tests/test_clients/test_bridge/test_static/page_bench.py

(`tests/` on the path for bridge_support, as pytest puts it there; this folder is the script's.)

Headless Chromium on a real bridge's page feeds the page's own StreamView (markdown.js) two tokens
of four characters before each render: 100 tokens/s at 50 renders a second. The layout is forced
after each render, so its cost is counted too.
"""

from __future__ import annotations

import asyncio
import json

from bridge_support import running_bridge
from page_support import DESKTOP, ScriptedModel, open_page

SECTION = """## Step {i}

Some **text** with `code` and a [link](https://example.com/{i}).

- item one
- item two

```python
def f{i}(x):
    # comment
    return [y * {i} for y in range(x) if y % 2]
```

| a | b |
|---|---|
| {i} | {i} |

"""

CODE_LINE = "def f{i}(x):\n    return [y * {i} for y in range(x) if y % 2]  # c\n"

ANSWERS = {
    "40 sections of heading, paragraph, list, code block, table": "".join(
        SECTION.format(i=i) for i in range(40)
    ),
    "one code block of 240 Python lines": "```python\n"
    + "".join(CODE_LINE.format(i=i) for i in range(120))
    + "```\n",
}

# Render times of the page's StreamView fed `text` 2 tokens of 4 characters at a time.
FEED = """async (text) => {
  const { StreamView } = await import('/markdown.js');
  const tokens = [];
  for (let i = 0; i < text.length; i += 4) tokens.push(text.slice(i, i + 4));
  const box = document.createElement('div');
  box.className = 'text markdown';
  document.getElementById('log').append(box);
  const view = new StreamView(box);
  const times = [];
  for (let i = 0; i < tokens.length; i += 2) {
    view.append(tokens.slice(i, i + 2).join(''));
    const start = performance.now();
    view.render();
    void box.offsetHeight;
    times.push(performance.now() - start);
  }
  view.finish();
  box.remove();
  times.sort((a, b) => a - b);
  const at = (q) => times[Math.min(times.length - 1, Math.floor(times.length * q))];
  return {
    chars: text.length, tokens: tokens.length, renders: times.length,
    mean_ms: times.reduce((a, b) => a + b, 0) / times.length,
    p50_ms: at(0.5), p99_ms: at(0.99), max_ms: times.at(-1),
  };
}"""


async def main() -> None:
    """Print one JSON line of figures per answer."""
    async with running_bridge() as bridge:
        async with open_page(bridge, DESKTOP, on_page=ScriptedModel([]).attach) as seen:
            for name, text in ANSWERS.items():
                figures = await seen.page.evaluate(FEED, text)
                rounded = {k: round(v, 2) for k, v in figures.items()}
                print(json.dumps({"answer": name, **rounded}))


if __name__ == "__main__":
    asyncio.run(main())
