// The live KV-cache view: one panel per engine, fed by GET /v1/engines/stream.
import { apiFetch, bindKeyForm, showError, sseData } from "./api.js";
import { CACHED, Chart, FREE, SHARED, USED, drawHostBar, drawPool } from "./kvdraw.js";

const $ = (id) => document.getElementById(id);
const panels = new Map();
let controller = null;

const percent = (x) => `${(100 * (x || 0)).toFixed(1)}%`;
const preemptions = (s) => Object.entries(s)
  .filter(([k]) => k.startsWith("preemptions_")).reduce((sum, [, v]) => sum + v, 0);

function countState(pool, state) {
  return pool.reduce((sum, [s, run]) => sum + (s === state ? run : 0), 0);
}

function figures(engine) {
  const s = engine.stats;
  const hostUsed = (s.num_cpu_blocks || 0) - (s.num_free_cpu_blocks || 0);
  return [
    ["blocks", "blocks", s.num_blocks],
    ["used", "used", s.num_used_blocks],
    ["shared", "shared", countState(engine.pool, SHARED)],
    ["cached", "cached free", s.num_cached_free_blocks],
    ["free", "free", s.num_free_blocks],
    ["usage", "usage", percent(s.usage_ratio)],
    ["utilization", "block utilization", percent(s.block_utilization)],
    ["running", "running", s.running],
    ["waiting", "waiting", s.waiting],
    ["swapped", "swapped", s.swapped],
    ["host", "host blocks used", `${hostUsed} / ${s.num_cpu_blocks || 0}`],
    ["preemptions", "preemptions", preemptions(s)],
    ["cow", "CoW copies", s.cow_copies],
    ["prefix", "prefix hit rate", percent(s.prefix_hit_rate)],
    // a model whose every layer slides gives blocks behind the window back (`kv_layers` in the beat)
    ...(s.kv_layers_release_behind_window
      ? [["window", "sliding window (tokens)", s.kv_layers_window],
        ["released", "released behind window", s.released_blocks]]
      : []),
  ];
}

function renderFigures(dl, engine) {
  dl.replaceChildren(...figures(engine).map(([key, label, value]) => {
    const dt = document.createElement("dt");
    dt.textContent = label;
    const dd = document.createElement("dd");
    dd.dataset.stat = key;
    dd.textContent = String(value ?? 0);
    const pair = document.createElement("div");
    pair.append(dt, dd);
    return pair;
  }));
}

function formatRuns(table) {
  const shown = table.runs.map(([first, count]) => (count > 1 ? `${first}–${first + count - 1}` : `${first}`));
  const listed = table.runs.reduce((sum, [, count]) => sum + count, 0);
  return shown.join(", ") + (listed < table.num_blocks ? ", …" : "");
}

function tableIds(table) {
  return table.host ? [] : table.runs.flatMap(([first, count]) => Array.from({ length: count }, (_, i) => first + i));
}

class EnginePanel {
  constructor(engineId) {
    this.root = $("engine-template").content.firstElementChild.cloneNode(true);
    this.root.dataset.engine = engineId;
    this.root.setAttribute("aria-label", `engine ${engineId}`);
    this.root.querySelector(".engine-id").textContent = engineId;
    this.selected = null;
    const charts = this.root.querySelector(".charts");
    this.charts = {
      usage: new Chart(charts, "usage ratio", { ratio: true }),
      utilization: new Chart(charts, "block utilization", { ratio: true }),
      preemptions: new Chart(charts, "preemptions"),
      cow: new Chart(charts, "CoW copies"),
    };
    $("engines").append(this.root);
  }

  update(engine) {
    this.engine = engine;
    const s = engine.stats;
    this.root.querySelector(".model").textContent = `${engine.model} · beat ${engine.age_s.toFixed(1)} s ago`;
    renderFigures(this.root.querySelector(".figures"), engine);
    this.renderTables(engine.tables);
    this.drawPool();
    drawHostBar(this.root.querySelector(".host"), (s.num_cpu_blocks || 0) - (s.num_free_cpu_blocks || 0),
      s.num_cpu_blocks || 0);
    this.charts.usage.push(s.usage_ratio || 0);
    this.charts.utilization.push(s.block_utilization || 0);
    this.charts.preemptions.push(preemptions(s));
    this.charts.cow.push(s.cow_copies || 0);
  }

  drawPool() {
    const { pool, stats } = this.engine;
    const table = this.engine.tables.find((t) => `${t.id}/${t.index}` === this.selected);
    const canvas = this.root.querySelector(".pool");
    drawPool(canvas, pool, table ? tableIds(table) : []);
    canvas.setAttribute("aria-label", `Block pool of ${stats.num_blocks} blocks: ${countState(pool, USED)} used, `
      + `${countState(pool, SHARED)} shared, ${countState(pool, CACHED)} prefix-cached, ${countState(pool, FREE)} free`);
  }

  renderTables(tables) {
    const body = this.root.querySelector(".tables tbody");
    body.replaceChildren(...tables.map((t) => this.tableRow(t)));
    const note = tables.length ? "hover or focus a row to outline its blocks" : "no running request";
    this.root.querySelector(".tables-note").textContent = note;
  }

  tableRow(table) {
    const row = document.createElement("tr");
    const key = `${table.id}/${table.index}`;
    row.tabIndex = 0;
    row.classList.toggle("selected", key === this.selected);
    const cells = [table.id, String(table.index), `${table.num_blocks}${table.host ? " (host)" : ""}${table.released ? ` (+${table.released} released)` : ""}`, formatRuns(table)];
    row.append(...cells.map((text) => Object.assign(document.createElement("td"), { textContent: text })));
    const select = (value) => () => { this.selected = value; this.drawPool(); };
    row.addEventListener("mouseenter", select(key));
    row.addEventListener("focus", select(key));
    row.addEventListener("mouseleave", select(null));
    row.addEventListener("blur", select(null));
    return row;
  }
}

function render(event) {
  showError($("error"), event.error ? new Error(event.error) : null);
  const seen = new Set();
  for (const engine of event.engines) {
    seen.add(engine.engine_id);
    if (!panels.has(engine.engine_id)) panels.set(engine.engine_id, new EnginePanel(engine.engine_id));
    panels.get(engine.engine_id).update(engine);
  }
  for (const [id, panel] of panels) {
    if (!seen.has(id)) {
      panel.root.remove();
      panels.delete(id);
    }
  }
  const time = new Date(event.time * 1000).toLocaleTimeString();
  $("stream-state").textContent = `live · ${event.engines.length} engine(s) · updated ${time}`;
  $("engines").dataset.updated = String(event.time);
}

async function follow(signal) {
  const resp = await apiFetch("/v1/engines/stream", { signal });
  showError($("error"), null);
  for await (const data of sseData(resp)) {
    if (data === "[DONE]") return;
    render(JSON.parse(data));
  }
}

/** Follows the stream; reconnects after 2 s unless the key was refused. */
async function connect() {
  controller?.abort();
  const own = (controller = new AbortController());
  while (!own.signal.aborted) {
    try {
      await follow(own.signal);
    } catch (error) {
      if (own.signal.aborted) return;
      showError($("error"), error);
      if (error.status === 401) {
        $("stream-state").textContent = "not connected: API key needed";
        return;
      }
    }
    $("stream-state").textContent = "reconnecting…";
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

window.addEventListener("resize", () => panels.forEach((panel) => panel.engine && panel.drawPool()));
bindKeyForm(connect);
connect();
