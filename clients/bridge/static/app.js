// tokenstream chat page: talks to the bridge's websocket (/ws) with JSON messages.
// Protocol: the bridge's frames (clients/bridge/messages.py in, frames.py out). No build step; the
// libraries under vendor/ are loaded by index.html before this module.

import { StreamView } from "./markdown.js";
import * as store from "./store.js";
import {
  assistantEl, button, copyText, div, EMPTY_HINT, formatStats, UNANSWERED, userEl,
} from "./view.js";

const $ = (id) => document.getElementById(id);

const page = {
  ws: null,
  retryMs: 500,       // reconnect backoff, doubled up to 8 s
  counter: 0,
  renderQueued: false,
  store: store.loadStore(),
  current: null,      // the answer being streamed, see newAnswer()
  unsaved: false,     // the browser refused the last save: the store here is the only full copy
  retryOnOpen: null,  // the chat whose Retry (or Regenerate) waits for the connection
};

// ------------------------------------------------------------------ connection

function connect() {
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const ws = new WebSocket(scheme + location.host + "/ws");
  page.ws = ws;
  setStatus("connecting", "connecting…");
  ws.onopen = () => {
    page.retryMs = 500;
    const token = $("token").value.trim();
    if (token) ws.send(JSON.stringify({ type: "auth", token }));
    setStatus("open", "connected");
    hideBanner();
    const retryId = page.retryOnOpen;
    page.retryOnOpen = null;
    if (retryId && retryId === page.store.currentId) regenerate();
  };
  ws.onmessage = (event) => onFrame(JSON.parse(event.data));
  ws.onclose = (event) => {
    if (page.ws !== ws) return;
    page.ws = null;
    const why = event.reason ? `: ${event.reason}` : "";
    setStatus("closed", `disconnected${why}`);
    if (page.current) fail(page.current, "connection lost", `the connection closed${why}`);
    setTimeout(connect, page.retryMs);
    page.retryMs = Math.min(page.retryMs * 2, 8000);
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
  const answer = page.current && frame.id === page.current.id ? page.current : null;
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
  answer.view.append(frame.text);
  scheduleRender();
}

function onDone(answer, frame) {
  renderAnswer(answer, true);
  const state = frame.finish_reason === "cancelled" ? "cancelled" : "done";
  finishAnswer(answer, { state, stats: formatStats(answer, frame) });
}

function fail(answer, code, message) {
  renderAnswer(answer, true);
  finishAnswer(answer, { state: "error", error: `error (${code}): ${message}` });
}

/** Keep the finished answer in its conversation and show it with its actions. */
function finishAnswer(answer, fields) {
  const message = { role: "assistant", content: answer.view.text, ...fields };
  refresh();
  const chat = store.findChat(page.store, answer.chatId);
  page.current = null;
  if (chat) {
    chat.messages.push(message);
    saveChat(chat);
  }
  const el = assistantEl(message, chat ? chat.messages.length - 1 : -1, answer.textEl);
  answer.el.replaceWith(el);
  setBusy(false);
}

// ------------------------------------------------------------------ rendering

// Tokens can arrive faster than the screen refreshes: render them once per animation frame.
function scheduleRender() {
  if (page.renderQueued) return;
  page.renderQueued = true;
  requestAnimationFrame(() => {
    page.renderQueued = false;
    if (page.current) renderAnswer(page.current);
  });
}

/** Show what arrived of the answer; `last`: all of it arrived (highlight what is left). */
function renderAnswer(answer, last = false) {
  const log = $("log");
  const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
  if (last) answer.view.finish();
  else answer.view.render();
  answer.el.dataset.rendered = answer.view.rendered;
  if (atBottom) log.scrollTop = log.scrollHeight;
}

// ------------------------------------------------------------------ conversations

function currentChat() {
  return store.findChat(page.store, page.store.currentId);
}

/** Read the store again before changing it: another tab may have changed it meanwhile (this tab
 * keeps showing its own conversation). Not while the browser refuses to save: the stored copy
 * lacks what this tab holds, and reading it would lose that. */
function refresh() {
  if (page.unsaved) return;
  const currentId = page.store.currentId;
  page.store = store.loadStore();
  if (store.findChat(page.store, currentId)) page.store.currentId = currentId;
}

function saveChat(chat) {
  store.touch(page.store, chat);
  persist();
}

function persist() {
  const { saved, dropped } = store.saveStore(page.store);
  page.unsaved = !saved;
  if (!saved) {
    showBanner("this browser refused to store the conversation (storage full or disabled)");
  } else if (dropped) {
    const which = dropped === 1 ? "oldest conversation was" : `${dropped} oldest ones were`;
    showBanner(`browser storage full: the ${which} deleted to make room`);
  }
  renderList();
}

/** The list of conversations, the current one marked. */
function renderList() {
  const items = page.store.chats.map((chat) => {
    const li = document.createElement("li");
    const open = button("chat-item", chat.title);
    open.dataset.id = chat.id;
    if (chat.id === page.store.currentId) open.setAttribute("aria-current", "true");
    const remove = button("delete-chat", "×", `Delete “${chat.title}”`);
    remove.dataset.id = chat.id;
    remove.setAttribute("aria-label", `Delete ${chat.title}`);
    li.append(open, remove);
    return li;
  });
  $("chat-list").replaceChildren(...items);
}

/** Show the current conversation's messages; `answering`: its last question is being answered. */
function showChat(answering = false) {
  const chat = currentChat();
  const messages = chat ? chat.messages : [];
  const els = messages.map((m, i) => (m.role === "user" ? userEl(m, i) : assistantEl(m, i)));
  if (!answering && messages.at(-1)?.role === "user") els.push(assistantEl(UNANSWERED, -1));
  if (!els.length) els.push(div("empty", EMPTY_HINT));
  $("log").replaceChildren(...els);
  $("log").scrollTop = $("log").scrollHeight;
  $("chat-title").textContent = chat ? chat.title : "New chat";
  const named = chat && chat.messages.length;
  document.title = named ? `${chat.title} · tokenstream` : "tokenstream chat";
  renderList();
}

/** Stop what streams now: its partial answer is kept as cancelled, its late frames ignored. */
function abandon() {
  const answer = page.current;
  if (!answer) return;
  stop();
  onDone(answer, { finish_reason: "cancelled" });
}

function switchTo(id) {
  closeList();
  if (id === page.store.currentId) return;  // the one shown: an answer streaming there goes on
  abandon();
  refresh();
  const left = currentChat();
  if (left && left.id !== id && !left.messages.length) store.deleteChat(page.store, left.id);
  page.store.currentId = id;
  persist();
  showChat();
}

function startNewChat() {
  abandon();
  refresh();
  const chat = currentChat();
  if (!chat || chat.messages.length) store.newChat(page.store);  // reuse an empty one
  persist();
  showChat();
  closeList();
  $("prompt").focus();
}

function removeChat(id) {
  if (page.current && page.current.chatId === id) abandon();
  refresh();
  store.deleteChat(page.store, id);
  persist();
  showChat();
}

// ------------------------------------------------------------------ sending

function isOpen() {
  return page.ws !== null && page.ws.readyState === WebSocket.OPEN;
}

function connected() {
  if (isOpen()) return true;
  showBanner("not connected to the bridge yet; retrying…");
  return false;
}

function newAnswer(chat) {
  const el = div("msg assistant");
  el.dataset.state = "streaming";
  const textEl = div("text markdown");
  el.append(textEl);
  $("log").append(el);
  $("log").scrollTop = $("log").scrollHeight;
  page.counter += 1;
  return {
    id: `a${page.counter}-${Math.random().toString(36).slice(2, 8)}`,
    chatId: chat.id, el, textEl, view: new StreamView(textEl),
    n: 0, firstN: 0, sentAt: performance.now(), firstAt: null, lastAt: null,
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

/** Ask the model to answer the conversation's last question. */
function startAnswer(chat) {
  const messages = store.modelMessages(chat, $("system").value.trim());
  const answer = newAnswer(chat);
  page.current = answer;
  setBusy(true);
  page.ws.send(JSON.stringify({ type: "generate", id: answer.id, messages, params: params() }));
  answer.sentAt = performance.now();
}

/** Send a new question in the current conversation (a new one when there is none). */
function send(text) {
  if (!connected()) return false;
  refresh();
  const chat = currentChat() || store.newChat(page.store);
  const last = chat.messages.at(-1);
  if (!last) $("log").replaceChildren();  // the empty-chat hint
  else if (last.role === "user") $("log").lastElementChild.remove();  // its "no answer" notice
  chat.messages.push({ role: "user", content: text });
  saveChat(chat);
  $("log").append(userEl(chat.messages.at(-1), chat.messages.length - 1));
  $("chat-title").textContent = chat.title;
  startAnswer(chat);
  return true;
}

/** Replace the last answer (or the failed one, or the missing one) with a new one; while the
 * connection is down, once it is back (unless another conversation is shown by then). */
function regenerate() {
  if (page.current) return;
  if (!isOpen()) {
    page.retryOnOpen = page.store.currentId;
    showBanner("not connected to the bridge; asking again once it reconnects…");
    return;
  }
  refresh();
  const chat = currentChat();
  if (!chat || !chat.messages.length) return;
  if (chat.messages.at(-1).role === "assistant") chat.messages.pop();
  saveChat(chat);
  $("log").lastElementChild.remove();  // the answer replaced, or the "no answer" notice
  startAnswer(chat);
}

/** Replace question `index` with `text`: what followed it is dropped, the model answers anew. */
function editQuestion(index, text) {
  refresh();
  const chat = currentChat();
  if (page.current || !chat || chat.messages[index]?.role !== "user" || !connected()) return;
  chat.messages = [...chat.messages.slice(0, index), { role: "user", content: text }];
  saveChat(chat);
  showChat(true);
  startAnswer(chat);
}

/** Turn a question into a text box with Send and Cancel. */
function openEditor(msgEl) {
  if (page.current || msgEl.querySelector(".editor")) return;
  const index = Number(msgEl.dataset.index);
  const editor = document.createElement("form");
  editor.className = "editor";
  const box = document.createElement("textarea");
  box.value = currentChat().messages[index].content;
  box.rows = Math.min(10, box.value.split("\n").length + 1);
  const actions = div("actions");
  const save = button("save-edit", "Send");
  save.type = "submit";
  actions.append(save, button("cancel-edit", "Cancel"));
  editor.append(box, actions);
  msgEl.classList.add("editing");
  msgEl.append(editor);
  box.focus();
  editor.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = box.value.trim();
    if (text) editQuestion(index, text);
  });
  box.addEventListener("keydown", (event) => {
    if (sendKey(event)) editor.requestSubmit();
    if (event.key === "Escape") showChat();
  });
}

function stop() {
  if (!page.current || !page.ws) return;
  page.ws.send(JSON.stringify({ type: "cancel", id: page.current.id }));
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

// ------------------------------------------------------------------ clicks, list drawer

function onLogClick(event) {
  const btn = event.target.closest("button");
  if (!btn) return;
  const msgEl = btn.closest(".msg");
  const chat = currentChat();
  if (btn.classList.contains("copy-code")) {
    copyText(btn.closest(".code-block").querySelector("code").textContent, btn);
  } else if (btn.classList.contains("copy-answer")) {
    const message = chat && chat.messages[Number(msgEl.dataset.index)];
    if (message) copyText(message.content, btn);
  } else if (btn.classList.contains("regenerate") || btn.classList.contains("retry")) {
    regenerate();
  } else if (btn.classList.contains("edit")) {
    openEditor(msgEl);
  } else if (btn.classList.contains("cancel-edit")) {
    showChat();
  }
}

function onListClick(event) {
  const btn = event.target.closest("button");
  if (!btn) return;
  if (btn.classList.contains("chat-item")) switchTo(btn.dataset.id);
  else if (btn.classList.contains("delete-chat")) removeChat(btn.dataset.id);
}

/** The ↓ button shows while the log is scrolled up from its end. */
function onLogScroll() {
  const log = $("log");
  $("to-bottom").hidden = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
}

function toBottom() {
  $("log").scrollTo({ top: $("log").scrollHeight, behavior: "smooth" });
}

function closeList() {
  document.body.classList.remove("list-open");
  $("toggle-list").setAttribute("aria-expanded", "false");
}

function toggleList() {
  const open = document.body.classList.toggle("list-open");
  $("toggle-list").setAttribute("aria-expanded", String(open));
}

/** Another tab changed the stored conversations: show them, unless an answer streams here. */
function onStorage(event) {
  if (!store.isStoreEvent(event)) return;
  refresh();
  if (page.current || document.querySelector(".editor")) renderList();  // not under the user
  else showChat();
}

// ------------------------------------------------------------------ wiring

// Enter sends, Shift+Enter is a new line; Enter that confirms an IME candidate (Chinese,
// Japanese) must not send.
function sendKey(event) {
  if (event.key !== "Enter" || event.shiftKey || event.isComposing) return false;
  event.preventDefault();
  return true;
}

// The message box grows with its text, up to a third of the window.
function fitPrompt() {
  const box = $("prompt");
  box.style.height = "auto";
  box.style.height = `${Math.min(box.scrollHeight + 2, innerHeight / 3)}px`;
}

const TOKEN_KEY = "tokenstream-token";

function initToken() {
  // A token in the URL fragment (#token=...) never reaches a server log; keep it for the tab only.
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromHash) {
    keepToken(fromHash);
    history.replaceState(null, "", location.pathname + location.search);
  }
  $("token").value = fromHash || readToken();
  $("token").addEventListener("change", () => {
    keepToken($("token").value.trim());
    if (page.ws) page.ws.close();  // reconnect with the new token
  });
}

/** The token kept for this tab; "" when there is none or the browser refuses storage. */
function readToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  } catch (err) {
    console.warn("tokenstream: the tab's storage is unavailable", err);
    return "";
  }
}

