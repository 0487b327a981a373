/* The live view's canary card: the pool's latest rollout (polled every second), its state and the
   countdown to bake end, canary vs stable P99 and error-budget burn over the bake (two traces on
   each chart), and Promote / Abort for operators (the buttons exist only for them; the server
   refuses anyone else anyway). */
"use strict";

(() => {
  const { api, Poller, fmt, el } = RelayGR;
  const root = document.querySelector('[data-role="rollout"]');
  if (!root) return;
  const base = `/api/v1/pools/${encodeURIComponent(root.dataset.pool)}/rollout/`;
  const part = (role) => root.querySelector(`[data-role="${role}"]`);
  const chart = (name) => root.querySelector(`[data-chart="${name}"]`);
  const CANARY = "#7c3aed";
  const STABLE = "#0f766e";
  const STATE_TEXT = { baking: "baking", promoted: "promoted", rolled_back: "rolled back", aborted: "aborted" };
  let last = null;

  const layout = (yTitle, line) => ({
    margin: { l: 56, r: 12, t: 22, b: 36 }, height: 220, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#ffffff",
    font: { family: "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size: 11, color: "#1e293b" },
    xaxis: { type: "date", gridcolor: "#eef2f7" }, yaxis: { title: { text: yTitle }, rangemode: "tozero", gridcolor: "#eef2f7" },
    legend: { orientation: "h", y: -0.25 }, annotations: [],
    shapes: line === null || line === undefined ? [] : [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: line, y1: line,
                                                        line: { color: "#dc2626", width: 1.5, dash: "dot" } }],
  });

  function drawCharts(r) {
    const x = r.series.map((p) => new Date(p.t * 1000));
    const trace = (key, name, color) => ({ type: "scatter", mode: "lines+markers", x, y: r.series.map((p) => p[key]),
                                           name, line: { color, width: 2 }, marker: { size: 4 } });
    Charts.draw(chart("rollout_p99"), [trace("canary_p99_ms", `canary (gen. ${r.generation})`, CANARY),
      trace("stable_p99_ms", `stable (gen. ${r.stable_generation})`, STABLE)], layout("P99 ms", null));
    Charts.draw(chart("rollout_burn"), [trace("canary_burn", "canary burn", CANARY),
      trace("stable_burn", "stable burn", STABLE)], layout("error-budget burn", r.max_burn));
  }

  function group(name, f) {
    if (!f) return `${name}: no evaluation yet`;
    const burn = f.burn === null ? "–" : `${f.burn.toFixed(2)} (95% ${f.burn_low.toFixed(2)}–${f.burn_high.toFixed(2)})`;
    return `${name}: ${fmt.count(f.requests)} requests, ${fmt.count(f.bad)} bad, burn ${burn}, P99 ${fmt.ms(f.p99_ms)}`;
  }

  function render(r) {
    last = r;
    root.hidden = r.state === "none";
    root.dataset.state = r.state;
    if (r.state === "none") return;
    const badge = part("state");
    badge.dataset.state = r.state;
    badge.textContent = STATE_TEXT[r.state] || r.state;
    const baking = r.state === "baking";
    part("summary").textContent = `Generation ${r.generation} on ${r.canary.join(", ")} against stable generation `
      + `${r.stable_generation}; max burn ${r.max_burn}, bake ${r.bake_s} s.`;
    countdown();
    part("figures").replaceChildren(el("li", {}, group("canary", r.canary_figures)),
                                    el("li", {}, group("stable", r.stable_figures)));
    part("reason").textContent = baking ? "" : `${STATE_TEXT[r.state]} by ${r.decided_by}: ${r.reason}`;
    root.querySelectorAll("[data-action]").forEach((button) => { button.hidden = !baking; });
    drawCharts(r);
  }

  function countdown() {
    if (!last || last.state !== "baking") {
      part("countdown").textContent = "";
      return;
    }
    const left = Math.max(0, (Date.parse(last.bake_ends_at) - Date.now()) / 1000);
    part("countdown").textContent = left > 0 ? `bake ends in ${Math.ceil(left)} s` : "bake over, deciding…";
    part("countdown").dataset.left = String(Math.ceil(left));
  }

  async function act(action) {
    const button = root.querySelector(`[data-action="${action}"]`);
    button.disabled = true;
    try {
      render(await api(`${base}${action}/`, { method: "POST" }));
      part("message").textContent = "";
    } catch (err) {
      part("message").textContent = `${action === "promote" ? "Not promoted" : "Not aborted"}: ${err.message}`;
    } finally {
      button.disabled = false;
    }
  }

  root.querySelectorAll("[data-action]").forEach((button) => button.addEventListener("click", () => act(button.dataset.action)));
  new Poller(async () => render(await api(base)), { intervalMs: 1000, onError() {} }).start();
  setInterval(countdown, 250);
})();
