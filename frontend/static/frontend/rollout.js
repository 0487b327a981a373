/* The live view's canary card: the pool's latest rollout (polled every second), its state and the
   countdown to bake end, canary vs stable P99 (against the SLO line) and error-budget burn over the bake
   (two traces on each chart), and Promote / Abort for operators (the buttons exist only for them; the
   server refuses anyone else anyway). A rollout decided more than RECENT_S ago gives way to one line
   that says how it ended and links to the audit log. */
"use strict";

(() => {
  const { api, Poller, fmt, el } = RelayGR;
  const root = document.querySelector('[data-role="rollout"]');
  if (!root) return;
  const pool = root.dataset.pool;
  const base = `/api/v1/pools/${encodeURIComponent(pool)}/rollout/`;
  const sloMs = Number(root.dataset.sloMs);
  const note = document.querySelector('[data-role="rollout-note"]');
  const part = (role) => root.querySelector(`[data-role="${role}"]`);
  const chart = (name) => root.querySelector(`[data-chart="${name}"]`);
  const CANARY = "#7c3aed";
  const STABLE = "#0f766e";
  const STATE_TEXT = { baking: "baking", promoted: "promoted", rolled_back: "rolled back", aborted: "aborted" };
  const RECENT_S = 600;
  let last = null;

  /* A tick step of 1, 2 or 5 × 10^k giving about five ticks up to `top`, never below `least`. */
  function tickStep(top, least) {
    const rough = Math.max(least, top / 5);
    const power = 10 ** Math.floor(Math.log10(rough));
    return [1, 2, 5, 10].map((f) => f * power).find((step) => step >= rough);
  }

  /* The y axis from 0 to above both the values and the dotted line (the SLO, or max burn). */
  const layout = (yTitle, values, line, leastStep) => {
    const top = Math.max(line || 0, ...values.filter((v) => v !== null && v !== undefined)) * 1.15 || 1;
    return {
      margin: { l: 56, r: 12, t: 22, b: 36 }, height: 220, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#ffffff",
      font: { family: "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size: 11, color: "#1e293b" },
      xaxis: { type: "date", gridcolor: "#eef2f7", tickformat: "%H:%M:%S", nticks: 7 },
      yaxis: { title: { text: yTitle }, range: [0, top], tick0: 0, dtick: tickStep(top, leastStep), gridcolor: "#eef2f7" },
      legend: { orientation: "h", y: -0.25 }, annotations: [],
      shapes: line === null || line === undefined ? [] : [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: line, y1: line,
                                                          line: { color: "#dc2626", width: 1.5, dash: "dot" } }],
    };
  };

  function drawCharts(r) {
    const x = r.series.map((p) => new Date(p.t * 1000));
    const values = (key) => r.series.map((p) => p[key]);
    const trace = (key, name, color) => ({ type: "scatter", mode: "lines+markers", x, y: values(key),
                                           name, line: { color, width: 2 }, marker: { size: 4 } });
    const p99 = [...values("canary_p99_ms"), ...values("stable_p99_ms")];
    const burns = [...values("canary_burn"), ...values("stable_burn")];
    // The P99s against the SLO both sides are judged on (a canary may not change it), in whole ms.
    Charts.draw(chart("rollout_p99"), [trace("canary_p99_ms", `canary (gen. ${r.generation})`, CANARY),
      trace("stable_p99_ms", `stable (gen. ${r.stable_generation})`, STABLE)],
      layout(`P99 ms (dotted: SLO ${sloMs} ms)`, p99, sloMs, 1));
    Charts.draw(chart("rollout_burn"), [trace("canary_burn", "canary burn", CANARY),
      trace("stable_burn", "stable burn", STABLE)], layout("error-budget burn", burns, r.max_burn, 0.01));
  }

  function group(name, f) {
    if (!f) return `${name}: no evaluation yet`;
    const burn = f.burn === null ? "–" : `${f.burn.toFixed(2)} (95% ${f.burn_low.toFixed(2)}–${f.burn_high.toFixed(2)})`;
    return `${name}: ${fmt.count(f.requests)} requests, ${fmt.count(f.bad)} bad, burn ${burn}, P99 ${fmt.ms(f.p99_ms)}`;
  }

  /* "rolled back by rollout-evaluator: <why>"; a decision by hand gives "aborted by sre" as its
     reason, which is said once. */
  function decision(r) {
    const said = `${STATE_TEXT[r.state] || r.state} by ${r.decided_by}`;
    return r.reason && !r.reason.startsWith(`${STATE_TEXT[r.state]} by`) ? `${said}: ${r.reason}` : said;
  }

  const decidedAgoS = (r) => (r.decided_at ? (Date.now() - Date.parse(r.decided_at)) / 1000 : 0);

  function render(r) {
    last = r;
    const old = r.state !== "none" && r.state !== "baking" && decidedAgoS(r) > RECENT_S;
    root.hidden = r.state === "none" || old;
    root.dataset.state = r.state;
    note.hidden = !old;
    if (old) {
      note.replaceChildren(`Last canary: generation ${r.generation} ${decision(r)}, ${fmt.age(decidedAgoS(r))} ago (`,
        el("a", { href: `/audit/?pool=${encodeURIComponent(pool)}` }, "audit log"), ", ",
        el("a", { href: base }, "the rollout in the API"), ").");
    }
    if (root.hidden) return;
    const badge = part("state");
    badge.dataset.state = r.state;
    badge.textContent = STATE_TEXT[r.state] || r.state;
    const baking = r.state === "baking";
    part("summary").textContent = `Generation ${r.generation} on ${r.canary.join(", ")} against stable generation `
      + `${r.stable_generation}; max burn ${r.max_burn}, bake ${r.bake_s} s.`;
    countdown();
    part("figures").replaceChildren(el("li", {}, group("canary", r.canary_figures)),
                                    el("li", {}, group("stable", r.stable_figures)));
    part("reason").textContent = baking ? "" : decision(r);
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
