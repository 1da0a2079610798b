// A small markdown renderer for the chat page. The whole text is HTML-escaped first, so nothing the model
// writes becomes markup of its own; then the markdown a chat reply uses is marked up: fenced code blocks
// (open ones too, while a reply streams), headings, lists, paragraphs, inline code, bold, italic and
// links whose address is http, https or mailto (any other link stays text). Nothing else is interpreted.
"use strict";

const ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
const SAFE_URL = /^(https?:\/\/|mailto:)/i;
const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+/;

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

function emphasis(html) {
  return html
    .replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([^_]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/\*(?=\S)([^*]*?\S)\*/g, "<em>$1</em>")
    .replace(/(^|[^\w])_(?=\S)([^_]*?\S)_(?!\w)/g, "$1<em>$2</em>");
}

// Inline markup of escaped text: code spans and links are set aside first (as numbered placeholders), so
// that emphasis never reaches inside them.
function inline(html) {
  const kept = [];
  const keep = (piece) => `\u0000${kept.push(piece) - 1}\u0000`;
  html = html
    .replace(/`([^`\n]+)`/g, (_, code) => keep(`<code>${code}</code>`))
    .replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (all, label, url) => SAFE_URL.test(url)
      ? keep(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`) : all);
  return emphasis(html).replace(/\u0000(\d+)\u0000/g, (_, i) => kept[Number(i)]);
}

function renderMarkdown(text) {
  const lines = escapeHtml(text.replace(/\u0000/g, "\ufffd")).split(/\r?\n/);
  const out = [];
  let i = 0;
  const startsBlock = (line) => FENCE.test(line) || HEADING.test(line) || ITEM.test(line);
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {  // to the closing fence, or to the end of a reply still streaming
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      i++;
      const lang = m[1] ? ` class="language-${m[1]}"` : "";
      out.push(`<pre><code${lang}>${code.join("\n")}</code></pre>`);
    } else if ((m = line.match(HEADING))) {
      out.push(`<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`);
      i++;
    } else if ((m = line.match(ITEM))) {
      const ordered = /\d/.test(m[1]);
      const items = [];
      for (; i < lines.length && (m = lines[i].match(ITEM)) && /\d/.test(m[1]) === ordered; i++) {
        items.push(`<li>${inline(lines[i].slice(m[0].length))}</li>`);
      }
      const start = ordered ? parseInt(lines[i - items.length].match(ITEM)[1], 10) : 1;
      const tag = ordered ? "ol" : "ul";
      out.push(`<${tag}${start !== 1 ? ` start="${start}"` : ""}>${items.join("")}</${tag}>`);
    } else if (!line.trim()) {
      i++;
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() && !(para.length && startsBlock(lines[i])); i++) para.push(lines[i]);
      out.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`);
    }
  }
  return out.join("");
}
