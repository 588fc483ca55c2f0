// Residuals on canvas: one row per (stage, phase), one column per micro-batch, each cell the
// error of that action's prediction (predicted ÷ measured − 1), blue when predicted too short,
// red when too long, on a scale symmetric about 0. The model's `grid` holds the labels and, as
// a binary buffer, the values (float32, row after row; NaN: no such action). Hovering a cell
// tells its action and error.
const ROW_H = 22, TOP = 4, BOTTOM = 34, RIGHT = 12;
const FONT = "12px system-ui, sans-serif", SMALL = "10px system-ui, sans-serif";
const BLUE = [33, 102, 172], MID = [247, 247, 247], RED = [178, 24, 43];

function values(view) {
  if (!view) return new Float32Array(0);
  if (ArrayBuffer.isView(view)) {
    const { buffer, byteOffset, byteLength } = view;
    return byteOffset % 4 === 0 ? new Float32Array(buffer, byteOffset, byteLength / 4)
      : new Float32Array(buffer.slice(byteOffset, byteOffset + byteLength));
  }
  return Float32Array.from(view);
}

// The colour of `v` on a blue-white-red scale from -top to +top.
function color(v, top) {
  const t = Math.max(-1, Math.min(1, v / top));
  const [a, b] = t < 0 ? [MID, BLUE] : [MID, RED];
  const f = Math.abs(t);
  return `rgb(${a.map((c, k) => Math.round(c + (b[k] - c) * f)).join(",")})`;
}

function make(tag, className, props = {}) {
  return Object.assign(document.createElement(tag), { className, ...props });
}

function render({ model, el: host }) {
  host.classList.add("pipexplore-residuals");
  const title = make("div", "pipexplore-tl-title");
  const wrap = make("div", "pipexplore-rg-wrap");
  const canvas = make("canvas", "pipexplore-tl-canvas");
  const tip = make("div", "pipexplore-tl-tip");
  wrap.append(canvas, tip);
  host.append(title, wrap);
  let grid = null, cells = null, layout = null, known = 0;

  function draw() {
    grid = model.get("grid") || {};
    cells = values(grid.values);
    const rows = grid.rows || [], columns = grid.columns || [];
    title.textContent = grid.title || "";
    host.dataset.rows = String(rows.length);
    const width = known || wrap.clientWidth || 800;
    const height = rows.length ? TOP + rows.length * ROW_H + BOTTOM : 0;
    const ratio = window.devicePixelRatio || 1;
    canvas.style.height = height + "px";
    canvas.width = Math.max(1, Math.round(width * ratio));
    canvas.height = Math.max(1, Math.round(height * ratio));
    if (!rows.length) return;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const style = getComputedStyle(host);
    const text = style.getPropertyValue("--jp-ui-font-color1").trim() || "#555";
    ctx.font = FONT;
    const left = Math.min(Math.ceil(Math.max(...rows.map((r) => ctx.measureText(r).width))) + 12, width * 0.4);
    const legendW = 150, plotW = Math.max(40, width - left - RIGHT);
    const cellW = plotW / Math.max(1, columns.length);
    let top = 0;
    for (const v of cells) if (Number.isFinite(v)) top = Math.max(top, Math.abs(v));
    top = Math.max(top, 1);
    layout = { left, cellW, rows: rows.length, columns: columns.length };
    ctx.textBaseline = "middle";
    for (let r = 0; r < rows.length; r++) {
      ctx.fillStyle = text;
      ctx.font = FONT;
      ctx.textAlign = "right";
      ctx.fillText(rows[r], left - 6, TOP + (r + 0.5) * ROW_H);
      for (let c = 0; c < columns.length; c++) {
        const v = cells[r * columns.length + c];
        if (!Number.isFinite(v)) continue;
        ctx.fillStyle = color(v, top);
        ctx.fillRect(left + c * cellW, TOP + r * ROW_H, Math.max(1, cellW - 1), ROW_H - 1);
        if (cellW >= 30) {
          ctx.fillStyle = Math.abs(v) > top * 0.6 ? "white" : "#222";
          ctx.font = SMALL;
          ctx.textAlign = "center";
          ctx.fillText(`${v >= 0 ? "+" : ""}${v.toFixed(0)}`, left + (c + 0.5) * cellW, TOP + (r + 0.5) * ROW_H);
        }
      }
    }
    // Micro-batch numbers (as many as fit) and the colour scale.
    const y = TOP + rows.length * ROW_H + 4;
    ctx.fillStyle = text;
    ctx.font = SMALL;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const every = Math.max(1, Math.ceil(24 / cellW));
    for (let c = 0; c < columns.length; c += every) ctx.fillText(columns[c], left + (c + 0.5) * cellW, y);
    ctx.textAlign = "left";
    ctx.fillText("micro-batch", left, y + 14);
    // The scale, on the row of "micro-batch": −top … +top, labelled at both ends.
    const x0 = width - RIGHT - legendW - 64;
    for (let k = 0; k < legendW; k++) {
      ctx.fillStyle = color((k / (legendW - 1) * 2 - 1) * top, top);
      ctx.fillRect(x0 + k, y + 15, 1, 9);
    }
    ctx.fillStyle = text;
    ctx.textAlign = "right";
    ctx.fillText(`−${top.toFixed(0)} %`, x0 - 4, y + 14);
    ctx.textAlign = "left";
    ctx.fillText(`+${top.toFixed(0)} %`, x0 + legendW + 4, y + 14);
  }

  canvas.addEventListener("pointermove", (event) => {
    if (!layout) return;
    const box = canvas.getBoundingClientRect();
    const px = event.clientX - box.left, py = event.clientY - box.top;
    const c = Math.floor((px - layout.left) / layout.cellW), r = Math.floor((py - TOP) / ROW_H);
    const v = r >= 0 && r < layout.rows && c >= 0 && c < layout.columns ? cells[r * layout.columns + c] : NaN;
    if (!Number.isFinite(v)) {
      tip.style.display = "none";
      return;
    }
    tip.textContent = `${grid.rows[r]} · micro-batch ${grid.columns[c]}: error ${v >= 0 ? "+" : ""}${v.toFixed(1)} %`;
    tip.style.display = "block";
    tip.style.left = Math.min(px + 14, box.width - tip.offsetWidth - 4) + "px";
    tip.style.top = (py + 14) + "px";
  });
  canvas.addEventListener("pointerleave", () => { tip.style.display = "none"; });
  const resize = new ResizeObserver((entries) => {
    const w = Math.round(entries[entries.length - 1].contentRect.width);
    if (w && w !== known) {
      known = w;
      draw();
    }
  });
  resize.observe(wrap);
  model.on("change:grid", draw);
  draw();
  return () => resize.disconnect();
}

export default { render };
