// The search's front: its SVG, each plan's point a button that picks it (the kernel applies it).
function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "pipexplore-front-chart";
  el.append(root);
  function draw() {
    root.innerHTML = model.get("svg") || "";
    for (const point of root.querySelectorAll("circle.plan")) {
      point.style.cursor = "pointer";
      point.setAttribute("tabindex", "0");
      const pick = () => {
        model.set("picked", Number(point.dataset.rank));
        model.save_changes();
      };
      point.addEventListener("click", pick);
      point.addEventListener("keydown", (event) => { if (event.key === "Enter" || event.key === " ") pick(); });
    }
    mark();
  }
  function mark() {
    const picked = String(model.get("picked"));
    for (const point of root.querySelectorAll("circle.plan"))
      point.classList.toggle("picked", point.dataset.rank === picked);
    if (picked !== "-1") root.dataset.picked = picked;  // (the last point picked, kept once applied)
  }
  model.on("change:svg", draw);
  model.on("change:picked", mark);
  draw();
}

export default { render };
