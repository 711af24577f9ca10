// Conversations kept in the browser's localStorage, so that a reload keeps them.
//
// One JSON value under one key: {version, currentId, chats: [{id, title, updatedAt, messages}]},
// newest first. A message is {role: "user", content} or {role: "assistant", content, state, stats,
// error}: state is "done", "cancelled" or "error".

const KEY = "tokenstream-chats";
const VERSION = 1;
const TITLE_CHARS = 60;

/** The stored conversations, or an empty store when there are none or they cannot be read.
 * A conversation or message of the wrong shape (stored by a bug, an old version, or by hand) is
 * dropped; the others are kept. */
export function loadStore() {
  try {
    const data = JSON.parse(localStorage.getItem(KEY) || "null");
    if (data && data.version === VERSION && Array.isArray(data.chats)) {
      const chats = data.chats.map(validChat).filter(Boolean);
      const currentId = chats.some((c) => c.id === data.currentId) ? data.currentId : null;
      return { version: VERSION, currentId, chats };
    }
  } catch (err) {
    console.warn("tokenstream: stored conversations unreadable, starting afresh", err);
  }
  return { version: VERSION, currentId: null, chats: [] };
}

const STATES = ["done", "cancelled", "error"];

/** A stored chat with only its well-formed messages, or null when it is not a chat. */
function validChat(chat) {
  if (!chat || typeof chat.id !== "string" || !Array.isArray(chat.messages)) return null;
  const valid = { id: chat.id, messages: chat.messages.map(validMessage).filter(Boolean) };
  valid.title = typeof chat.title === "string" ? chat.title : titleOf(valid);
  valid.updatedAt = Number.isFinite(chat.updatedAt) ? chat.updatedAt : 0;
  return valid;
}

/** A stored message as the page writes it, or null when it is not one. */
function validMessage(m) {
  if (!m || typeof m.content !== "string") return null;
  if (m.role === "user") return { role: "user", content: m.content };
  if (m.role !== "assistant") return null;
  const message = { role: "assistant", content: m.content };
  message.state = STATES.includes(m.state) ? m.state : "done";
  if (typeof m.stats === "string") message.stats = m.stats;
  if (typeof m.error === "string") message.error = m.error;
  return message;
}

/** Write the store. When the browser's storage is full, the oldest conversations (never the
 * current one) are dropped until it fits. Returns {saved, dropped}: saved is false when the
 * browser refuses even so (the store is then left as it was), dropped counts what was removed. */
export function saveStore(store) {
  let chats = store.chats;
  for (;;) {
    try {
      localStorage.setItem(KEY, JSON.stringify({ ...store, chats }));
      const dropped = store.chats.length - chats.length;
      store.chats = chats;
      return { saved: true, dropped };
    } catch (err) {
      const oldest = chats.findLast((c) => c.id !== store.currentId);
      if (err.name !== "QuotaExceededError" || !oldest) {
        console.warn("tokenstream: conversations not saved", err);
        return { saved: false, dropped: 0 };
      }
      chats = chats.filter((c) => c !== oldest);
    }
  }
}

/** True when a `storage` event is about this store (written by another tab). */
export function isStoreEvent(event) {
  return event.key === KEY || event.key === null;
}

export function newChat(store) {
  const chat = {
    id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
    title: "New chat",
    updatedAt: Date.now(),
    messages: [],
  };
  store.chats.unshift(chat);
  store.currentId = chat.id;
  return chat;
}

export function findChat(store, id) {
  return store.chats.find((c) => c.id === id) || null;
}

export function deleteChat(store, id) {
  store.chats = store.chats.filter((c) => c.id !== id);
  if (store.currentId === id) store.currentId = store.chats.length ? store.chats[0].id : null;
}

/** Mark a chat as just changed: it moves to the top of the list and takes its title. */
export function touch(store, chat) {
  chat.updatedAt = Date.now();
  chat.title = titleOf(chat);
  store.chats = [chat, ...store.chats.filter((c) => c !== chat)];
}

/** A chat's title: the first line of its first question, shortened. */
export function titleOf(chat) {
  const first = chat.messages.find((m) => m.role === "user");
  if (!first) return "New chat";
  const line = first.content.trim().split("\n")[0];
  return line.length > TITLE_CHARS ? `${line.slice(0, TITLE_CHARS - 1)}…` : line;
}

/** The messages sent to the model: a turn whose answer failed stays out, its question too. */
export function modelMessages(chat, system) {
  const out = system ? [{ role: "system", content: system }] : [];
  chat.messages.forEach((m, i) => {
    const answer = m.role === "user" ? chat.messages[i + 1] : null;
    if (m.role === "user" && !(answer && answer.state === "error")) out.push(m);
    if (m.role === "assistant" && m.state !== "error" && m.content) {
      out.push({ role: "assistant", content: m.content });
    }
  });
  return out.map((m) => ({ role: m.role, content: m.content }));
}

const SETTINGS_KEY = "tokenstream-settings";

/** The settings form's stored values: {input id: value}. */
export function loadSettings() {
  try {
    const data = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}");
    return data && typeof data === "object" ? data : {};
  } catch {
    return {};
  }
}

export function saveSettings(values) {
  try {
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(values));
  } catch (err) {
    console.warn("tokenstream: settings not saved", err);
  }
}
