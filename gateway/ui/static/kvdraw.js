// Canvas drawing for the KV view: the block-pool grid, the host-pool bar, running charts.

export const FREE = 0, USED = 1, SHARED = 2, CACHED = 3;
const STATE_VARS = { [FREE]: "--free", [USED]: "--used", [SHARED]: "--shared", [CACHED]: "--cached" };
const MAX_GRID_HEIGHT = 360;

function cssColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

/** Sizes the canvas backing store for the device pixel ratio; returns a context in CSS pixels. */
function sizeCanvas(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  canvas.style.height = `${height}px`;
  canvas.width = Math.max(1, Math.round(width * ratio));
  canvas.height = Math.max(1, Math.round(height * ratio));
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return ctx;
}

function cellSize(width, total) {
  const fit = Math.floor(Math.sqrt((width * MAX_GRID_HEIGHT) / Math.max(1, total)));
  return Math.min(18, Math.max(1, fit));
}

/** Geometry of a pool of `total` blocks laid out in rows across `width` CSS pixels. */
export function gridLayout(width, total) {
  const cell = cellSize(width, total);
  const cols = Math.max(1, Math.floor(width / cell));
  return { cell, cols, rows: Math.ceil(total / cols), gap: cell >= 6 ? 1 : 0 };
}

function fillRun(ctx, layout, start, run) {
  const { cell, cols, gap } = layout;
  if (gap) {
    for (let i = start; i < start + run; i++) {
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
    }
    return;
  }
  for (let i = start; i < start + run;) {
    const col = i % cols;
    const span = Math.min(cols - col, start + run - i);
    ctx.fillRect(col * cell, Math.floor(i / cols) * cell, span * cell, cell);
    i += span;
  }
}

/** Draws the run-length pool [[state, run], ...]; outlines the block ids in `highlight`. */
export function drawPool(canvas, pool, highlight = []) {
  const total = pool.reduce((sum, [, run]) => sum + run, 0);
  const width = canvas.clientWidth || 300;
  const layout = gridLayout(width, total);
  const ctx = sizeCanvas(canvas, width, Math.max(1, layout.rows * layout.cell));
  let start = 0;
  for (const [state, run] of pool) {
    ctx.fillStyle = cssColor(STATE_VARS[state] || "--free");
    fillRun(ctx, layout, start, run);
    start += run;
  }
  ctx.strokeStyle = cssColor("--highlight");
  ctx.lineWidth = Math.max(1, layout.cell / 6);
  for (const id of highlight) {
    const { cell, cols } = layout;
    ctx.strokeRect((id % cols) * cell + 0.5, Math.floor(id / cols) * cell + 0.5, cell - 1, cell - 1);
  }
  return layout;
}

/** A bar: the share of host blocks holding swapped-out KV. */
export function drawHostBar(canvas, used, total) {
  const width = canvas.clientWidth || 300;
  const ctx = sizeCanvas(canvas, width, 14);
  ctx.fillStyle = cssColor("--free");
  ctx.fillRect(0, 0, width, 14);
  ctx.fillStyle = cssColor("--swapped");
  ctx.fillRect(0, 0, total ? (width * used) / total : 0, 14);
}

/** A small line chart of the last `capacity` values of one figure. */
export class Chart {
  constructor(container, title, { ratio = false, capacity = 120 } = {}) {
    this.ratio = ratio;
    this.capacity = capacity;
    this.values = [];
    const figure = document.createElement("figure");
    figure.className = "chart";
    this.canvas = document.createElement("canvas");
    this.canvas.setAttribute("role", "img");
    this.caption = document.createElement("figcaption");
    this.title = title;
    figure.append(this.caption, this.canvas);
    container.append(figure);
  }

  push(value) {
    this.values.push(value);
    if (this.values.length > this.capacity) this.values.shift();
    this.draw();
  }

  format(value) {
    return this.ratio ? `${(100 * value).toFixed(1)}%` : String(Math.round(value));
  }

  draw() {
    const width = this.canvas.clientWidth || 200;
    const height = 70;
    const ctx = sizeCanvas(this.canvas, width, height);
    const top = this.ratio ? 1 : Math.max(1, ...this.values);
    const step = width / Math.max(1, this.capacity - 1);
    ctx.strokeStyle = cssColor("--grid");
    ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
    ctx.beginPath();
    this.values.forEach((value, i) => {
      const x = i * step, y = height - 2 - (value / top) * (height - 4);
      if (i === 0) ctx.moveTo(x, y);
      else ctx.lineTo(x, y);
    });
    ctx.strokeStyle = cssColor("--used");
    ctx.lineWidth = 1.5;
    ctx.stroke();
    const last = this.values.at(-1) ?? 0;
    this.caption.textContent = `${this.title}: ${this.format(last)}`;
    this.canvas.setAttribute("aria-label", `${this.title} over time, now ${this.format(last)}`);
  }
}
