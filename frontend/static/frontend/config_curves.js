/* Config editor, cache curves: beside the HBM budget, DRAM budget and entry TTL fields, the hit ratio the
   pool's captured traffic predicts along that axis (GET …/cache-curves/, fetched once when the fields are
   first shown), the live value and the form's value marked, and a sentence. The form's value is
   interpolated here, never refetched per keystroke. Viewers see it too; it changes nothing. */
"use strict";

(() => {
  const { api } = RelayGR;
  const { base } = RelayGR.editor;
  const AXES = [
    { path: "cache.hbm_budget_mb", axis: "hbm", x: "budget_mb", unit: "MiB", what: "per instance" },
    { path: "cache.dram_budget_mb", axis: "dram", x: "budget_mb", unit: "MiB", what: "of DRAM" },
    { path: "cache.entry_ttl_ms", axis: "entry_ttl", x: "ttl_ms", unit: "ms", what: "entry TTL" },
  ];
  const pct = (ratio) => `${Math.round(ratio * 100)} %`;

  /* The hit ratio at x, linear between the two points around it (clamped at the ends). */
  function interpolate(points, key, x) {
    if (!points.length || !Number.isFinite(x)) return null;
    if (x <= points[0][key]) return points[0].hit_ratio;
    for (let i = 1; i < points.length; i++) {
      const [a, b] = [points[i - 1], points[i]];
      if (x <= b[key]) return a.hit_ratio + (b.hit_ratio - a.hit_ratio) * (x - a[key]) / (b[key] - a[key] || 1);
    }
    return points[points.length - 1].hit_ratio;
  }

  function panelFor(spec) {
    const field = document.querySelector(`[data-field="${spec.path}"]`);
    if (!field) return null;
    const panel = document.createElement("div");
    panel.className = "cache-curve small";
    panel.dataset.role = `curve-${spec.axis}`;
    const chart = document.createElement("div");
    chart.className = "cache-curve-chart";
    const sentence = document.createElement("p");
    sentence.className = "muted small";
    sentence.dataset.role = "curve-sentence";
    panel.append(chart, sentence);
    field.append(panel);
    return { field, panel, chart, sentence };
  }

  function formValue(path) {
    const input = document.getElementById(`f-${path}`);
    const text = input ? (input.value ?? input.textContent) : "";
    return text === "" ? NaN : Number(text);
  }

  function draw(spec, view, body) {
    const points = body.axes[spec.axis] || [];
    const live = spec.axis === "hbm" ? body.live.hbm_budget_mb
      : spec.axis === "entry_ttl" ? body.live.entry_ttl_ms : body.live.lower[spec.axis]?.budget_mb;
    const liveRatio = interpolate(points, spec.x, live);
    const render = () => {
      const proposed = formValue(spec.path);
      const ratio = interpolate(points, spec.x, proposed);
      const sampled = body.sampling_rate < 1
        ? ` (sampled: the ${body.entries_whole} most requested entries whole, the rest at ${body.sampling_rate})` : "";
      view.sentence.textContent = ratio === null ? "No prediction for this value."
        : `${proposed} ${spec.unit} ${spec.what}: about ${pct(ratio)} hits (now ${pct(liveRatio)} at ${live} ${spec.unit}; `
          + `measured ${pct(body.measured_hit_ratio)} over the last ${body.window}${sampled}).`;
      if (typeof Plotly === "undefined") return;
      const traces = [
        { x: points.map((p) => p[spec.x]), y: points.map((p) => p.hit_ratio), mode: "lines", name: "predicted" },
        { x: [live], y: [liveRatio], mode: "markers", name: "live" },
      ];
      if (ratio !== null) traces.push({ x: [proposed], y: [ratio], mode: "markers", name: "proposed" });
      Plotly.react(view.chart, traces, {
        height: 140, margin: { l: 36, r: 8, t: 4, b: 28 }, showlegend: false,
        xaxis: { type: "log", title: { text: spec.unit } }, yaxis: { range: [0, 1], tickformat: ".0%" },
      }, { displayModeBar: false, responsive: true });
    };
    render();
    document.getElementById(`f-${spec.path}`)?.addEventListener("input", render);
  }

  async function load(views) {
    let body;
    try {
      body = await api(`${base}/cache-curves/?window=15m`);
    } catch (error) {
      const text = error.status === 409 ? `No cache curve: ${error.message}` : `No cache curve: ${error.message || error}`;
      views.forEach(([, view]) => { view.sentence.textContent = text; });
      return;
    }
    views.forEach(([spec, view]) => draw(spec, view, body));
  }

  const views = AXES.map((spec) => [spec, panelFor(spec)]).filter(([, view]) => view);
  if (!views.length) return;
  const start = () => load(views);
  if ("IntersectionObserver" in window) {
    const seen = new IntersectionObserver((entries) => {
      if (entries.some((e) => e.isIntersecting)) { seen.disconnect(); start(); }
    });
    seen.observe(views[0][1].field);
  } else {
    start();
  }
})();
