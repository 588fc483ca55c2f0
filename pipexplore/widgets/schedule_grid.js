// The schedule grid: a row per rank, a cell per action; the hovered action's cells highlighted.
function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "pipexplore-grid";
  el.append(root);
  let cells = new Map();  // action text -> its cells

  function draw() {
    const rows = model.get("rows") || [];
    const labels = model.get("labels") || [];
    const scroll = document.createElement("div");
    scroll.className = "pipexplore-grid-scroll";
    const table = document.createElement("table");
    cells = new Map();
    rows.forEach((row, r) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.textContent = labels[r] || `rank ${r}`;
      tr.append(th);
      for (const action of row) {
        const td = document.createElement("td");
        td.textContent = action;
        td.dataset.action = action;
        if (!cells.has(action)) cells.set(action, []);
        cells.get(action).push(td);
        tr.append(td);
      }
      table.append(tr);
    });
    scroll.append(table);
    const note = document.createElement("div");
    note.className = "pipexplore-grid-note";
    note.textContent = model.get("note") || "";
    root.replaceChildren(scroll, note);
    root.dataset.rows = String(rows.length);
    highlight();
  }

  let hot = [];
  function highlight() {
    for (const td of hot) td.classList.remove("hot");
    const action = model.get("hover") || "";
    hot = cells.get(action) || [];
    for (const td of hot) td.classList.add("hot");
    root.dataset.hover = hot.length ? action : "";
    if (hot.length) {  // into view within the grid's own scroll box, the page stays where it is
      const box = hot[0].closest(".pipexplore-grid-scroll");
      const cell = hot[0];
      if (cell.offsetLeft < box.scrollLeft || cell.offsetLeft + cell.offsetWidth > box.scrollLeft + box.clientWidth)
        box.scrollLeft = cell.offsetLeft - box.clientWidth / 2;
      if (cell.offsetTop < box.scrollTop || cell.offsetTop + cell.offsetHeight > box.scrollTop + box.clientHeight)
        box.scrollTop = cell.offsetTop - box.clientHeight / 2;
    }
  }

  // rows, labels and note come together: one redraw for them all
  let queued = false;
  const redraw = () => {
    if (queued) return;
    queued = true;
    queueMicrotask(() => { queued = false; draw(); });
  };
  model.on("change:rows", redraw);
  model.on("change:labels", redraw);
  model.on("change:note", redraw);
  model.on("change:hover", highlight);
  draw();
}

export default { render };
