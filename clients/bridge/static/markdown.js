// Model output as safe Markdown, rendered while it streams.
//
// Every answer is untrusted text. It goes through marked (with raw HTML turned back into text and
// images turned into links), then DOMPurify (no script, no event handler, only http(s)/mailto
// links), and only then into the page; the bridge's Content-Security-Policy is the last wall.
// Streaming: the answer is split into top-level blocks; a block followed by another one is final
// and is rendered once, only the last (still growing) block is rendered again on each frame.

const { Marked } = globalThis.marked;
const { DOMPurify, hljs } = globalThis;

const SAFE_HREF = /^(https?:|mailto:)/i;
// A reference-style link definition, "[name]: https://...", at the start of a line.
const LINK_DEFINITION = /^ {0,3}\[[^\]\n]+\]:/m;
// What a fence's info string may name, e.g. "c++", "objective-c", "python3".
const LANGUAGE = /^[\w+#.-]{1,32}/;

// Tags an answer never needs; DOMPurify already drops script, iframe and friends.
const FORBID_TAGS = ["style", "form", "input", "textarea", "select", "img", "svg", "math",
                     "video", "audio", "source", "picture", "link", "meta", "base"];

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

/** The language a code fence names ("" when none), in the shape a class name can hold. */
function fenceLanguage(lang) {
  const match = (lang || "").trim().match(LANGUAGE);
  return match ? match[0].toLowerCase() : "";
}

function highlighted(code, language) {
  if (!language || !hljs.getLanguage(language)) return escapeHtml(code);
  return hljs.highlight(code, { language, ignoreIllegals: true }).value;
}

/** The HTML of one code block: its language, a copy button and the highlighted code. */
function codeBlockHtml(code, lang) {
  const language = fenceLanguage(lang);
  const cls = language ? ` language-${language}` : "";
  const head = `<span class="code-lang">${escapeHtml(language || "text")}</span>` +
    `<button type="button" class="copy-code">Copy</button>`;
  return `<div class="code-block"><div class="code-head">${head}</div>` +
    `<pre><code class="hljs${cls}">${highlighted(code, language)}</code></pre></div>`;
}

const renderer = {
  code: ({ text, lang }) => codeBlockHtml(text.replace(/\n$/, ""), lang),
  html: ({ text }) => escapeHtml(text),  // raw HTML in an answer is shown as the text it is
  image: ({ href, text }) => `<a href="${escapeHtml(href || "")}">[image: ${escapeHtml(text)}]</a>`,
  checkbox: ({ checked }) => (checked ? "☑ " : "☐ "),  // a task list's box, as text: no <input>
};

const md = new Marked({ gfm: true, breaks: false, renderer });

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName !== "A") return;
  const href = node.getAttribute("href") || "";
  if (!SAFE_HREF.test(href)) node.removeAttribute("href");
  else {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

/** Sanitised DOM nodes of an HTML string made by marked. */
function sanitize(html) {
  return DOMPurify.sanitize(html, {
    RETURN_DOM_FRAGMENT: true,
    FORBID_TAGS,
    FORBID_ATTR: ["style", "id", "name"],
  });
}

function normalize(text) {
  return text.replace(/\r\n?/g, "\n");  // as marked's lexer does; the same length for a prefix
}

/** Render a whole Markdown text into `container` at once (a stored answer). */
export function renderMarkdown(container, text) {
  try {
    container.replaceChildren(sanitize(md.parse(normalize(text))));
  } catch (err) {
    console.warn("tokenstream: Markdown rendering failed, showing plain text", err);
    showPlain(container, text);
  }
}

/** The text as it is, line breaks kept. */
function showPlain(container, text) {
  container.classList.add("plain");
  container.textContent = text;
}

/** An answer's view while it streams: `append` text as it arrives, `render` once per frame,
 * `finish` at the end. */
export class StreamView {
  constructor(container) {
    this.container = container;
    this.text = "";
    this.frozenEnd = 0;       // offset in the normalised text where the unfinished blocks start
    this.live = null;         // the element holding the unfinished blocks
    this.liveHtml = "";
    this.liveCode = null;     // a LiveCode while the unfinished block is one code block
    this.rendered = 0;        // characters of the text now on screen
    this.plain = false;       // true while the answer is shown as plain text (the renderer failed)
  }

  append(text) {
    this.text += text;
  }

  /** Bring the screen up to date with the text received so far. */
  render() {
    if (this.rendered === this.text.length) return;
    try {
      if (this.plain) this.restart();
      this.renderBlocks();
    } catch (err) {  // a parser bug must not lose the answer: plain text until a render works
      console.warn("tokenstream: Markdown rendering failed, showing plain text", err);
      this.plain = true;
      showPlain(this.container, this.text);
    }
    this.rendered = this.text.length;
  }

  /** Start again from an empty container (after plain text was shown). */
  restart() {
    this.container.classList.remove("plain");
    this.container.replaceChildren();
    Object.assign(this, { plain: false, frozenEnd: 0, live: null, liveHtml: "", liveCode: null });
  }

  /** Freeze the blocks that are complete, render the rest as the live block.
   *
   * Which blocks are complete is decided on complete lines only: a line still arriving can turn
   * out to continue the block before it ("*" is a list item until "**bold**" arrives).
   */
  renderBlocks() {
    const source = normalize(this.text);
    const lineEnd = Math.max(source.lastIndexOf("\n") + 1, this.frozenEnd);
    const settled = md.lexer(source.slice(this.frozenEnd, lineEnd));
    let last = settled.length - 1;
    while (last > 0 && settled[last].type === "space") last -= 1;
    const done = settled.slice(0, Math.max(last, 0));
    const raw = done.map((t) => t.raw).join("");
    if (source.startsWith(raw, this.frozenEnd)) {  // else freeze nothing: never seen, but safe
      this.freeze(done);
      this.frozenEnd += raw.length;
    }
    this.renderLive(md.lexer(source.slice(this.frozenEnd)));
  }

  /** The answer is complete: render what is left, highlighting included. Blocks were rendered
   * apart, so a reference link ("[text][name]") in one is literal text when "[name]: URL" is in
   * another: an answer that defines such links is rendered again, whole, once. */
  finish() {
    this.render();
    if (this.liveCode) this.liveCode.highlight();
    if (!this.plain && LINK_DEFINITION.test(this.text)) renderMarkdown(this.container, this.text);
  }

  /** Blocks that are final: rendered once, placed before the live element. */
  freeze(tokens) {
    if (!tokens.length) return;
    const html = md.parser(tokens);
    const block = document.createElement("div");
    block.className = "md-block";
    block.append(sanitize(html));
    this.container.insertBefore(block, this.live);
    if (this.live) this.clearLive();
  }

  /** The unfinished last block, rendered again (a code block grows in place, see LiveCode). */
  renderLive(tokens) {
    if (!this.live) {
      this.live = document.createElement("div");
      this.live.className = "md-block live";
      this.container.append(this.live);
    }
    const blocks = tokens.filter((t) => t.type !== "space");
    if (blocks.length === 1 && blocks[0].type === "code") {
      this.renderLiveCode(blocks[0]);
      return;
    }
    const html = md.parser(tokens);
    if (html === this.liveHtml) return;
    this.live.replaceChildren(sanitize(html));
    this.liveHtml = html;
    this.liveCode = null;
  }

  renderLiveCode(token) {
    const language = fenceLanguage(token.lang);
    if (!this.liveCode || this.liveCode.language !== language) {
      this.live.replaceChildren(sanitize(codeBlockHtml("", language)));
      this.liveCode = new LiveCode(this.live.querySelector("code"), language);
      this.liveHtml = null;  // whatever replaces the code block is rendered
    }
    // "\n`" or "\n``" at the end is most likely the closing fence on its way: not shown.
    this.liveCode.show(token.text.replace(/\n`{1,2}$/, ""));
  }

  clearLive() {
    this.live.replaceChildren();
    this.liveHtml = "";
    this.liveCode = null;
  }
}

/** A code block that grows: new text is appended as plain text every frame; the whole block is
 * highlighted again only now and then, so that a long block costs little per frame. */
class LiveCode {
  constructor(codeEl, language) {
    this.codeEl = codeEl;
    this.language = language;
    this.text = "";
    this.highlightedLength = 0;
    this.tail = document.createTextNode("");   // the text not highlighted yet
    this.codeEl.append(this.tail);
    this.nextHighlightAt = 0;
  }

  show(text) {
    if (!text.startsWith(this.text)) this.nextHighlightAt = 0;  // not an extension: redo it
    this.text = text;
    if (performance.now() >= this.nextHighlightAt) this.highlight();
    else this.tail.data = text.slice(this.highlightedLength);
  }

  /** Highlight the whole text; the next time waits ten times as long as this one took. */
  highlight() {
    const start = performance.now();
    const html = codeBlockHtml(this.text, this.language);
    const fresh = sanitize(html).querySelector("code");
    this.tail.data = "";
    this.codeEl.replaceChildren(...fresh.childNodes, this.tail);
    this.highlightedLength = this.text.length;
    const took = performance.now() - start;
    this.nextHighlightAt = performance.now() + Math.max(100, 10 * took);
  }
}
