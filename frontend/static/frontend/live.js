/* Pool live view: polls the metrics endpoint every second and redraws every chart in place. */
"use strict";

(() => {
  const { api, Poller, fmt, el } = RelayGR;
  const root = document.getElementById("live");
  const pool = root.dataset.pool;
  let windowName = root.dataset.window;
  const chart = (name) => root.querySelector(`[data-chart="${name}"]`);
  const CHARTS = ["latency", "throughput", "hbm", "hits", "preinfer", "instance_p99"];
  const REFUSAL_COLORS = {
    not_at_risk: "#94a3b8", already_cached: "#0891b2", inflight_limit: "#d97706",
    token_rate_limit: "#db2777", cache_budget: "#7c3aed", disabled: "#475569",
  };
  const MiB = 1 / (1024 * 1024);
  let drawn = false;
  let lastKey = null;

  function line(x, y, name, extra = {}) {
    return { type: "scatter", mode: "lines", x, y, name, connectgaps: false, ...extra };
  }

  function drawLatency(m, x) {
    const f = m.fleet;
    Charts.draw(chart("latency"), [
      line(x, f.p99_ms, "P99 (pool)", { line: { color: "#1d4ed8", width: 2.5 } }),
      line(x, f.p50_ms, "P50 (pool)", { line: { color: "#60a5fa", width: 1.5 } }),
    ], Charts.layout(m, { yTitle: "ms", withSlo: true }));
  }

  function drawThroughput(m, x) {
    const f = m.fleet;
    Charts.draw(chart("throughput"), [
      line(x, f.rank_per_s, "ranking requests/s", { line: { color: "#334155", width: 1.5 } }),
      line(x, f.rank_within_slo_per_s, "within SLO/s", { line: { color: "#059669", width: 0 }, fill: "tozeroy",
                                                          fillcolor: "rgba(5,150,105,0.25)" }),
      line(x, f.rank_errors_per_s, "errors/s", { line: { color: "#dc2626", width: 1 } }),
    ], Charts.layout(m, { yTitle: "requests/s" }));
  }

  function drawHbm(m, x) {
    const traces = [];
    Object.entries(m.instances).forEach(([name, s], i) => {
      const color = Charts.color(i);
      traces.push(line(x, Charts.scale(s.hbm_bytes, MiB), `${name} used`, { legendgroup: name, line: { color, width: 2 } }));
      traces.push(line(x, Charts.scale(s.hbm_budget_bytes, MiB), `${name} budget`,
                       { legendgroup: name, line: { color, width: 1, dash: "dash" } }));
    });
    Charts.draw(chart("hbm"), traces, Charts.layout(m, { yTitle: "MiB" }));
  }

  function drawHits(m, x) {
    const f = m.fleet;
    const area = (y, name, color) => line(x, Charts.scale(y, 100), name, { stackgroup: "lookups", line: { color, width: 0.5 } });
    Charts.draw(chart("hits"), [
      area(f.hbm_hit_ratio, "HBM hit", "#059669"),
      area(f.dram_hit_ratio, "DRAM hit", "#2563eb"),
      area(f.inflight_join_ratio, "joined a reload in flight", "#a855f7"),
      area(f.miss_ratio, "miss (recompute)", "#dc2626"),
    ], Charts.layout(m, { yTitle: "% of lookups", ySuffix: "%", yRange: [0, 100] }));
  }

  function drawPreinfer(m, x) {
    const f = m.fleet;
    const traces = [{ type: "bar", x, y: f.preinfer_admitted_per_s, name: "admitted", marker: { color: "#16a34a" } }];
    for (const [reason, values] of Object.entries(f.preinfer_refused_per_s || {})) {
      traces.push({ type: "bar", x, y: values, name: `refused: ${reason}`, marker: { color: REFUSAL_COLORS[reason] || "#64748b" } });
    }
    Charts.draw(chart("preinfer"), traces, Charts.layout(m, { yTitle: "signals/s", barmode: "stack" }));
  }

  function drawInstanceLatency(m, x) {
    const traces = [];
    Object.entries(m.instances).forEach(([name, s], i) => {
      const color = Charts.color(i);
      traces.push(line(x, s.p99_ms, `${name} P99`, { legendgroup: name, line: { color, width: 2 } }));
      traces.push(line(x, s.p50_ms, `${name} P50`, { legendgroup: name, line: { color, width: 1, dash: "dot" } }));
    });
    Charts.draw(chart("instance_p99"), traces, Charts.layout(m, { yTitle: "ms", withSlo: true }));
  }

  function renderTiles(m, s) {
    const set = (name, text, state) => {
      const dd = root.querySelector(`[data-figure="${name}"]`);
      dd.textContent = text;
      if (state) dd.dataset.state = state; else delete dd.dataset.state;
    };
    const t = m.fleet.totals;
    set("p99", s.p99 === null ? "–" : `${fmt.ms(s.p99)} / ${m.slo_ms} ms`,
        s.p99 === null ? null : (s.p99 > m.slo_ms ? "bad" : "good"));
    set("p50", fmt.ms(s.p50));
    set("within", s.within === null || s.within === undefined ? "–" : `${fmt.pct(s.within, 2)} of ≥ ${fmt.pct(s.target, 1)}`,
        s.burn === null ? null : (s.burn > 1 ? "bad" : "good"));
    set("goodput", s.goodput === null ? "–" : `${fmt.rate(s.goodput)} of ${fmt.rate(s.throughput)}`);
    set("hbm_hit", fmt.pct(t.hbm_hit_ratio));
    const refused = Object.values(t.preinfer_refused || {}).reduce((a, b) => a + b, 0);
    set("preinfer", `${fmt.count(t.preinfer_admitted)} / ${fmt.count(refused)}`);
  }

  function renderInstances(m) {
    const tbody = root.querySelector('[data-role="instances"] tbody');
    const rows = Object.entries(m.instances).map(([name, s]) => {
      const t = s.totals;
      const used = Charts.lastOf(s.hbm_bytes);
      const budget = Charts.lastOf(s.hbm_budget_bytes);
      const p99Bad = t.p99_ms !== null && m.slo_ms !== null && t.p99_ms > m.slo_ms;
      return el("tr", { dataset: { instance: name } },
        el("td", {}, name),
        el("td", { class: "num" }, fmt.count(t.rank_requests)),
        el("td", { class: "num" }, fmt.ms(t.p50_ms)),
        el("td", { class: `num ${p99Bad ? "bad" : ""}` }, fmt.ms(t.p99_ms)),
        el("td", { class: "num" }, fmt.pct(t.slo_compliance_ratio, 2)),
        el("td", { class: "num" }, fmt.pct(t.hbm_hit_ratio)),
        el("td", { class: "num" }, fmt.pct(Charts.lastOf(s.miss_ratio))),
        el("td", { class: "num" }, fmt.count(t.preinfer_admitted)),
        el("td", { class: "num" }, `${fmt.bytes(used)} / ${fmt.bytes(budget)}`),
        el("td", { class: "num" }, Charts.lastOf(s.applied_generation) ?? "–"));
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 10, class: "muted" }, "No instance reported telemetry in this window.")));
    tbody.replaceChildren(...rows);
  }

  function render(m) {
    const x = Charts.times(m);
    const empty = Object.keys(m.instances).length === 0;
    root.querySelector('[data-role="empty"]').hidden = !empty;
    drawLatency(m, x);
    drawThroughput(m, x);
    drawHbm(m, x);
    drawHits(m, x);
    drawPreinfer(m, x);
    drawInstanceLatency(m, x);
    for (const name of CHARTS) {
      Charts.overlay(chart(name), empty ? "No data in this window yet." : null, "empty");
    }
    renderTiles(m, Charts.summary(m));
    renderInstances(m);
    root.dataset.updatedAt = String(Date.now());
    drawn = true;
  }

  async function load() {
    const t0 = performance.now();
    const metrics = await api(`/api/v1/pools/${encodeURIComponent(pool)}/metrics/?window=${windowName}`);
    const t1 = performance.now();
    // Coarse windows change every 10 or 60 s; an identical answer is not drawn again.
    const key = JSON.stringify(metrics);
    if (key === lastKey) return;
    lastKey = key;
    render(metrics);
    // How long the last refresh took, fetching and drawing (read by the browser tests).
    root.dataset.fetchMs = (t1 - t0).toFixed(0);
    root.dataset.renderMs = (performance.now() - t1).toFixed(0);
  }

  function onError(err, { fatal, retryInMs }) {
    lastKey = null; // the next answer clears the error overlay even if its figures are unchanged
    const text = fatal
      ? `${err.message} Reload the page to log in again.`
      : `${err.status === 0 ? "Reconnecting to the server" : err.message} — retrying in ${Math.round(retryInMs / 1000)} s${drawn ? "; the last figures stay shown." : "."}`;
    for (const name of CHARTS) Charts.overlay(chart(name), text, "error");
  }

  const poller = new Poller(load, { intervalMs: 1000, onError });
  RelayGR.windowPicker((name) => {
    windowName = name;
    drawn = false;
    lastKey = null;
    for (const c of CHARTS) Charts.overlay(chart(c), "Loading…", "loading");
    poller.start();
  });
  poller.start();
})();
