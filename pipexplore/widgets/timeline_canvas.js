// Timelines on canvas: the predicted and measured steps (one lane per stage, stage 0 on top, a
// block per action) and the activation memory per stage, on one shared time axis.
//
// Everything drawn comes in the model's `scene` (see timeline_canvas.py): per block panel its lanes
// and, as binary buffers, each block's start, end (ms), phase and micro-batch, sorted by lane
// then start; per memory panel one step line per stage, the peaks and the cap. A redraw is one
// message and one pass over typed arrays; blocks narrower than a few pixels are merged per lane and
// phase, so ~100k blocks draw as at most (lanes x pixels) rectangles. `highlight` shades a stage's
// lanes. Drag across a panel to zoom into that time range (every panel follows), double-click to
// see the whole step, Ctrl+wheel zooms around the pointer and Shift+wheel pans. Hovering a block
// tells its phase, micro-batch, stage, layers and span (and what its run predicted for it).
// Once a scene is drawn, the element carries `data-splits` (the plan it shows) and `data-blocks`
// (how many blocks its panels hold). A split moved in the strip of the same group is re-timed and
// drawn here at once (retime.js; `data-source="page"`) until the kernel's scene of it comes
// (`data-source="kernel"`); `data-retime="ready"` once the page can.
const LANE_MIN = 10, LANE_MAX = 28, LANES_PX = 360, PANEL_MIN = 110, EMPTY_PX = 56, MEMORY_PX = 150;
const AXIS_PX = 34, RIGHT = 12, MERGE_PX = 3;
const STAGE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f"];
const FONT = "12px system-ui, sans-serif", SMALL = "10px system-ui, sans-serif";

// (typed(): a typed array over one of the scene's buffers, in retime.js, which comes first.)

// A CSS colour as one pixel of an ImageData's Uint32Array (RGBA bytes, little-endian), cached.
const PACKED = new Map();
let colorProbe = null;
function packed(color) {
  let value = PACKED.get(color);
  if (value === undefined) {
    colorProbe = colorProbe || document.createElement("canvas").getContext("2d", { willReadFrequently: true });
    colorProbe.clearRect(0, 0, 1, 1);
    colorProbe.fillStyle = color;
    colorProbe.fillRect(0, 0, 1, 1);
    const [r, g, b, a] = colorProbe.getImageData(0, 0, 1, 1).data;
    value = ((a << 24) | (b << 16) | (g << 8) | r) >>> 0;
    PACKED.set(color, value);
  }
  return value;
}

function laneHeight(count) { return Math.max(LANE_MIN, Math.min(LANE_MAX, LANES_PX / Math.max(1, count))); }

function panelHeight(panel) {
  if (panel.kind === "memory") return MEMORY_PX;
  const n = panel.lanes.length;
  return n ? Math.max(PANEL_MIN, n * laneHeight(n)) : EMPTY_PX;
}

