// tokenstream chat page: talks to the bridge's websocket (/ws) with JSON messages.
// Protocol: README.md, "Browser chat (websocket bridge)". No build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);

const chat = {
  ws: null,
  history: [],        // [{role, content}] of the finished turns
  current: null,      // the answer being streamed, see newAnswer()
  retryMs: 500,       // reconnect backoff, doubled up to 8 s
  counter: 0,
  renderQueued: false,
};

// ------------------------------------------------------------------ connection

function connect() {
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const ws = new WebSocket(scheme + location.host + "/ws");
  chat.ws = ws;
  setStatus("connecting", "connecting…");
  ws.onopen = () => {
    chat.retryMs = 500;
    const token = $("token").value.trim();
    if (token) ws.send(JSON.stringify({ type: "auth", token }));
    setStatus("open", "connected");
    hideBanner();
  };
  ws.onmessage = (event) => onFrame(JSON.parse(event.data));
  ws.onclose = (event) => {
    if (chat.ws !== ws) return;
    chat.ws = null;
    const why = event.reason ? `: ${event.reason}` : "";
    setStatus("closed", `disconnected${why}`);
    if (chat.current) fail(chat.current, "connection lost", `the connection closed${why}`);
    setTimeout(connect, chat.retryMs);
    chat.retryMs = Math.min(chat.retryMs * 2, 8000);
  };
}

function setStatus(state, text) {
  const el = $("status");
  el.dataset.state = state;
  el.textContent = text;
}

function showBanner(text) {
  const el = $("banner");
  el.textContent = text;
  el.hidden = false;
}

function hideBanner() {
  $("banner").hidden = true;
}

// ------------------------------------------------------------------ frames from the bridge

function onFrame(frame) {
  const answer = chat.current && frame.id === chat.current.id ? chat.current : null;
  if (frame.type === "error" && !answer) {
    showBanner(`${frame.code}: ${frame.message}`);
    if (frame.code === "unauthorized") $("settings").open = true;
    return;
  }
  if (!answer) return;  // a late frame of an answer already given up
  if (frame.type === "token") onToken(answer, frame);
  else if (frame.type === "done") onDone(answer, frame);
  else if (frame.type === "error") fail(answer, frame.code, frame.message);
}

function onToken(answer, frame) {
  const now = performance.now();
  if (answer.firstAt === null) {
    answer.firstAt = now;
    answer.firstN = frame.n;
  }
  answer.lastAt = now;
  answer.n = frame.n;
  answer.text += frame.text;
  answer.pending += frame.text;
  scheduleRender();
}

function onDone(answer, frame) {
  render();
  answer.el.dataset.state = frame.finish_reason === "cancelled" ? "cancelled" : "done";
  answer.stats.textContent = formatStats(answer, frame);
  chat.history.push(answer.question);
  if (answer.text) chat.history.push({ role: "assistant", content: answer.text });
  endAnswer();
}

function fail(answer, code, message) {
  render();
  answer.el.dataset.state = "error";
  const el = document.createElement("div");
  el.className = "error";
  el.textContent = `error (${code}): ${message}`;
  answer.el.append(el);
  answer.userEl.classList.add("failed");  // the question stays out of the history
  endAnswer();
}

// ------------------------------------------------------------------ rendering

// Tokens can arrive faster than the screen refreshes: append them once per animation frame.
function scheduleRender() {
  if (chat.renderQueued) return;
  chat.renderQueued = true;
  requestAnimationFrame(render);
}

function render() {
  chat.renderQueued = false;
  const answer = chat.current;
  if (!answer || !answer.pending) return;
  const log = $("log");
  const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
  answer.textNode.appendData(answer.pending);
  answer.pending = "";
  if (atBottom) log.scrollTop = log.scrollHeight;
}

function bubble(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  const node = document.createTextNode(text);
  body.append(node);
  el.append(body);
  $("log").append(el);
  $("log").scrollTop = $("log").scrollHeight;
  return { el, node };
}

function formatStats(answer, frame) {
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

// ------------------------------------------------------------------ sending

function newAnswer(question) {
  const user = bubble("user", question.content);
  const bot = bubble("assistant", "");
  bot.el.dataset.state = "streaming";
  const stats = document.createElement("div");
  stats.className = "stats";
  bot.el.append(stats);
  chat.counter += 1;
  return {
    id: `a${chat.counter}-${Math.random().toString(36).slice(2, 8)}`,
    question, el: bot.el, textNode: bot.node, userEl: user.el, stats,
    text: "", pending: "", n: 0, firstN: 0,
    sentAt: performance.now(), firstAt: null, lastAt: null,
  };
}

function params() {
  const out = {};
  const read = (id, key, parse) => {
    const value = parse($(id).value);
    if (Number.isFinite(value)) out[key] = value;
  };
  read("temperature", "temperature", parseFloat);
  read("top-p", "top_p", parseFloat);
  read("max-tokens", "max_tokens", (v) => parseInt(v, 10));
  return out;
}

function send(text) {
  if (!chat.ws || chat.ws.readyState !== WebSocket.OPEN) {
    showBanner("not connected to the bridge yet; retrying…");
    return false;
  }
  const question = { role: "user", content: text };
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []),
                    ...chat.history, question];
  const answer = newAnswer(question);
  chat.current = answer;
  setBusy(true);
  chat.ws.send(JSON.stringify({ type: "generate", id: answer.id, messages, params: params() }));
  answer.sentAt = performance.now();
  return true;
}

function stop() {
  if (chat.current && chat.ws) chat.ws.send(JSON.stringify({ type: "cancel", id: chat.current.id }));
}

function endAnswer() {
  chat.current = null;
  setBusy(false);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// ------------------------------------------------------------------ wiring

function init() {
  // A token in the URL fragment (#token=...) never reaches a server log; keep it for the tab only.
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromHash) {
    sessionStorage.setItem("tokenstream-token", fromHash);
    history.replaceState(null, "", location.pathname + location.search);
  }
  $("token").value = sessionStorage.getItem("tokenstream-token") || "";
  $("token").addEventListener("change", () => {
    sessionStorage.setItem("tokenstream-token", $("token").value.trim());
    if (chat.ws) chat.ws.close();  // reconnect with the new token
  });

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (text && !chat.current && send(text)) $("prompt").value = "";
  });
  $("prompt").addEventListener("keydown", (event) => {
    // isComposing: Enter that confirms an IME candidate (Chinese, Japanese) must not send.
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    if (chat.current) {
      stop();
      endAnswer();  // its late frames are ignored: they match no current answer
    }
    chat.history = [];
    $("log").replaceChildren();
  });
  connect();
}

init();
