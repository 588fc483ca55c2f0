// The split strip: layers as cells, stages in colours, skip routes as arcs, split handles to drag.
// State lives in the Python model (layers, splits, skips, view, stage_totals, error); a drag
// moves a handle between layer boundaries and commits `splits` on release. Double-click a layer
// boundary to add a split; Delete on a focused handle (or dragging it off the strip) removes it.
// The model's blocks are bracketed under the cells; a click on a bracket closes the block into one
// cell (or opens it). Many layers get an overview with a brush (see ZOOM_MIN).
// Handles are drawn after (above) everything else, each with an invisible hit area of HIT_PX screen
// pixels (HIT_MIN_PX where splits are denser), whatever the number of layers. While a handle is
// dragged only it moves (and the cells it passes change colour); the strip is redrawn once, on release.
const SVG = "http://www.w3.org/2000/svg";
const W = 1000, BAR_H = 44, ARC_TOP = 8, OFF_STRIP = 60;
const COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f"];
const CHAR_W = 6.2; // width of one character of the 10px labels, in strip units
// From this many layers on, an overview under the strip holds a brush: the strip shows the
// brushed layers in detail (drag the brush to pan, drag across the overview to choose a range,
// double-click it to see every layer again).
const ZOOM_MIN = 60, OVER_H = 12;
const HIT_PX = 16, HIT_MIN_PX = 10;

