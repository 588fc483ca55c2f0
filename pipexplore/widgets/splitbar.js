// The split strip: layers as cells, stages in colours, skip routes as arcs, split handles to drag.
// State lives in the Python model (layers, splits, skips, view, stage_totals, error); a drag
// moves a handle between layer boundaries and commits `splits` on release.
const SVG = "http://www.w3.org/2000/svg";
const W = 1000, BAR_Y = 78, BAR_H = 44, ARC_TOP = 8;
const COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f"];

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

function render({ model, el: host }) {
  const root = document.createElement("div");
  root.className = "pipexplore-splitbar";
  host.appendChild(root);
  const svg = el("svg", { viewBox: `0 0 ${W} 150`, width: "100%", role: "group", "aria-label": "pipeline split points" });
  root.appendChild(svg);
  const message = document.createElement("div");
  message.className = "pipexplore-error";
  root.appendChild(message);
  let drag = null; // { k, splits }

  function boundaries() {
    const layers = model.get("layers");
    const w = weights(layers, model.get("view"));
    const xs = [0];
    for (const f of w) xs.push(xs[xs.length - 1] + f * W);
    return xs;
  }

  function stageOf(layer, splits) {
    let s = 0;
    for (const p of splits) if (p <= layer) s += 1;
    return s;
  }

  function commit(splits) {
    model.set("splits", splits);
    model.save_changes();
  }

  function bounds(k, splits, n) {
    return [k > 0 ? splits[k - 1] + 1 : 1, k < splits.length - 1 ? splits[k + 1] - 1 : n - 1];
  }

  function draw() {
    const layers = model.get("layers");
    const splits = drag ? drag.splits : model.get("splits");
    const xs = boundaries();
    svg.replaceChildren();
    // Cells.
    layers.forEach((layer, i) => {
      const stage = stageOf(i, splits);
      const cell = el("rect", {
        x: xs[i], y: BAR_Y, width: Math.max(0.5, xs[i + 1] - xs[i] - 1), height: BAR_H,
        fill: COLORS[stage % COLORS.length], class: "cell", "data-layer": i, "data-stage": stage,
      }, svg);
      el("title", {}, cell).textContent =
        `${layer.name} (${layer.type}) · stage ${stage}\n${layer.label || ""}`;
      if (xs[i + 1] - xs[i] > 26) {
        const t = el("text", { x: (xs[i] + xs[i + 1]) / 2, y: BAR_Y + BAR_H / 2 + 4, class: "cell-label" }, svg);
        t.textContent = layer.name;
      }
    });
    // Skip arcs above the bar; the ones that cross stages are marked.
    for (const skip of model.get("skips")) {
      const a = (xs[skip.from] + xs[skip.from + 1]) / 2, b = (xs[skip.to] + xs[skip.to + 1]) / 2;
      const crosses = stageOf(skip.from, splits) !== stageOf(skip.to, splits);
      const height = Math.min(BAR_Y - ARC_TOP, 14 + (b - a) / 6);
      const path = el("path", {
        d: `M ${a} ${BAR_Y} C ${a} ${BAR_Y - height}, ${b} ${BAR_Y - height}, ${b} ${BAR_Y}`,
        class: crosses ? "skip crossing" : "skip", "data-from": skip.from, "data-to": skip.to,
      }, svg);
      el("title", {}, path).textContent =
        `skip '${skip.name}': layer ${skip.from} → ${skip.to}` + (crosses ? " (crosses stages: copied)" : "");
    }
    // Per-stage totals under the bar.
    const totals = model.get("stage_totals");
    const points = [0, ...splits, layers.length];
    for (let s = 0; s + 1 < points.length; s++) {
      const t = el("text", { x: (xs[points[s]] + xs[points[s + 1]]) / 2, y: BAR_Y + BAR_H + 20, class: "stage-total" }, svg);
      t.textContent = totals[s] !== undefined ? totals[s] : `stage ${s}`;
    }
    // Handles.
    splits.forEach((split, k) => {
      const x = xs[split];
      const handle = el("g", {
        class: "handle", tabindex: 0, role: "slider", "data-index": k, "aria-valuenow": split,
        "aria-label": `split point ${k + 1}: stage ${k + 1} begins at layer ${split}`,
      }, svg);
      el("rect", { x: x - 6, y: BAR_Y - 8, width: 12, height: BAR_H + 16, class: "grip" }, handle);
      el("line", { x1: x, x2: x, y1: BAR_Y - 8, y2: BAR_Y + BAR_H + 8, class: "bar" }, handle);
      handle.addEventListener("pointerdown", (event) => {
        event.preventDefault();
        handle.setPointerCapture(event.pointerId);
        drag = { k, splits: [...model.get("splits")] };
      });
      handle.addEventListener("pointermove", (event) => {
        if (!drag || drag.k !== k) return;
        const point = svg.createSVGPoint();
        point.x = event.clientX;
        point.y = event.clientY;
        const local = point.matrixTransform(svg.getScreenCTM().inverse());
        const [lo, hi] = bounds(k, drag.splits, layers.length);
        let best = drag.splits[k], distance = Infinity;
        for (let b = lo; b <= hi; b++) {
          const d = Math.abs(xs[b] - local.x);
          if (d < distance) { distance = d; best = b; }
        }
        if (best !== drag.splits[k]) {
          drag.splits[k] = best;
          draw();
          svg.querySelector(`.handle[data-index="${k}"]`)?.setPointerCapture?.(event.pointerId);
        }
      });
      const release = () => {
        if (!drag || drag.k !== k) return;
        const proposed = drag.splits;
        drag = null;
        commit(proposed);
        draw();
      };
      handle.addEventListener("pointerup", release);
      handle.addEventListener("pointercancel", release);
      handle.addEventListener("keydown", (event) => {
        const step = { ArrowLeft: -1, ArrowRight: 1 }[event.key];
        if (!step) return;
        event.preventDefault();
        const current = [...model.get("splits")];
        const [lo, hi] = bounds(k, current, layers.length);
        const next = Math.min(hi, Math.max(lo, current[k] + step));
        if (next !== current[k]) {
          current[k] = next;
          commit(current);
        }
      });
    });
    message.textContent = model.get("error") || "";
  }

  model.on("change:layers", draw);
  model.on("change:splits", draw);
  model.on("change:skips", draw);
  model.on("change:view", draw);
  model.on("change:stage_totals", draw);
  model.on("change:error", draw);
  draw();
}

export default { render };
