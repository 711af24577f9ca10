// The chat page's DOM builders: messages with their actions, the stats line, copy to clipboard.
// No state of their own; app.js owns the conversation and the connection.

import { renderMarkdown } from "./markdown.js";

export function button(cls, label, title) {
  const el = document.createElement("button");
  el.type = "button";
  el.className = cls;
  el.textContent = label;
  if (title) el.title = title;
  return el;
}

export function div(cls, text) {
  const el = document.createElement("div");
  el.className = cls;
  if (text) el.textContent = text;
  return el;
}

/** A question as the user typed it (plain text), with its Edit button. */
export function userEl(message, index) {
  const el = div("msg user");
  el.dataset.index = index;
  const actions = div("actions");
  actions.append(button("edit", "Edit", "Edit this question; the conversation continues from it"));
  el.append(div("text", message.content), actions);
  return el;
}

/** A finished answer: Markdown, its error or stats, and its actions. `textEl`: already rendered. */
export function assistantEl(message, index, textEl) {
  const el = div("msg assistant");
  el.dataset.index = index;
  el.dataset.state = message.state;
  let text = textEl;
  if (!text) {
    text = div("text markdown");
    renderMarkdown(text, message.content);
  }
  el.append(text);
  if (message.error) el.append(div("error", message.error));
  if (message.stats) el.append(div("stats", message.stats));
  const actions = div("actions");
  if (message.content) actions.append(button("copy-answer", "Copy", "Copy the answer (Markdown)"));
  actions.append(message.state === "error"
    ? button("retry", "Retry", "Ask again")
    : button("regenerate", "Regenerate", "Replace this answer with a new one"));
  el.append(actions);
  return el;
}

export function formatStats(answer, frame) {
  const parts = [];
  if (answer.firstAt !== null) parts.push(`TTFT ${Math.round(answer.firstAt - answer.sentAt)} ms`);
  const span = (answer.lastAt - answer.firstAt) / 1000;
  if (answer.firstAt !== null && span > 0) {
    parts.push(`${((answer.n - answer.firstN) / span).toFixed(1)} tok/s`);
  }
  parts.push(`${answer.n} token${answer.n === 1 ? "" : "s"}`);
  parts.push(frame.finish_reason);
  const server = (frame.timing || {}).server || {};
  if (server.first_token_ms != null) {
    parts.push(`server: queue ${server.queue_ms} ms, prefill ${server.prefill_ms} ms`);
  }
  return parts.join(" · ");
}

export const EMPTY_HINT = "Ask anything. Enter sends, Shift+Enter starts a new line, Esc stops.";

// Shown after a question whose answer never came: the page was closed while it streamed.
export const UNANSWERED = {
  role: "assistant", content: "", state: "error",
  error: "no answer: the page was closed or reloaded while it came",
};

export async function copyText(text, btn) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // Not a secure context (a bridge on a LAN address over plain HTTP): the old way.
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  btn.dataset.label ??= btn.textContent;
  btn.textContent = "Copied";
  clearTimeout(btn.copiedTimer);
  btn.copiedTimer = setTimeout(() => { btn.textContent = btn.dataset.label; }, 1200);
}
