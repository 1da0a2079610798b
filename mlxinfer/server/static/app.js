// The chat page: the conversation goes to the server's own /v1/chat/completions and comes back streamed
// (server-sent events), each reply rendered as markdown as it grows. Stop aborts the request; the server
// sees the connection close and cancels it, which frees its KV blocks.
"use strict";

const $ = (id) => document.getElementById(id);
let turns = [];  // the conversation so far, {role, content}, without the system prompt
let controller = null;  // the AbortController of the reply streaming now
let model = "";

// Decode speed: tokens after the first over the time from the first to the last (ms timestamps).
function tokensPerSecond(tokens, firstMs, lastMs) {
  return tokens > 1 && lastMs > firstMs ? (tokens - 1) / ((lastMs - firstMs) / 1000) : null;
}

async function loadModel() {
  try {
    model = (await (await fetch("/v1/models")).json()).data[0].id;
    $("model").textContent = model;
    document.title = `${model} · mlxinfer`;
  } catch (e) {
    $("model").textContent = "(no answer from the server)";
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  $("messages").append(div);
  div.scrollIntoView({block: "end"});
  return div;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push(...turns);
  const body = {model, messages, stream: true, stream_options: {include_usage: true}};
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

// The parsed `data:` payloads of an SSE response, until "[DONE]"; a line cut between two reads waits.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    const lines = (buffer + value).split(/\r?\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function showStats(tokens, rate, note) {
  const speed = rate === null ? "" : `, ${rate.toFixed(1)} tokens/s`;
  $("stats").textContent = `last reply: ${tokens} tokens${speed}${note}`;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(event) {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  turns.push({role: "user", content: text});
  addMessage("user", text);
  const div = addMessage("assistant", "");
  div.classList.add("streaming");
  controller = new AbortController();
  setBusy(true);
  let reply = "", reasoning = "", tokens = 0, usage = null, first = 0, last = 0, pending = false;
  const render = () => {
    pending = false;
    const thought = reasoning
      ? `<details class="reasoning"><summary>Reasoning</summary>${renderMarkdown(reasoning)}</details>` : "";
    div.innerHTML = thought + renderMarkdown(reply);
    div.scrollIntoView({block: "end"});
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: {"content-type": "application/json"}, body: JSON.stringify(requestBody()),
      signal: controller.signal});
    if (!response.ok) throw new Error((await response.json()).error?.message || response.statusText);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      if (!choice.finish_reason) {  // one chunk per token; the finishing one carries only held-back text
        tokens++;
        last = performance.now();
        first = first || last;
      }
      reply += choice.delta.content || "";
      reasoning += choice.delta.reasoning_content || "";
      if (!pending) {
        pending = true;
        requestAnimationFrame(render);
      }
    }
    render();
    turns.push({role: "assistant", content: reply});
    showStats(usage ? usage.completion_tokens : tokens, tokensPerSecond(tokens, first, last), "");
  } catch (e) {
    render();
    if (e.name === "AbortError") {  // stopped: the reply so far stays in the conversation
      turns.push({role: "assistant", content: reply});
      showStats(tokens, tokensPerSecond(tokens, first, last), " (stopped)");
    } else {
      turns.pop();  // the turn that failed is not sent again
      const error = document.createElement("div");
      error.className = "error";
      error.textContent = `Error: ${e.message}`;
      div.append(error);
    }
  } finally {
    div.classList.remove("streaming");
    controller = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", send);
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {  // Enter sends, Shift+Enter is a new line
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", () => {
  controller?.abort();
  turns = [];
  $("messages").replaceChildren();
  $("stats").textContent = "";
});
loadModel();
