// Shared by both pages: the API key (kept in sessionStorage), authenticated fetch with
// OpenAI-style errors, and a reader of server-sent events from a fetch response.

const KEY_NAME = "pagedserve.apiKey";

export function getKey() {
  return sessionStorage.getItem(KEY_NAME) || "";
}

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY_NAME, key);
  else sessionStorage.removeItem(KEY_NAME);
}

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function withKey(headers = {}) {
  const key = getKey();
  return key ? { ...headers, Authorization: `Bearer ${key}` } : { ...headers };
}

async function toError(resp) {
  let message = `HTTP ${resp.status} ${resp.statusText}`;
  let code = null;
  try {
    const body = await resp.json();
    message = body.error?.message || message;
    code = body.error?.code || null;
  } catch {
    // not a JSON error body: keep the status line
  }
  if (resp.status === 401) message += " (enter the API key at the top of the page)";
  return new ApiError(resp.status, message, code);
}

/** fetch() with the Bearer key; throws ApiError on a non-2xx answer. */
export async function apiFetch(path, options = {}) {
  const resp = await fetch(path, { ...options, headers: withKey(options.headers) });
  if (!resp.ok) throw await toError(resp);
  return resp;
}

function dataOf(block) {
  const lines = block.split(/\r?\n/).filter((line) => line.startsWith("data:"));
  return lines.length ? lines.map((line) => line.slice(5).replace(/^ /, "")).join("\n") : null;
}

/** Yields the `data:` payload of every event in a streamed SSE response body. */
export async function* sseData(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      const blocks = buffer.split(/\r?\n\r?\n/);
      buffer = blocks.pop();
      for (const block of blocks) {
        const data = dataOf(block);
        if (data !== null) yield data;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

/** Wires the header's key form: saves to sessionStorage and calls `onChange`. */
export function bindKeyForm(onChange) {
  const form = document.getElementById("key-form");
  const input = document.getElementById("api-key");
  const state = document.getElementById("key-state");
  const show = () => { state.textContent = getKey() ? "key set" : "no key"; };
  input.value = getKey();
  show();
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setKey(input.value.trim());
    show();
    onChange();
  });
}

/** Shows `error` (or clears with null) in the page's alert region. */
export function showError(element, error) {
  element.textContent = error ? String(error.message || error) : "";
  element.hidden = !error;
  if (error?.status === 401) document.getElementById("key-details").open = true;
}