function keepToken(token) {
  try {
    sessionStorage.setItem(TOKEN_KEY, token);
  } catch (err) {
    console.warn("tokenstream: access token not kept for the tab", err);
  }
}

// The settings kept across reloads (not the access token: that stays with the tab).
const SETTINGS = ["temperature", "top-p", "max-tokens", "system"];

function initSettings() {
  const stored = store.loadSettings();
  for (const id of SETTINGS) {
    if (typeof stored[id] === "string") $(id).value = stored[id];
    $(id).addEventListener("input", () => {
      store.saveSettings(Object.fromEntries(SETTINGS.map((key) => [key, $(key).value])));
    });
  }
}

function init() {
  connect();  // first: the page talks to the bridge whatever goes wrong below (it opens later)
  initToken();
  initSettings();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (text && !page.current && send(text)) {
      $("prompt").value = "";
      fitPrompt();
    }
  });
  $("prompt").addEventListener("input", fitPrompt);
  $("prompt").addEventListener("keydown", (event) => {
    if (sendKey(event)) $("composer").requestSubmit();
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && page.current) stop();
    else if (event.key === "Escape") closeList();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", startNewChat);
  $("toggle-list").addEventListener("click", toggleList);
  $("scrim").addEventListener("click", closeList);
  $("log").addEventListener("click", onLogClick);
  $("log").addEventListener("scroll", onLogScroll, { passive: true });
  $("to-bottom").addEventListener("click", toBottom);
  $("chat-list").addEventListener("click", onListClick);
  window.addEventListener("storage", onStorage);
  showChat();
}

init();
