// The chat page: model picker, streamed answers (fetch + SSE), stop, per-answer figures.
import { apiFetch, bindKeyForm, showError, sseData } from "./api.js";

const $ = (id) => document.getElementById(id);
const conversation = [];
let controller = null;

async function loadModels() {
  const select = $("model");
  const previous = select.value;
  try {
    const body = await (await apiFetch("/v1/models")).json();
    select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    if (body.data.some((m) => m.id === previous)) select.value = previous;
    showError($("error"), body.data.length ? null : new Error("No model is served: no engine is alive."));
  } catch (error) {
    select.replaceChildren();
    showError($("error"), error);
  }
}

function numberOf(id) {
  return Number($(id).value);
}

function requestBody(messages) {
  return {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberOf("temperature"),
    top_p: numberOf("top-p"),
    max_tokens: numberOf("max-tokens"),
    n: numberOf("n"),
    ignore_eos: $("ignore-eos").checked, // run to max tokens: fills the KV cache for the /kv view
  };
}

function addMessage(role, text = "") {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Assistant";
  item.append(who);
  if (role === "user") {
    const body = document.createElement("div");
    body.className = "content";
    body.textContent = text;
    item.append(body);
  }
  $("messages").append(item);
  return item;
}

/** The assistant answer being streamed: one content box per choice, and a figures line. */
class Answer {
  constructor(n) {
    this.item = addMessage("assistant");
    this.item.setAttribute("aria-busy", "true");
    this.boxes = Array.from({ length: n }, (_, i) => this.addBox(i, n));
    this.stats = document.createElement("p");
    this.stats.className = "answer-stats muted";
    this.item.append(this.stats);
    this.started = performance.now();
    this.firstToken = null;
    this.usage = null;
    this.requestId = "";
    this.finish = new Array(n).fill(null);
  }

  addBox(index, n) {
    const box = document.createElement("div");
    box.className = "content";
    box.dataset.choice = String(index);
    if (n > 1) box.dataset.label = `choice ${index + 1}`;
    this.item.append(box);
    return box;
  }

  apply(chunk) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.id && !this.requestId) {
      this.requestId = chunk.id; // the engine's request id too: its row on the /kv page
      this.item.dataset.requestId = chunk.id;
    }
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const thinking = choice.delta?.reasoning_content ?? choice.delta?.reasoning;
      if (thinking) {
        this.firstToken ??= performance.now();
        this.thinkingBox(choice.index).textContent += thinking;
      }
      const text = choice.delta?.content;
      if (text) {
        this.firstToken ??= performance.now();
        const box = this.boxes[choice.index];
        if (box.answer) box.answer.textContent += text;
        else box.textContent += text;
      }
      if (choice.finish_reason) this.finish[choice.index] = choice.finish_reason;
    }
  }

  /** A choice's thinking, apart from its answer: a collapsed "Thinking" section above it,
   * made when the first reasoning delta arrives. */
  thinkingBox(index) {
    const box = this.boxes[index];
    if (box.thinking) return box.thinking;
    const details = document.createElement("details");
    details.className = "thinking";
    const summary = document.createElement("summary");
    summary.textContent = "Thinking";
    box.thinking = document.createElement("div");
    box.thinking.className = "thinking-text";
    details.append(summary, box.thinking);
    box.answer = document.createElement("span");
    box.answer.className = "answer-text";
    box.answer.textContent = box.textContent; // an answer that came first stays the answer
    box.textContent = "";
    box.append(details, box.answer);
    return box.thinking;
  }

  text() {
    return this.answerText(0);
  }

  /** The answer of a choice without its thinking (what goes back into the conversation). */
  answerText(index) {
    const box = this.boxes[index];
    return box.answer ? box.answer.textContent : box.textContent;
  }

  end(status) {
    const done = performance.now();
    this.item.removeAttribute("aria-busy");
    this.item.dataset.status = status;
    const parts = [status === "done" ? `finished: ${this.finish.filter(Boolean).join(", ") || "?"}` : status];
    if (this.usage) parts.push(`${this.usage.prompt_tokens} prompt + ${this.usage.completion_tokens} completion tokens`);
    if (this.firstToken !== null) parts.push(`TTFT ${Math.round(this.firstToken - this.started)} ms`);
    const tokens = this.usage?.completion_tokens;
    const seconds = (done - (this.firstToken ?? done)) / 1000;
    if (tokens && seconds > 0) parts.push(`${(tokens / seconds).toFixed(1)} tokens/s`);
    if (this.requestId) parts.push(this.requestId);
    this.stats.textContent = parts.join(" · ");
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function streamAnswer(answer, messages) {
  const resp = await apiFetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(requestBody(messages)),
    signal: controller.signal,
  });
  for await (const data of sseData(resp)) {
    if (data === "[DONE]") return;
    answer.apply(JSON.parse(data));
  }
}

async function send(text) {
  showError($("error"), null);
  addMessage("user", text);
  const messages = [...conversation, { role: "user", content: text }];
  const answer = new Answer(Math.max(1, numberOf("n")));
  controller = new AbortController();
  setBusy(true);
  try {
    await streamAnswer(answer, messages);
    answer.end("done");
    conversation.push(messages.at(-1), { role: "assistant", content: answer.text() });
  } catch (error) {
    const stopped = error.name === "AbortError";
    answer.end(stopped ? "stopped" : "error");
    if (!stopped) showError($("error"), error);
  } finally {
    controller = null;
    setBusy(false);
  }
}

function bindCompose() {
  const prompt = $("prompt");
  $("compose").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = prompt.value.trim();
    if (!text || controller) return;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("compose").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("clear").addEventListener("click", () => {
    conversation.length = 0;
    $("messages").replaceChildren();
  });
}

bindKeyForm(loadModels);
bindCompose();
loadModels();
