/* Pool live view: polls the pool's figures every second, incrementally (only points newer than the
   last one held), and draws the pool's aggregates, its worst instances and a paged, sortable table. */
"use strict";

(() => {
  const { api, Poller, fmt, el } = RelayGR;
  const root = document.getElementById("live");
  const pool = root.dataset.pool;
  const base = `/api/v1/pools/${encodeURIComponent(pool)}`;
  let windowName = root.dataset.window;
  const chart = (name) => root.querySelector(`[data-chart="${name}"]`);
  const part = (role) => root.querySelector(`[data-role="${role}"]`);
  const CHARTS = ["latency", "throughput", "hbm", "hits", "misses", "tiers", "preinfer", "instance_p99"];
  const REASONS = RelayGR.refusalReasons();
  const REFUSAL_COLORS = ["#94a3b8", "#d97706", "#db2777", "#7c3aed", "#475569", "#dc2626"];
  const CACHED_COLOR = "#0891b2";
  const PAGE_SIZE = 25;
  const controls = part("worst-controls");
  const pool_series = new Charts.SeriesWindow();
  let worst = new Map(); // instance → its series, merged across polls like the pool's
  let drawn = false;
  let table = { sort: "-p99_ms", offset: 0 };

  const { line } = Charts;

  const instanceUrl = (name) => `/pools/${encodeURIComponent(pool)}/instances/${encodeURIComponent(name)}/?window=${windowName}`;
  const pressure = (used, budget) => used.map((u, i) => (u === null || !budget[i] ? null : (100 * u) / budget[i]));

  function drawLatency(m, x) {
    const f = m.fleet;
    Charts.draw(chart("latency"), [
      line(x, f.p99_ms, "P99 (pool)", { line: { color: "#1d4ed8", width: 2.5 } }),
      line(x, f.p50_ms, "P50 (pool)", { line: { color: "#60a5fa", width: 1.5 } }),
    ], Charts.layout(m, { yTitle: "ms", withSlo: true }));
  }

  /* Failed requests in two kinds: past their deadline (the ranking request waited longer than the
     deadline its sender gave, and was failed fast) and every other failure. */
  function drawThroughput(m, x) {
    const f = m.fleet;
    const deadline = f.rank_deadline_exceeded_per_s || [];
    const other = (f.rank_errors_per_s || []).map((v, i) => (v === null ? null : Math.max(0, v - (deadline[i] || 0))));
    Charts.draw(chart("throughput"), [
      line(x, f.rank_per_s, "ranking requests/s", { line: { color: "#334155", width: 1.5 } }),
      line(x, f.rank_within_slo_per_s, "within SLO/s", { line: { color: "#059669", width: 0 }, fill: "tozeroy",
                                                          fillcolor: "rgba(5,150,105,0.25)" }),
      line(x, deadline, "past their deadline/s (failed fast)", { line: { color: "#d97706", width: 1.5 } }),
      line(x, other, "other errors/s", { line: { color: "#dc2626", width: 1 } }),
    ], Charts.layout(m, { yTitle: "requests/s" }));
  }

  /* Occupancy as a share of the budget reads the same at 2 instances or 256: the pool's (all bytes
     over all budgets) thick, each worst instance's thin. */
  function drawHbm(m, x) {
    const traces = [line(x, pressure(m.fleet.hbm_bytes, m.fleet.hbm_budget_bytes), "pool",
                         { line: { color: "#0f172a", width: 3 } })];
    [...worst.entries()].forEach(([name, s], i) => {
      traces.push(line(x, pressure(s.hbm_bytes, s.hbm_budget_bytes), name, { line: { color: Charts.color(i), width: 1.5 } }));
    });
    const layout = Charts.layout(m, { yTitle: "% of HBM budget", ySuffix: "%" });
    layout.shapes.push({ type: "line", xref: "paper", x0: 0, x1: 1, y0: 100, y1: 100,
                         line: { color: "#dc2626", width: 1, dash: "dot" } });
    Charts.draw(chart("hbm"), traces, layout);
  }

  /* Admitted, then already cached (no work was needed: no refusal), then each refusal by reason, named
     as the server names them. */
  function drawPreinfer(m, x) {
    const f = m.fleet;
    const refused = f.preinfer_refused_per_s || {};
    const seen = (r) => (refused[r.reason] || []).some((v) => v);  // a reason with none in the window: no legend entry
    const bar = (y, name, color) => ({ type: "bar", x, y, name, marker: { color } });
    const traces = [bar(f.preinfer_admitted_per_s, "admitted", "#16a34a")];
    REASONS.forEach((r, i) => {
      if (!seen(r)) return;
      traces.push(r.refusal ? bar(refused[r.reason], `refused: ${r.label}`, REFUSAL_COLORS[i % REFUSAL_COLORS.length])
        : bar(refused[r.reason], r.label, CACHED_COLOR));
    });
    Charts.draw(chart("preinfer"), traces, Charts.layout(m, { yTitle: "signals/s", barmode: "stack" }));
  }

  function drawWorstLatency(m, x) {
    const traces = [...worst.entries()].map(([name, s], i) =>
      line(x, s.p99_ms, `${name} P99`, { line: { color: Charts.color(i), width: 1.5 } }));
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
    const counts = t.preinfer_refused || {};
    const sum = (refusal) => REASONS.filter((r) => r.refusal === refusal).reduce((a, r) => a + (counts[r.reason] || 0), 0);
    set("preinfer", `${fmt.count(t.preinfer_admitted)} / ${fmt.count(sum(true))}`);
    const notRefusals = REASONS.filter((r) => !r.refusal).map((r) => r.label).join(", ");
    part("preinfer-cached").textContent = `${fmt.count(sum(false))} ${notRefusals} (no refusal)`;
  }

  function renderWorst(m) {
    const top = m.top;
    part("reporting").textContent = `(${top.instances.length} of ${top.reporting} reporting in this window)`;
    const items = top.instances.map((t) => el("li", { dataset: { instance: t.instance } },
      el("a", { href: instanceUrl(t.instance) }, t.instance), " ",
      el("span", { class: "muted" }, t.value === null ? "no data" : (top.by === "hbm" ? `${fmt.pct(t.value)} of HBM budget` : `P99 ${fmt.ms(t.value)}`))));
    if (!items.length) items.push(el("li", { class: "muted" }, "No instance reported in this window."));
    part("worst-list").replaceChildren(...items);
    part("worst-list").dataset.by = top.by;
  }

  function renderTable(page, m) {
    const rows = page.results.map((r) => {
      const p99Bad = r.p99_ms !== null && m.slo_ms !== null && r.p99_ms > m.slo_ms;
      return el("tr", { dataset: { instance: r.instance } },
        el("td", {}, el("a", { href: instanceUrl(r.instance) }, r.instance)),
        el("td", { class: "num" }, fmt.count(r.rank_requests)),
        el("td", { class: "num" }, fmt.ms(r.p50_ms)),
        el("td", { class: `num ${p99Bad ? "bad" : ""}` }, fmt.ms(r.p99_ms)),
        el("td", { class: "num" }, fmt.pct(r.slo_compliance_ratio, 2)),
        el("td", { class: "num" }, fmt.pct(r.hbm_hit_ratio)),
        el("td", { class: "num" }, fmt.pct(r.miss_ratio)),
        el("td", { class: "num" }, fmt.count(r.preinfer_admitted)),
        el("td", { class: "num" }, `${fmt.bytes(r.hbm_bytes)} / ${fmt.bytes(r.hbm_budget_bytes)}`),
        el("td", { class: "num" }, r.applied_generation ?? "–"));
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 10, class: "muted" }, "No instance reported telemetry in this window.")));
    part("instances").querySelector("tbody").replaceChildren(...rows);
    part("instances").querySelectorAll("th[data-sort]").forEach((th) => {
      const key = th.dataset.sort;
      th.dataset.sorted = table.sort === key ? "asc" : (table.sort === `-${key}` ? "desc" : "");
    });
    const last = Math.min(page.count, page.offset + page.results.length);
    part("page").textContent = page.count ? `${page.offset + 1}–${last} of ${page.count}` : "";
    part("prev").disabled = page.offset === 0;
    part("next").disabled = last >= page.count;
  }

  function render(m, page) {
    m.data_start = Charts.dataStart(m, m.fleet.instances);
    const x = Charts.times(m);
    const empty = (m.fleet.totals.rank_requests || 0) === 0 && !m.fleet.instances.some((v) => v);
    part("empty").hidden = !empty;
    drawLatency(m, x);
    drawThroughput(m, x);
    drawHbm(m, x);
    Charts.lookups(chart("hits"), m, x, m.fleet);
    Charts.misses(chart("misses"), m, x, m.fleet);
    part("miss-breakdown").textContent = Charts.missBreakdown(m.fleet.totals);
    Charts.tierOccupancy(chart("tiers"), m, x, m.fleet, part("tier-occupancy"));
    drawPreinfer(m, x);
    drawWorstLatency(m, x);
    for (const name of CHARTS) Charts.overlay(chart(name), empty ? "No data in this window yet." : null, "empty");
    renderTiles(m, Charts.summary(m));
    renderWorst(m);
    renderTable(page, m);
    root.dataset.updatedAt = String(Date.now());
    drawn = true;
  }

  /* The worst instances' series merged like the pool's: an instance held since the last poll gets
     the new points, one new to the list its whole window. */
  function mergeWorst(answer, heldTimes) {
    const next = new Map();
    for (const t of answer.top.instances) {
      const held = worst.get(t.instance);
      next.set(t.instance, held && heldTimes ? Charts.splice(heldTimes, held, answer.start, t.from, t) : t);
    }
    worst = next;
  }

  async function load() {
    const t0 = performance.now();
    const form = new FormData(controls);
    const top = Math.max(1, Math.min(Number(controls.top.max), Number(form.get("top")) || 1));
    const known = worst.size ? `&known=${[...worst.keys()].map(encodeURIComponent).join(",")}` : "";
    const [answer, page] = await Promise.all([
      api(`${base}/metrics/?window=${windowName}&top=${top}&rank_by=${form.get("rank_by")}${pool_series.query()}${known}`),
      api(`${base}/instances/?window=${windowName}&sort=${table.sort}&limit=${PAGE_SIZE}&offset=${table.offset}`),
    ]);
    const t1 = performance.now();
    const heldTimes = pool_series.m && pool_series.m.window === answer.window ? pool_series.m.timestamps : null;
    mergeWorst(answer, heldTimes);
    render(pool_series.merge(answer, ["fleet"]), page);
    // How long the last refresh took, fetching and drawing (read by the browser tests).
    root.dataset.fetchMs = (t1 - t0).toFixed(0);
    root.dataset.renderMs = (performance.now() - t1).toFixed(0);
  }

  function onError(err, { fatal, retryInMs }) {
    const text = fatal
      ? `${err.message} Reload the page to log in again.`
      : `${err.status === 0 ? "Reconnecting to the server" : err.message} — retrying in ${Math.round(retryInMs / 1000)} s${drawn ? "; the last figures stay shown." : "."}`;
    for (const name of CHARTS) Charts.overlay(chart(name), text, "error");
  }

  const poller = new Poller(load, { intervalMs: 1000, onError });
  const restart = () => {
    pool_series.reset();
    worst = new Map();
    drawn = false;
    for (const c of CHARTS) Charts.overlay(chart(c), "Loading…", "loading");
    poller.start();
  };
  RelayGR.windowPicker((name) => {
    windowName = name;
    restart();
  });
  controls.addEventListener("change", () => { worst = new Map(); poller.start(); });
  controls.addEventListener("submit", (event) => event.preventDefault());
  part("instances").querySelectorAll("th[data-sort]").forEach((th) => th.addEventListener("click", () => {
    const key = th.dataset.sort;
    // A second click on a column reverses it; a first click sorts a figure largest first, names A to Z.
    let sort = key === "instance" ? key : `-${key}`;
    if (table.sort === `-${key}`) sort = key;
    else if (table.sort === key) sort = `-${key}`;
    table = { sort, offset: 0 };
    poller.start();
  }));
  part("prev").addEventListener("click", () => { table.offset = Math.max(0, table.offset - PAGE_SIZE); poller.start(); });
  part("next").addEventListener("click", () => { table.offset += PAGE_SIZE; poller.start(); });
  poller.start();
})();