// Round tick values between x0 and x1, about `count` of them.
function ticks(x0, x1, count) {
  const span = x1 - x0;
  if (!(span > 0)) return [x0];
  const raw = span / count, magnitude = 10 ** Math.floor(Math.log10(raw)), norm = raw / magnitude;
  const step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * magnitude;
  const out = [];
  for (let v = Math.ceil(x0 / step) * step; v <= x1 + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

function label(value, step) {
  const digits = Math.max(0, Math.min(6, -Math.floor(Math.log10(step || 1) + 1e-9)));
  return value.toFixed(digits);
}

// The last index in [lo, hi) whose start is <= t (lo - 1 if none).
function lastStartingBy(start, lo, hi, t) {
  let a = lo, b = hi;
  while (a < b) {
    const m = (a + b) >> 1;
    if (start[m] <= t) a = m + 1; else b = m;
  }
  return a - 1;
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

// An element of the given class (and properties such as textContent or title).
function make(tag, className, props = {}) {
  return Object.assign(document.createElement(tag), { className, ...props });
}

function render({ model, el: host }) {
  host.classList.add("pipexplore-timeline");
  const root = make("div", "pipexplore-tl");
  host.appendChild(root);
  const bar = make("div", "pipexplore-tl-bar");
  const legend = make("div", "pipexplore-tl-legend");
  const reset = make("button", "pipexplore-tl-button",
                     { textContent: "whole step", title: "zoom out to the whole step (or double-click a panel)" });
  const save = make("button", "pipexplore-tl-button",
                    { textContent: "save PNG", title: "download the timelines as a picture" });
  bar.append(legend, reset, save);
  const stack = make("div", "pipexplore-tl-stack");
  const band = make("div", "pipexplore-tl-band");
  stack.appendChild(band);
  const tip = make("div", "pipexplore-tl-tip");
  root.append(bar, stack, tip);

  let scene = null, panels = [], view = null, left = 60, width = 0, drag = null, announced = false;
  let pending = null;  // the splits the page re-timed and shows while the kernel predicts them (null: none)

  // The theme's colours, read again when JupyterLab switches theme (it marks the body).
  let palette = null;
  function colors() {
    if (!palette) {
      const style = getComputedStyle(host);
      palette = { text: style.getPropertyValue("--jp-ui-font-color1").trim() || "#555",
                  faint: style.getPropertyValue("--jp-ui-font-color2").trim() || "#888",
                  grid: "rgba(128, 128, 128, 0.25)" };
    }
    return palette;
  }
  const theme = new MutationObserver(() => { palette = null; draw(); });
  theme.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-light", "data-jp-theme-name"] });

  // Decode the scene's buffers once per scene.
  function decode(raw) {
    return (raw.panels || []).map((p) => {
      if (p.kind === "memory") {
        const lines = (list) => (list || []).map((s) => ({ ...s, t: typed(s.t, Float32Array), v: typed(s.v, Float32Array) }));
        return { ...p, series: lines(p.series), measured_series: lines(p.measured_series) };
      }
      return {
        ...p, start: typed(p.start, Float32Array), end: typed(p.end, Float32Array),
        phase: typed(p.phase, Uint8Array), micro: typed(p.micro, p.micro_bytes === 4 ? Int32Array : Uint16Array),
        other: p.other ? typed(p.other, Float32Array) : null, offsets: p.offsets || [0],
      };
    });
  }

  // Panels keep their elements from one scene to the next (only titles and pixels change): no
  // layout of the page is forced while a drag's new plan is drawn.
  let nodes = [];  // per panel: { node, title, canvas }
  function element(k, axis) {
    if (!nodes[k]) {
      const node = make("div", "pipexplore-tl-panel");
      const title = make("div", "pipexplore-tl-title");
      const canvas = make("canvas", "pipexplore-tl-canvas");
      node.append(title, canvas);
      stack.insertBefore(node, band);
      nodes[k] = { node, title, canvas, html: null, height: -1 };
    }
    const slot = nodes[k];
    slot.title.style.display = axis ? "none" : "";
    slot.canvas.classList.toggle("pipexplore-tl-axis", axis);
    return slot;
  }

  function build(raw = model.get("scene") || {}) {
    scene = raw;
    const decoded = decode(raw);
    decoded.push({ kind: "axis" });
    for (const extra of nodes.splice(decoded.length)) extra.node.remove();
    panels = decoded.map((p, k) => {
      const slot = element(k, p.kind === "axis");
      const html = p.kind === "axis" ? "" : escapeHtml(p.title || "") +
        (p.warning ? ` <span class="pipexplore-tl-warning">⚠ ${escapeHtml(p.warning)}</span>` : "");
      if (html !== slot.html) {
        slot.title.innerHTML = html;
        slot.html = html;
      }
      const height = p.kind === "axis" ? AXIS_PX : panelHeight(p);
      if (height !== slot.height) {
        slot.canvas.style.height = height + "px";
        slot.height = height;
      }
      return { ...p, node: slot.node, canvas: slot.canvas, height };
    });
    const phases = raw.phases || [];
    const keys = (raw.legend || []).map((k) => phases[k]).map((ph) =>
      `<span class="pipexplore-tl-key"><i style="background:${ph.color}"></i>${escapeHtml(ph.name)}</span>`).join("");
    if (legend.innerHTML !== keys) legend.innerHTML = keys;
    const range = raw.x_range || [0, 1];
    if (!view || !drag && !view.zoomed) view = { x0: range[0], x1: range[1], zoomed: false };
  }

  function x(t) { return left + (t - view.x0) / (view.x1 - view.x0) * (width - left - RIGHT); }
  function time(px) { return view.x0 + (px - left) / (width - left - RIGHT) * (view.x1 - view.x0); }

  function size(canvas, h) {
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.max(1, Math.round(width * ratio));
    canvas.height = Math.max(1, Math.round(h * ratio));
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, h);
    return ctx;
  }

  function grid(ctx, h, palette) {
    ctx.strokeStyle = palette.grid;
    ctx.lineWidth = 1;
    ctx.beginPath();
    for (const v of ticks(view.x0, view.x1, Math.max(2, Math.floor((width - left) / 90)))) {
      const px = Math.round(x(v)) + 0.5;
      ctx.moveTo(px, 0);
      ctx.lineTo(px, h);
    }
    ctx.stroke();
  }

  function drawBlocks(p, palette) {
    const ctx = size(p.canvas, p.height);
    const n = p.lanes.length;
    if (!n) {
      ctx.fillStyle = palette.faint;
      ctx.font = FONT;
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      ctx.fillText(p.empty || "", width / 2, p.height / 2);
      return;
    }
    grid(ctx, p.height, palette);
    const laneH = p.height / n, barH = Math.max(2, laneH * 0.75), phases = scene.phases || [];
    const highlight = model.get("highlight");
    ctx.font = FONT;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let lane = 0; lane < n; lane++) {
      const stage = p.lane_stage[lane];
      if (highlight >= 0 && stage === highlight) {
        ctx.fillStyle = STAGE_COLORS[stage % STAGE_COLORS.length];
        ctx.globalAlpha = 0.18;
        ctx.fillRect(left, lane * laneH, width - left - RIGHT, laneH);
        ctx.globalAlpha = 1;
      }
      ctx.fillStyle = palette.text;
      // Lanes thinner than a label: every k-th one named, so 128 stages still read.
      if (lane % Math.ceil(9 / laneH) === 0) ctx.fillText(p.lanes[lane], left - 6, (lane + 0.5) * laneH);
    }
    // The blocks go into a buffer of pixels, a column of colours per lane (each block fills its
    // columns; one narrower than a pixel still takes one, the last drawn there wins), drawn onto
    // the canvas as one picture: ~100k blocks cost a pass over typed arrays, not a fillRect each.
    const ratio = window.devicePixelRatio || 1;
    const plotW = Math.max(1, Math.round((width - left - RIGHT) * ratio));
    const plotH = Math.max(1, Math.round(p.height * ratio));
    const image = new ImageData(plotW, plotH);
    const pixels = new Uint32Array(image.data.buffer);
    const column = new Uint32Array(plotW);
    const colorsOf = phases.map((ph) => packed(ph.color)), unknown = packed("#999");
    const lo = left, hi = width - RIGHT, labels = [];
    const { start, end, phase, micro, offsets } = p;
    const gap = ratio;  // a wide block ends a pixel (CSS) early: neighbours stay apart
    for (let lane = 0; lane < n; lane++) {
      const y = lane * laneH + (laneH - barH) / 2;
      column.fill(0);
      let any = false;
      for (let i = offsets[lane]; i < offsets[lane + 1]; i++) {
        const a = x(start[i]), b = x(end[i]);
        if (b < lo || a > hi) continue;
        const wide = b - a >= MERGE_PX;
        const from = Math.max(0, Math.floor((a - lo) * ratio));
        const to = Math.min(plotW, wide ? Math.round((b - lo) * ratio - gap) : Math.max(from + 1, Math.ceil((b - lo) * ratio)));
        if (to <= from) continue;
        column.fill(colorsOf[phase[i]] || unknown, from, to);
        any = true;
        if (wide && barH >= 11 && (phases[phase[i]] || {}).letter) labels.push(a, b, y, i);
      }
      if (!any) continue;
      const top = Math.max(0, Math.round(y * ratio)), bottom = Math.min(plotH, Math.round((y + barH) * ratio));
      for (let row = top; row < bottom; row++) pixels.set(column, row * plotW);
    }
    const picture = document.createElement("canvas");
    picture.width = plotW;
    picture.height = plotH;
    picture.getContext("2d").putImageData(image, 0, 0);
    ctx.drawImage(picture, lo, 0, plotW / ratio, plotH / ratio);
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, 0, width - left - RIGHT, p.height);
    ctx.clip();
    ctx.fillStyle = "white";
    ctx.font = SMALL;
    ctx.textAlign = "center";
    for (let k = 0; k < labels.length; k += 4) {
      const a = labels[k], b = labels[k + 1], i = labels[k + 3];
      const text = phases[phase[i]].letter + (micro[i] >= 0 ? micro[i] : "");  // an optimizer step: no micro-batch
      if (b - a - 4 < text.length * 6.2) continue;
      ctx.fillText(text, (Math.max(a, lo) + Math.min(b, hi)) / 2, labels[k + 2] + barH / 2);
    }
    ctx.restore();
    // Planned devices: a dashed line where a node ends, each node named at its first lane.
    const nodes = p.lane_node || [];
    if (nodes.length !== n) return;
    ctx.save();
    ctx.strokeStyle = palette.text;
    ctx.fillStyle = palette.text;
    ctx.lineWidth = 1.5;
    ctx.setLineDash([4, 3]);
    ctx.font = SMALL;
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    for (let lane = 0; lane < n; lane++) {
      if (lane > 0 && nodes[lane] === nodes[lane - 1]) continue;
      const y = Math.round(lane * laneH) + 0.5;
      if (lane > 0) {
        ctx.beginPath();
        ctx.moveTo(left, y);
        ctx.lineTo(width - RIGHT, y);
        ctx.stroke();
      }
      ctx.fillText(`node ${nodes[lane]}`, left + 3, y + 1);
    }
    ctx.restore();
  }

  function drawMemory(p, palette) {
    const ctx = size(p.canvas, p.height);
    grid(ctx, p.height, palette);
    const top = Math.max(p.y_max || 0, 1e-12) * 1.1, pad = 6;
    const y = (v) => p.height - pad - v / top * (p.height - 2 * pad);
    ctx.font = SMALL;
    ctx.fillStyle = palette.text;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const yTicks = ticks(0, top, 3);
    const yStep = yTicks.length > 1 ? yTicks[1] - yTicks[0] : top;
    for (const v of yTicks) ctx.fillText(label(v, yStep) + " " + p.unit, left - 6, y(v));
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, 0, width - left - RIGHT, p.height);
    ctx.clip();
    ctx.lineWidth = 1.5;
    // One step line per stage: the value holds from each change to the next (the prediction's
    // last one to the view's end).
    const steps = (list, toEnd) => {
      for (const s of list || []) {
        ctx.strokeStyle = s.color;
        ctx.beginPath();
        ctx.moveTo(x(0), y(0));
        let last = 0;
        for (let i = 0; i < s.t.length; i++) {
          const px = x(s.t[i]);
          ctx.lineTo(px, y(last));
          last = s.v[i];
          ctx.lineTo(px, y(last));
        }
        if (toEnd) ctx.lineTo(x(view.x1), y(last));
        ctx.stroke();
      }
    };
    steps(p.series, true);
    // What the shown run measured (saved-tensor bytes held per stage), dashed beside the prediction.
    ctx.setLineDash([4, 3]);
    steps(p.measured_series, false);
    ctx.setLineDash([]);
    if (p.cap !== null && p.cap !== undefined) {
      ctx.strokeStyle = "#d62728";
      ctx.setLineDash([6, 4]);
      ctx.beginPath();
      ctx.moveTo(left, y(p.cap));
      ctx.lineTo(width - RIGHT, y(p.cap));
      ctx.stroke();
      ctx.setLineDash([]);
    }
    for (const peak of p.peaks || []) {
      const px = x(peak.t), py = y(peak.v), r = peak.over ? 5 : 4;
      ctx.fillStyle = ctx.strokeStyle = peak.over ? "#d62728" : STAGE_COLORS[peak.stage % STAGE_COLORS.length];
      ctx.beginPath();
      if (peak.over) {
        ctx.lineWidth = 2;
        ctx.moveTo(px - r, py - r); ctx.lineTo(px + r, py + r); ctx.moveTo(px + r, py - r); ctx.lineTo(px - r, py + r);
        ctx.stroke();
      } else {
        ctx.moveTo(px, py - r); ctx.lineTo(px + r, py); ctx.lineTo(px, py + r); ctx.lineTo(px - r, py);
        ctx.closePath();
        ctx.fill();
      }
    }
    ctx.restore();
  }

  function drawAxis(p, palette) {
    const ctx = size(p.canvas, p.height);
    const count = Math.max(2, Math.floor((width - left) / 90));
    const values = ticks(view.x0, view.x1, count);
    const step = values.length > 1 ? values[1] - values[0] : view.x1 - view.x0;
    ctx.font = SMALL;
    ctx.fillStyle = palette.text;
    ctx.strokeStyle = palette.grid;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    ctx.beginPath();
    ctx.moveTo(left, 0.5);
    ctx.lineTo(width - RIGHT, 0.5);
    ctx.stroke();
    for (const v of values) ctx.fillText(label(v, step), x(v), 3);
    ctx.font = FONT;
    ctx.fillText("ms from the step's start", left + (width - left - RIGHT) / 2, 17);
  }

  const probe = document.createElement("canvas").getContext("2d");
  let known = 0;  // the stack's width as the resize observer last saw it (0: not yet)
  function draw() {
    if (!scene) return;
    width = known || stack.clientWidth || host.clientWidth || 800;
    const palette = colors();
    probe.font = FONT;
    let widest = 40;
    for (const p of panels) if (p.lanes) for (const name of p.lanes) widest = Math.max(widest, probe.measureText(name).width);
    for (const p of panels) if (p.kind === "memory") widest = Math.max(widest, 60);
    left = Math.min(Math.ceil(widest) + 12, Math.floor(width * 0.35));
    for (const p of panels) {
      // While the page shows its own re-timing of a move, the memory panel keeps the kernel's last
      // picture, dimmed, until the kernel's scene of the new plan comes (saves its redraw).
      const stale = pending !== null && p.kind === "memory" && p.canvas.width > 1;
      p.node.classList.toggle("pipexplore-tl-stale", stale);
      if (stale) continue;
      if (p.kind === "blocks") drawBlocks(p, palette);
      else if (p.kind === "memory") drawMemory(p, palette);
      else drawAxis(p, palette);
    }
    reset.style.visibility = view.zoomed ? "visible" : "hidden";
    host.dataset.highlight = String(model.get("highlight"));
    host.dataset.blocks = String(panels.reduce((n, p) => n + (p.kind === "blocks" ? p.count || 0 : 0), 0));
    if (scene.splits !== undefined) host.dataset.splits = String(scene.splits);
    // Whose picture this is (the page's re-timing of a move, or the kernel's), and whether a move
    // would be re-timed here (a model of the shown plan's shape has come).
    host.dataset.source = pending !== null ? "page" : "kernel";
    const key = (model.get("retime") || {}).key;
    host.dataset.retime = key && key === scene.retime_key ? "ready" : "";
    if (!announced && panels.length > 1 && typeof model.send === "function") {
      announced = true;
      model.send({ event: "drawn" });  // the kernel may now do what could have delayed this picture
    }
  }

  // ---- hover -------------------------------------------------------------------------
  function blockAt(p, px, py) {
    const n = p.lanes.length;
    if (!n || px < left || px > width - RIGHT) return -1;
    const lane = Math.floor(py / (p.height / n));
    if (lane < 0 || lane >= n) return -1;
    const slack = (view.x1 - view.x0) / Math.max(1, width - left - RIGHT);  // a pixel, in ms
    const t = time(px), lo = p.offsets[lane], hi = p.offsets[lane + 1];
    // The latest block begun by the pointer's time (a pixel's slack) that has not ended before it;
    // blocks of a lane rarely overlap, so a few steps back are enough.
    const last = lastStartingBy(p.start, lo, hi, t + slack);
    for (let i = last; i >= lo && i > last - 64; i--) if (p.end[i] + slack >= t) return i;
    return -1;
  }

  // A block's lane: the one whose bounds hold it (blocks travel sorted by lane).
  function laneOf(p, i) {
    let lo = 0, hi = p.offsets.length - 2;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (p.offsets[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  function describe(p, i) {
    const phases = scene.phases || [];
    const name = (phases[p.phase[i]] || {}).name || "?";
    const lane = laneOf(p, i);
    const stage = p.lane_stage[lane];
    let text = p.micro[i] >= 0 ? `${name} · micro-batch ${p.micro[i]} · stage ${stage}` : `${name} · stage ${stage}`;
    const layers = p.stage_layers && p.stage_layers[stage];
    if (layers) text += ` · layers ${layers[0]}–${layers[1]}`;
    const a = p.start[i], b = p.end[i];
    text += `<br>${a.toFixed(2)} → ${b.toFixed(2)} ms (${(b - a).toFixed(2)} ms)`;
    if (p.other && p.other[i] >= 0) text += `<br>${escapeHtml(p.other_name)}: ${p.other[i].toFixed(2)} ms`;
    if (p.extra && p.extra[i]) text += `<br>${escapeHtml(p.extra[i])}`;
    return text + `<br><span class="pipexplore-tl-faint">${escapeHtml(p.lanes[lane])}</span>`;
  }

  function describeMemory(p, px) {
    const t = time(px);
    const rows = [];
    for (const s of p.series) {
      const k = lastStartingBy(s.t, 0, s.t.length, t);
      rows.push([k >= 0 ? s.v[k] : 0, s]);
    }
    rows.sort((u, w) => w[0] - u[0]);
    const measured = new Map();
    for (const s of p.measured_series || []) {
      const k = lastStartingBy(s.t, 0, s.t.length, t);
      measured.set(s.stage, k >= 0 ? s.v[k] : 0);
    }
    return `${t.toFixed(2)} ms` + rows.slice(0, 8).map(([v, s]) =>
      `<br><i style="background:${s.color}"></i>stage ${s.stage}: ${v.toFixed(2)} ${escapeHtml(p.unit)}` +
      (measured.has(s.stage) ? ` (measured ${measured.get(s.stage).toFixed(2)})` : "")).join("")
      + (rows.length > 8 ? `<br>… ${rows.length - 8} more stages` : "");
  }

  function panelAt(event) {
    for (const p of panels) {
      const box = p.canvas.getBoundingClientRect();
      if (event.clientY >= box.top && event.clientY < box.bottom) return [p, event.clientX - box.left, event.clientY - box.top];
    }
    return [null, 0, 0];
  }

  function showTip(html, event) {
    const box = root.getBoundingClientRect();
    tip.innerHTML = html;
    tip.style.display = "block";
    const w = tip.offsetWidth;
    const px = event.clientX - box.left;
    tip.style.left = Math.max(0, Math.min(px + 14, box.width - w - 4)) + "px";
    tip.style.top = (event.clientY - box.top + 14) + "px";
  }

  // ---- zoom and pan ------------------------------------------------------------------
  function zoomTo(x0, x1) {
    const range = scene.x_range || [0, 1];
    const full = range[1] - range[0];
    if (x1 - x0 < full * 1e-6) return;
    x0 = Math.max(range[0], x0); x1 = Math.min(range[1], x1);
    view = { x0, x1, zoomed: x0 > range[0] || x1 < range[1] };
    draw();
  }

  stack.addEventListener("pointerdown", (event) => {
    if (event.button !== 0) return;
    const box = stack.getBoundingClientRect();
    const px = event.clientX - box.left;
    if (px < left) return;
    drag = { from: px, to: px, box };
    stack.setPointerCapture(event.pointerId);
  });
  stack.addEventListener("pointermove", (event) => {
    if (drag) {
      drag.to = Math.max(left, Math.min(width - RIGHT, event.clientX - drag.box.left));
      band.style.display = "block";
      band.style.left = Math.min(drag.from, drag.to) + "px";
      band.style.width = Math.abs(drag.to - drag.from) + "px";
      tip.style.display = "none";
      return;
    }
    const [p, px, py] = panelAt(event);
    let html = "", action = "";
    if (p && p.kind === "blocks") {
      const i = blockAt(p, px, py);
      if (i >= 0) {
        html = describe(p, i);
        action = actionOf(p, i);
      }
    } else if (p && p.kind === "memory" && px >= left && p.series.length) html = describeMemory(p, px);
    if (html) showTip(html, event); else tip.style.display = "none";
    tellHovered(action);
  });
  stack.addEventListener("pointerleave", () => {
    if (!drag) tip.style.display = "none";
    tellHovered("");
  });

  // The hovered block's action in torch's notation ("3F1"), for a linked schedule grid.
  function actionOf(p, i) {
    const letter = ((scene.phases || [])[p.phase[i]] || {}).letter || "";
    if (!letter) return "";
    const stage = p.lane_stage[laneOf(p, i)];
    return p.micro[i] >= 0 ? `${stage}${letter}${p.micro[i]}` : `${stage}${letter}`;
  }
  function tellHovered(action) {  // in the page only (a linked grid hears it; the kernel need not)
    if (model.get("hovered") === action) return;
    model.set("hovered", action);
  }
  stack.addEventListener("pointerup", () => {
    if (!drag) return;
    const { from, to } = drag;
    drag = null;
    band.style.display = "none";
    if (Math.abs(to - from) > 4) zoomTo(time(Math.min(from, to)), time(Math.max(from, to)));
  });
  stack.addEventListener("dblclick", () => {
    const range = scene.x_range || [0, 1];
    view = { x0: range[0], x1: range[1], zoomed: false };
    draw();
  });
  reset.addEventListener("click", () => stack.dispatchEvent(new MouseEvent("dblclick")));
  stack.addEventListener("wheel", (event) => {
    if (!scene) return;
    const box = stack.getBoundingClientRect();
    const px = event.clientX - box.left;
    if (event.ctrlKey || event.metaKey) {
      event.preventDefault();
      const t = time(px), factor = Math.exp(event.deltaY / 300);
      zoomTo(t - (t - view.x0) * factor, t + (view.x1 - t) * factor);
    } else if (view.zoomed && (event.shiftKey || Math.abs(event.deltaX) > Math.abs(event.deltaY))) {
      event.preventDefault();
      const range = scene.x_range || [0, 1], span = view.x1 - view.x0;
      const shift = (event.shiftKey ? event.deltaY : event.deltaX) / (width - left - RIGHT) * span;
      const x0 = Math.max(range[0], Math.min(range[1] - span, view.x0 + shift));
      zoomTo(x0, x0 + span);
    }
  }, { passive: false });

  save.addEventListener("click", () => {
    const ratio = window.devicePixelRatio || 1, palette = colors();
    const titles = 22, total = panels.reduce((h, p) => h + p.height + (p.kind === "axis" ? 0 : titles), 0);
    const out = document.createElement("canvas");
    out.width = Math.round(width * ratio);
    out.height = Math.round(total * ratio);
    const ctx = out.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.fillStyle = getComputedStyle(host).getPropertyValue("--jp-layout-color0").trim() || "white";
    ctx.fillRect(0, 0, width, total);
    let y = 0;
    for (const p of panels) {
      if (p.kind !== "axis") {
        ctx.fillStyle = palette.text;
        ctx.font = FONT;
        ctx.textBaseline = "middle";
        ctx.textAlign = "left";
        ctx.fillText((p.title || "") + (p.warning ? " ⚠ " + p.warning : ""), 4, y + titles / 2);
        y += titles;
      }
      ctx.drawImage(p.canvas, 0, y, width, p.height);
      y += p.height;
    }
    const link = document.createElement("a");
    link.download = "pipexplore-timeline.png";
    link.href = out.toDataURL("image/png");
    link.click();
  });

  const resize = new ResizeObserver((entries) => {
    const w = Math.round(entries[entries.length - 1].contentRect.width);
    if (w && w !== known) {
      known = w;
      draw();
    }
  });
  resize.observe(stack);
  // A split moved in the strip of this group: the predicted panel re-timed and drawn here at once
  // (retime.js), while the kernel predicts the same plan; its scene then replaces this one. A scene
  // of other splits that comes while a move is pending (the kernel behind) is shown with the
  // pending move re-timed over it; splits the kernel sets in the strip (a move refused) end it.
  let retimer = null;
  const splitsOf = (text) => String(text).split(",").filter((v) => v).map(Number);  // "2,5" -> [2, 5]
  function retimeModel() {
    const raw = model.get("retime") || {};
    if (!raw.key) return null;
    if (!retimer || retimer.raw !== raw) retimer = { raw, model: decodeRetime(raw) };
    return retimer.model;
  }
  function retimed(kernel, splits) {
    const m = retimeModel();
    if (!m || m.key !== kernel.retime_key) return null;
    const r = retime(m, splits, m.panel);
    let shown = 0;
    const panels = (kernel.panels || []).map((p) => {
      if (p.role !== "predicted") return p;
      shown = r.step;
      const figures = `step ${r.step.toFixed(1)} ms · bubble ${(r.bubble * 100).toFixed(1)} %` +
        (m.samples && r.step > 0 ? ` · ${Math.round(m.samples / (r.step / 1e3)).toLocaleString("en-US")} samples/s` : "");
      const [before, after] = p.title_parts || ["", ""];
      return { ...p, start: r.start, end: r.end, phase: r.phase, micro: r.micro, offsets: r.offsets, count: r.count,
               stage_layers: r.stage_layers, title: before + figures + after };
    });
    return { ...kernel, panels, splits: splits.join(","),
             x_range: [0, Math.max(shown, kernel.measured_ms || 0, 1e-9) * 1.02] };
  }
  function showSplits(splits) {
    const kernel = model.get("scene") || {};
    const text = splits.join(",");
    if (text === String(kernel.splits)) {  // the kernel's plan: its own picture
      const was = pending;
      pending = null;
      if (was !== null) { build(kernel); draw(); }
      return;
    }
    if (text === pending) return;
    let preview = null;
    try {
      preview = retimed(kernel, splits);
    } catch (error) {
      console.warn("pipexplore: re-timing the moved split in the page failed; waiting for the kernel", error);
    }
    if (!preview) return;
    pending = text;
    build(preview);
    draw();
  }
  function onSplits(event) {
    const detail = event.detail || {};
    if (detail.group && detail.group === model.get("group")) showSplits(detail.splits || []);
  }
  document.addEventListener("pipexplore-splits", onSplits);
  // The page's code compiled before the first move (the first re-timings of a large plan cost a
  // few times the later ones): the current plan re-timed three times, while the page is idle.
  const idle = window.requestIdleCallback || ((f) => setTimeout(f, 50));
  function warm(times) {
    const kernel = model.get("scene") || {};
    try {
      if (kernel.splits !== undefined) retimed(kernel, splitsOf(kernel.splits));
    } catch (error) { return; }  // told when a move needs it
    if (times > 1) idle(() => warm(times - 1));
  }
  model.on("change:retime", () => { draw(); idle(() => warm(3)); });

  model.on("change:scene", () => {
    const kernel = model.get("scene") || {};
    if (pending !== null && pending === String(kernel.splits)) pending = null;
    let preview = null;
    if (pending !== null) {
      try { preview = retimed(kernel, splitsOf(pending)); } catch (error) { preview = null; }
      if (!preview) pending = null;
    }
    build(preview || kernel);
    draw();
  });
  model.on("change:highlight", draw);
  build();
  draw();
  return () => {
    resize.disconnect();
    theme.disconnect();
    document.removeEventListener("pipexplore-splits", onSplits);
  };
}

export default { render };