function el(tag, attrs = {}, parent = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function weights(layers, view) {
  const key = { time: "time", params: "params", memory: "memory" }[view] || "time";
  const values = layers.map((l) => Math.max(0, Number(l[key]) || 0));
  const total = values.reduce((a, b) => a + b, 0);
  const n = layers.length;
  // Width follows cost, with a floor so that cheap layers stay visible and draggable.
  const floor = 0.25 / n;
  const raw = values.map((v) => (total > 0 ? v / total : 1 / n) + floor);
  const sum = raw.reduce((a, b) => a + b, 0);
  return raw.map((r) => r / sum);
}

// Consecutive layers that share a parent module ("blocks.3.attn", "blocks.3.mlp" → "blocks.3").
function groups(layers) {
  const parent = (name) => {
    const parts = String(name).split(".");
    return parts.length > 1 ? parts.slice(0, -1).join(".") : null;
  };
  const out = [];
  layers.forEach((layer, i) => {
    const p = parent(layer.name);
    const last = out[out.length - 1];
    if (p !== null && last && last.name === p && last.end === i) last.end = i + 1;
    else if (p !== null) out.push({ name: p, start: i, end: i + 1 });
  });
  return out.filter((g) => g.end - g.start > 1 && g.end - g.start < layers.length);
}

// The index in lo…hi of the boundary of `points` nearest to x.
function nearest(points, x, lo, hi) {
  let best = lo, distance = Infinity;
  for (let b = lo; b <= hi; b++) {
    const d = Math.abs(points[b] - x);
    if (d < distance) { distance = d; best = b; }
  }
  return best;
}

function stageOf(layer, splits) {
  let s = 0;
  for (const p of splits) if (p <= layer) s += 1;
  return s;
}

function render({ model, el: host }) {
  const root = document.createElement("div");
  root.className = "pipexplore-splitbar";
  host.appendChild(root);
  const svg = el("svg", { viewBox: `0 0 ${W} 80`, width: "100%", role: "group", "aria-label": "pipeline split points" });
  root.appendChild(svg);
  const message = document.createElement("div");
  message.className = "pipexplore-error";
  root.appendChild(message);
  let drag = null; // { k, splits, off }
  let xs = [];
  let BAR_Y = 10; // room above the bar for skip arcs, when there are any

  let win = null; // [first, end) layers shown in detail, or null: all of them
  const collapsed = new Set(); // the model's blocks drawn closed, as one cell
  let full = []; // every boundary on the whole strip (the overview's scale)

  function boundaries() {
    const layers = model.get("layers");
    const w = weights(layers, model.get("view"));
    full = [0];
    for (const f of w) full.push(full[full.length - 1] + f * W);
    if (!win || win[1] > layers.length || win[0] >= win[1]) {
      win = null;
      return full;
    }
    const a = full[win[0]], scale = W / Math.max(1e-9, full[win[1]] - a);
    return full.map((x) => (x - a) * scale);
  }

  // The overview: each stage as one segment of the whole strip, and the brush over the detail.
  function drawOverview(parent, y, layers, splits) {
    const group = el("g", { class: "overview", transform: `translate(0 ${y})` }, parent);
    const points = [0, ...splits, layers.length];
    for (let s = 0; s + 1 < points.length; s++) {
      el("rect", { x: full[points[s]], y: 0, width: Math.max(0.5, full[points[s + 1]] - full[points[s]]),
                   height: OVER_H, fill: COLORS[s % COLORS.length], class: "overview-stage" }, group);
    }
    const [w0, w1] = win || [0, layers.length];
    const brush = el("rect", { x: full[w0], y: -2, width: Math.max(2, full[w1] - full[w0]), height: OVER_H + 4,
                               class: "brush", "data-first": w0, "data-end": w1 }, group);
    el("title", {}, brush).textContent = `layers ${w0}–${w1 - 1} in detail (drag to pan; double-click: all)`;
    const layerAt = (x) => nearest(full, x, 0, full.length - 1);
    group.addEventListener("pointerdown", (event) => {
      event.preventDefault();
      group.setPointerCapture(event.pointerId);
      const x = local(event).x;
      const onBrush = event.target === brush && win;
      brushing = onBrush ? { pan: true, from: layerAt(x), start: [...win] } : { pan: false, from: layerAt(x) };
    });
    group.addEventListener("pointermove", (event) => {
      if (!brushing) return;
      const at = layerAt(local(event).x);
      const n = layers.length;
      let next;
      if (brushing.pan) {
        const width = brushing.start[1] - brushing.start[0];
        const first = Math.min(n - width, Math.max(0, brushing.start[0] + at - brushing.from));
        next = [first, first + width];
      } else {
        const lo = Math.min(at, brushing.from), hi = Math.max(at, brushing.from);
        next = hi - lo >= 2 ? [lo, Math.min(n, hi)] : win;
      }
      if (String(next) !== String(win)) {
        win = next;
        draw(null);
        svg.querySelector(".overview")?.setPointerCapture?.(event.pointerId);
      }
    });
    const release = () => { brushing = null; };
    group.addEventListener("pointerup", release);
    group.addEventListener("pointercancel", release);
    group.addEventListener("dblclick", (event) => {
      event.stopPropagation();
      win = null;
      draw(null);
    });
  }
  let brushing = null;

  // The timeline of the same group re-times and draws the new plan in the page first (on two cores
  // the kernel's prediction would slow it), then the new splits go to the kernel, whose picture of
  // the plan follows; the caller redraws the strip after (the timeline's picture comes first). The
  // timeline is told too when the kernel sets the splits (a move refused).
  let committing = false;
  function commit(splits) {
    committing = true;
    try {
      model.set("splits", splits);
    } finally {
      committing = false;
    }
    announce();
    model.save_changes();
  }
  function announce() {
    const group = model.get("group");
    if (group) document.dispatchEvent(new CustomEvent("pipexplore-splits",
                                                      { detail: { group, splits: [...model.get("splits")] } }));
  }

  function bounds(k, splits, n) {
    return [k > 0 ? splits[k - 1] + 1 : 1, k < splits.length - 1 ? splits[k + 1] - 1 : n - 1];
  }

  function local(event) {
    const point = svg.createSVGPoint();
    point.x = event.clientX;
    point.y = event.clientY;
    return point.matrixTransform(svg.getScreenCTM().inverse());
  }

  function nearestBoundary(x, lo, hi) {
    return nearest(xs, x, lo, hi);
  }

  function focusedIndex() {
    const active = root.contains(document.activeElement) ? document.activeElement : null;
    return active && active.classList.contains("handle") ? Number(active.getAttribute("data-index")) : null;
  }

  // Screen pixels per strip unit, as the strip was last laid out (read by a ResizeObserver: asking
  // the strip its size in a redraw would lay out the page there and then, ~25 ms at 1,000 layers).
  let unit = null;

  // Each handle's hit area: HIT_PX wide, narrower where the next split is nearer (down to HIT_MIN_PX),
  // centred on its split; in strip units, so set again when the strip's width changes.
  function fitHits() {
    const scale = unit || 0.65;
    const splits = drag ? drag.splits : model.get("splits");
    for (const handle of svg.querySelectorAll(".handle")) {
      const k = Number(handle.getAttribute("data-index"));
      const x = xs[splits[k]];
      const left = k > 0 ? x - xs[splits[k - 1]] : Infinity;
      const right = k + 1 < splits.length ? xs[splits[k + 1]] - x : Infinity;
      const width = Math.max(HIT_MIN_PX / scale, Math.min(HIT_PX / scale, left, right));
      const hit = handle.querySelector(".hit");
      hit.setAttribute("x", x - width / 2);
      hit.setAttribute("width", width);
    }
  }

  // A cell's tooltip, made when the pointer first rests on it (a strip of many layers draws faster without).
  function titled(cell) {
    if (cell.querySelector("title") || cell.classList.contains("block")) return;
    const i = Number(cell.getAttribute("data-layer"));
    const layer = model.get("layers")[i];
    if (layer) el("title", {}, cell).textContent =
      `${layer.name} (${layer.type}) · stage ${cell.getAttribute("data-stage")}\n${layer.label || ""}`;
  }

  let cells = []; // the cell of each layer drawn on its own (by index)
  let stages = []; // the stage each of those cells is coloured for

  // Cells from a to b (either way round) coloured for their stage in `splits`, where it changed.
  function recolour(a, b, splits) {
    const first = Math.min(a, b), end = Math.max(a, b);
    let stage = stageOf(first, splits);
    for (let i = first; i < end; i++) {
      while (stage < splits.length && splits[stage] <= i) stage += 1;
      const cell = cells[i];
      if (!cell || stages[i] === stage) continue;
      stages[i] = stage;
      cell.setAttribute("fill", COLORS[stage % COLORS.length]);
      cell.setAttribute("data-stage", stage);
      cell.querySelector("title")?.remove();
    }
  }

  let wanted = false; // a redraw asked for while a handle was dragged, or in this task already

  // Redraws asked for by the model's changes: one for all those of a task, none while a handle is dragged.
  function redraw() {
    if (wanted) return;
    wanted = true;
    if (!drag) queueMicrotask(() => { if (!drag && wanted) draw(); });
  }

  // The strip in groups, in paint order: what does not depend on the splits (cells, their labels, the
  // model's blocks) is drawn again only when the layers, the view, the detail or the closed blocks change;
  // what does (colours, closed blocks' cells, arcs, totals, overview, handles) at each redraw. Handles last.
  const PARTS = ["overview", "cells", "closed", "brackets", "arcs", "totals", "handles"];
  const part = {};
  let built = null; // what the cells and brackets were drawn for
  let blocks = [];

  function build(layers, splits, GROUP_Y) {
    svg.replaceChildren();
    for (const name of PARTS) part[name] = el("g", { class: `part-${name}` }, svg);
    blocks = groups(layers);
    // Layers inside a closed block are drawn as the block (in draw: its cells depend on the splits).
    const inClosed = new Set();
    for (const g of blocks) if (collapsed.has(g.name)) for (let i = g.start; i < g.end; i++) inClosed.add(i);
    // Cells (labelled only where the name fits); those outside the detail are not drawn.
    cells = [];
    stages = [];
    let stage = 0;
    layers.forEach((layer, i) => {
      while (stage < splits.length && splits[stage] <= i) stage += 1;
      if (xs[i + 1] < 0 || xs[i] > W || inClosed.has(i)) return;
      const width = xs[i + 1] - xs[i];
      stages[i] = stage;
      cells[i] = el("rect", {
        x: xs[i], y: BAR_Y, width: Math.max(0.5, width - (width > 3 ? 1 : 0)), height: BAR_H,
        fill: COLORS[stage % COLORS.length], class: "cell", "data-layer": i, "data-stage": stage,
      }, part.cells);
      if (width <= CHAR_W + 4) return; // (no label fits)
      const name = String(layer.name);
      const label = width > name.length * CHAR_W + 6 ? name : width > String(i).length * CHAR_W + 4 ? String(i) : "";
      if (label) {
        const t = el("text", { x: (xs[i] + xs[i + 1]) / 2, y: BAR_Y + BAR_H / 2 + 4, class: "cell-label" }, part.cells);
        t.textContent = label;
      }
    });
    // The model's own blocks (a shared parent module) as brackets under the cells: a click on
    // one closes the block into one cell, or opens it again.
    for (const g of blocks) {
      if (xs[g.end] < 0 || xs[g.start] > W) continue;
      const x0 = Math.max(0, xs[g.start]) + 1, x1 = Math.min(W, xs[g.end]) - 1;
      const shut = collapsed.has(g.name);
      el("path", { d: `M ${x0} ${GROUP_Y - 4} v 4 H ${x1} v -4`, class: shut ? "group closed" : "group" },
         part.brackets);
      const hit = el("rect", { x: x0, y: GROUP_Y - 8, width: Math.max(4, x1 - x0), height: 24, class: "group-hit",
                               "data-block": g.name }, part.brackets);
      el("title", {}, hit).textContent = shut ? `${g.name}: click to open` : `${g.name}: click to close into one block`;
      hit.addEventListener("click", () => {
        if (shut) collapsed.delete(g.name);
        else collapsed.add(g.name);
        draw(null);
      });
      if (x1 - x0 > g.name.length * CHAR_W + 4) {
        const t = el("text", { x: (x0 + x1) / 2, y: GROUP_Y + 12, class: "group-label" }, part.brackets);
        t.textContent = g.name;
      }
    }
  }

  function draw(focus = focusedIndex()) {
    wanted = false;
    const layers = model.get("layers");
    const splits = drag ? drag.splits : model.get("splits");
    const nodes = model.get("nodes") || [];
    xs = boundaries();
    BAR_Y = model.get("skips").length ? 70 : nodes.some((node, k) => k > 0 && node !== nodes[k - 1]) ? 24 : 10;
    const shape = [layers, model.get("view"), String(win), [...collapsed].sort().join("\n"), BAR_Y];
    const GROUP_Y = BAR_Y + BAR_H + 24;
    if (!built || shape.some((value, i) => value !== built[i])) {
      build(layers, splits, GROUP_Y);
      built = shape;
    } else {
      recolour(0, layers.length, splits);
    }
    const zoomable = layers.length >= ZOOM_MIN;
    const OVER_Y = GROUP_Y + (blocks.length ? 20 : 0) + 4;
    svg.setAttribute("viewBox", `0 0 ${W} ${OVER_Y + (zoomable ? OVER_H + 8 : -4)}`);
    for (const name of ["overview", "closed", "arcs", "totals", "handles"]) part[name].replaceChildren();
    if (zoomable) drawOverview(part.overview, OVER_Y, layers, splits);
    // A closed block: one cell per stage it spans, named once.
    for (const g of blocks) {
      if (!collapsed.has(g.name) || xs[g.end] < 0 || xs[g.start] > W) continue;
      const cuts = [g.start, ...splits.filter((p) => p > g.start && p < g.end), g.end];
      for (let k = 0; k + 1 < cuts.length; k++) {
        const stage = stageOf(cuts[k], splits);
        const width = xs[cuts[k + 1]] - xs[cuts[k]];
        const cell = el("rect", {
          x: xs[cuts[k]], y: BAR_Y, width: Math.max(0.5, width - (width > 3 ? 1 : 0)), height: BAR_H,
          fill: COLORS[stage % COLORS.length], class: "cell block", "data-layer": cuts[k], "data-stage": stage,
          "data-block": g.name,
        }, part.closed);
        el("title", {}, cell).textContent =
          `${g.name}: layers ${g.start}–${g.end - 1} · stage ${stage}\n(click its bracket to open it)`;
      }
      const width = xs[g.end] - xs[g.start];
      if (width > g.name.length * CHAR_W + 6) {
        const t = el("text", { x: (xs[g.start] + xs[g.end]) / 2, y: BAR_Y + BAR_H / 2 + 4, class: "cell-label" },
                     part.closed);
        t.textContent = g.name;
      }
    }
    // Skip arcs above the bar; the ones that cross stages are marked.
    for (const skip of model.get("skips")) {
      const a = (xs[skip.from] + xs[skip.from + 1]) / 2, b = (xs[skip.to] + xs[skip.to + 1]) / 2;
      const crosses = stageOf(skip.from, splits) !== stageOf(skip.to, splits);
      const height = Math.min(BAR_Y - ARC_TOP, 14 + (b - a) / 6);
      const path = el("path", {
        d: `M ${a} ${BAR_Y} C ${a} ${BAR_Y - height}, ${b} ${BAR_Y - height}, ${b} ${BAR_Y}`,
        class: crosses ? "skip crossing" : "skip", "data-from": skip.from, "data-to": skip.to,
      }, part.arcs);
      el("title", {}, path).textContent =
        `skip '${skip.name}': layer ${skip.from} → ${skip.to}` + (crosses ? " (crosses stages: copied)" : "");
    }
    // Per-stage totals under the bar, where they fit.
    const totals = model.get("stage_totals");
    const points = [0, ...splits, layers.length];
    for (let s = 0; s + 1 < points.length; s++) {
      const text = totals[s] !== undefined && !drag ? totals[s] : `stage ${s}`;
      const a = Math.max(0, xs[points[s]]), b = Math.min(W, xs[points[s + 1]]);
      if (b - a < text.length * 7) continue;
      const t = el("text", { x: (a + b) / 2, y: BAR_Y + BAR_H + 18, class: "stage-total" }, part.totals);
      t.textContent = text;
    }
    // Handles, last: drawn above the cells, arcs and brackets.
    splits.forEach((split, k) => {
      const x = xs[split];
      if (x < 0 || x > W) return; // outside the detail: brush the overview to reach it
      const left = k > 0 ? x - xs[splits[k - 1]] : x;
      const right = (k + 1 < splits.length ? xs[splits[k + 1]] : W) - x;
      const grip = Math.max(3, Math.min(12, left, right));
      const [lo, hi] = bounds(k, splits, layers.length);
      const handle = el("g", {
        class: "handle", tabindex: 0, role: "slider", "data-index": k,
        "aria-valuenow": split, "aria-valuemin": lo, "aria-valuemax": hi,
        "aria-label": `split point ${k + 1}: stage ${k + 1} begins at layer ${split} (arrows move it, Delete removes it)`,
      }, part.handles);
      el("rect", { y: BAR_Y - 8, height: BAR_H + 16, class: "hit" }, handle);  // (its x and width: fitHits)
      el("rect", { x: x - grip / 2, y: BAR_Y - 8, width: grip, height: BAR_H + 16, class: "grip" }, handle);
      el("line", { x1: x, x2: x, y1: BAR_Y - 8, y2: BAR_Y + BAR_H + 8, class: "bar" }, handle);
      // A split where the next stage's device is on another node (planned devices): marked and named
      // (centred over the split, so that the handle's middle stays on it).
      if (nodes.length > k + 1 && nodes[k + 1] !== nodes[k]) {
        handle.classList.add("node");
        const t = el("text", { x, y: BAR_Y - 10, class: "node-label" }, handle);
        t.textContent = `node ${nodes[k + 1]}`;
        handle.setAttribute("aria-label", handle.getAttribute("aria-label") + `; node ${nodes[k + 1]} begins here`);
      }
      handle.addEventListener("pointerdown", (event) => {
        if (drag || event.button !== 0) return;
        event.preventDefault();
        clearTimeout(hoverTimer);
        handle.setPointerCapture(event.pointerId);
        drag = { k, splits: [...model.get("splits")], from: split, off: false };
        root.classList.add("dragging");
      });
      // Only this handle moves while dragged (and the cells it passes change colour).
      handle.addEventListener("pointermove", (event) => {
        if (!drag || drag.k !== k) return;
        const p = local(event);
        const [lo, hi] = bounds(k, drag.splits, layers.length);
        const best = nearestBoundary(p.x, lo, hi);
        const off = Math.abs(p.y - (BAR_Y + BAR_H / 2)) > OFF_STRIP;
        if (best === drag.splits[k] && off === drag.off) return;
        const was = drag.splits[k];
        drag.splits[k] = best;
        drag.off = off;
        recolour(was, best, drag.splits);
        handle.setAttribute("transform", `translate(${xs[best] - x} 0)`);
        handle.classList.toggle("removing", off);
        handle.setAttribute("aria-valuenow", best);
      });
      const release = () => {
        if (!drag || drag.k !== k) return;
        const proposed = drag.off ? drag.splits.filter((_, j) => j !== k) : drag.splits;
        const moved = drag.off || drag.splits[k] !== drag.from;
        drag = null;
        root.classList.remove("dragging");
        if (moved) commit(proposed);
        // (the strip shows the move already; redrawn in a task of its own, after the timeline's)
        if (moved || wanted) setTimeout(() => draw(null), 0);
      };
      handle.addEventListener("pointerup", release);
      handle.addEventListener("pointercancel", release);
      handle.addEventListener("lostpointercapture", release);
      handle.addEventListener("keydown", (event) => {
        const current = [...model.get("splits")];
        if (event.key === "Delete" || event.key === "Backspace") {
          event.preventDefault();
          commit(current.filter((_, j) => j !== k));
          draw(current.length > 1 ? Math.min(k, current.length - 2) : null);
          return;
        }
        const step = { ArrowLeft: -1, ArrowRight: 1 }[event.key];
        if (!step) return;
        event.preventDefault();
        const [lo, hi] = bounds(k, current, layers.length);
        const next = Math.min(hi, Math.max(lo, current[k] + step));
        if (next !== current[k]) {
          current[k] = next;
          commit(current);
          draw(k);
        }
      });
    });
    fitHits();
    if (focus !== null && focus !== undefined) svg.querySelector(`.handle[data-index="${focus}"]`)?.focus();
    message.textContent = model.get("error") || "";
  }

  // Double-click between two layers: a new split there (one more stage).
  svg.addEventListener("dblclick", (event) => {
    if (event.target.closest && event.target.closest(".handle, .group-hit, .overview")) return;
    const layers = model.get("layers");
    if (layers.length < 2) return;
    const b = nearestBoundary(local(event).x, 1, layers.length - 1);
    const current = model.get("splits");
    if (current.includes(b)) return;
    const next = [...current, b].sort((a, c) => a - c);
    commit(next);
    draw(next.indexOf(b));
  });

  // Hovering a layer names its stage (the explorer shades that stage's lanes in the timelines),
  // once the pointer rests on it: passing over the strip on the way to a handle sends nothing.
  let hoverTimer = null;
  function hover(stage) {
    clearTimeout(hoverTimer);
    hoverTimer = setTimeout(() => {
      if (drag || model.get("hovered") === stage) return;
      model.set("hovered", stage);
      model.save_changes();
    }, 150);
  }
  svg.addEventListener("pointerover", (event) => {
    const cell = event.target.closest && event.target.closest(".cell");
    if (!cell) return;
    titled(cell);
    hover(Number(cell.dataset.stage));
  });
  svg.addEventListener("pointerleave", () => hover(-1));

  for (const name of ["layers", "splits", "skips", "view", "stage_totals", "error", "nodes"]) model.on(`change:${name}`, () => {
    if (!committing) redraw();
  });
  model.on("change:splits", () => { if (!committing) announce(); });
  draw(null);
  // (a handle's hit area is so many screen pixels wide: set again when the strip's width changes)
  const resize = new ResizeObserver((entries) => {
    const width = entries[entries.length - 1].contentRect.width;
    if (width > 0 && width / W !== unit) {
      unit = width / W;
      if (!drag) fitHits();
    }
  });
  resize.observe(svg);
  return () => resize.disconnect();
}

export default { render };
