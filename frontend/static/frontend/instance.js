/* One instance's page: its own series (polled incrementally) and its status record. */
"use strict";

(() => {
  const { api, Poller, fmt } = RelayGR;
  const root = document.getElementById("instance");
  const { pool, instance } = root.dataset;
  const base = `/api/v1/pools/${encodeURIComponent(pool)}/instances/${encodeURIComponent(instance)}`;
  let windowName = root.dataset.window;
  const CHARTS = ["latency", "throughput", "memory", "hits", "misses"];
  const chart = (name) => root.querySelector(`[data-chart="${name}"]`);
  const held = new Charts.SeriesWindow();
  const MiB = 1 / (1024 * 1024);
  const { line } = Charts;

  function draw(m) {
    m.data_start = Charts.dataStart(m, m.series.hbm_budget_bytes);
    const x = Charts.times(m);
    const s = m.series;
    Charts.draw(chart("latency"), [
      line(x, s.p99_ms, "P99", { line: { color: "#1d4ed8", width: 2.5 } }),
      line(x, s.p50_ms, "P50", { line: { color: "#60a5fa", width: 1.5 } }),
    ], Charts.layout(m, { yTitle: "ms", withSlo: true }));
    Charts.draw(chart("throughput"), [
      line(x, s.rank_per_s, "ranking requests/s", { line: { color: "#334155", width: 1.5 } }),
      line(x, s.rank_within_slo_per_s, "within SLO/s", { line: { color: "#059669", width: 0 }, fill: "tozeroy",
                                                          fillcolor: "rgba(5,150,105,0.25)" }),
    ], Charts.layout(m, { yTitle: "requests/s" }));
    // Every tier this instance ran in the window: bytes used (solid) and its budget (dashed), one colour each.
    Charts.draw(chart("memory"), Charts.tiersIn(s).flatMap((t, i) => [
      line(x, Charts.scale(t.used, MiB), `${t.tier} used`, { line: { color: Charts.color(i), width: 2 } }),
      line(x, Charts.scale(t.budget, MiB), `${t.tier} budget`, { line: { color: Charts.color(i), width: 1, dash: "dash" } }),
    ]), Charts.layout(m, { yTitle: "MiB" }));
    Charts.lookups(chart("hits"), m, x, s);
    Charts.misses(chart("misses"), m, x, s);
    root.querySelector('[data-role="miss-breakdown"]').textContent = Charts.missBreakdown(m.totals);
    const empty = !m.totals.rank_requests && !s.hbm_bytes.some((v) => v !== null);
    for (const name of CHARTS) Charts.overlay(chart(name), empty ? "No telemetry from this instance in this window." : null, "empty");
  }

  function show(status, m) {
    const set = (name, text, state) => {
      const dd = root.querySelector(`[data-figure="${name}"]`);
      dd.textContent = text;
      if (state) dd.dataset.state = state; else delete dd.dataset.state;
    };
    if (status) {
      set("live", status.live ? "live" : "gone", status.live ? "good" : "bad");
      set("config", status.config_state, status.config_state === "ACK" ? "good" : (status.config_state === "NACK" ? "bad" : null));
      set("generation", String(status.applied_generation || "–"), status.up_to_date ? "good" : "bad");
      set("heartbeat", fmt.age(status.heartbeat_age_s));
      set("device", status.device || "–");
      const capture = status.config_state === "UNKNOWN" ? "–" : (status.capture_off ? `off: ${status.capture_off}` : "on");
      set("capture", capture, status.capture_off ? "bad" : null);
      root.querySelector('[data-role="error"]').textContent = status.error || "";
    }
    const t = m.totals;
    set("p99", `${fmt.ms(t.p99_ms)} / ${fmt.count(t.rank_requests)}`,
        t.p99_ms === null ? null : (t.p99_ms > m.slo_ms ? "bad" : "good"));
  }

  async function load() {
    const [status, answer] = await Promise.all([
      api(`${base}/`).catch((err) => { if (err.status === 404) return null; throw err; }),
      api(`${base}/metrics/?window=${windowName}${held.query()}`),
    ]);
    const m = held.merge(answer, ["series"]);
    draw(m);
    show(status, m);
    root.dataset.updatedAt = String(Date.now());
  }

  const poller = new Poller(load, {
    intervalMs: 1000,
    onError(err, { fatal, retryInMs }) {
      const text = fatal ? err.message : `${err.status === 0 ? "Reconnecting to the server" : err.message} — retrying in ${Math.round(retryInMs / 1000)} s.`;
      for (const name of CHARTS) Charts.overlay(chart(name), text, "error");
    },
  });
  RelayGR.windowPicker((name) => {
    windowName = name;
    held.reset();
    poller.start();
  });
  poller.start();
})();
