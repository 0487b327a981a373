/* Config editor, cache curves: beside the HBM budget, DRAM budget and entry TTL fields, the hit ratio the
   pool's captured traffic predicts along that axis (GET …/cache-curves/, fetched once when the fields are
   first shown), the live value and the form's value marked, and a sentence. The form's value is
   interpolated here, never refetched per keystroke; outside the computed points the sentence says so
   rather than extrapolate. Viewers see it too; it changes nothing. */
"use strict";

(() => {
  const { api, fmt } = RelayGR;
  const { base, root } = RelayGR.editor;
  const number = (v) => Number(v).toLocaleString("en-US", { maximumFractionDigits: 3 });
  const AXES = [
    { path: "cache.hbm_budget_mb", axis: "hbm", key: "budget_mb", unit: "MiB", title: "HBM budget per instance (MiB)",
      live: (live) => live.hbm_budget_mb, says: (v) => `${number(v)} MiB per instance` },
    { path: "cache.dram_budget_mb", axis: "dram", key: "budget_mb", unit: "MiB", title: "DRAM budget per instance (MiB)",
      live: (live) => live.lower.dram?.budget_mb, says: (v) => `${number(v)} MiB of DRAM per instance` },
    { path: "cache.entry_ttl_ms", axis: "entry_ttl", key: "ttl_ms", unit: "ms", title: "HBM entry TTL (ms)",
      live: (live) => live.entry_ttl_ms, says: (v) => `An HBM entry TTL of ${number(v)} ms` },
  ];
  const LIVE_MARKER = { color: "#0f172a", size: 8, symbol: "circle" };
  // Hollow and larger, so the live dot still shows inside it when the form holds the live value.
  const PROPOSED_MARKER = { color: "#d97706", size: 13, symbol: "diamond-open", line: { width: 2.5 } };
  const windowWords = (label) => label.replace(/^(\d+)m$/, "$1 min").replace(/^(\d+)h$/, "$1 h").replace(/^(\d+)s$/, "$1 s");

  /* The hit ratio at x on the curve as drawn: between two points, linear in log x (the axis is
     logarithmic; from 0, linear); null outside the computed points. */
  function interpolate(points, key, x) {
    if (!points.length || !Number.isFinite(x) || x < points[0][key] || x > points[points.length - 1][key]) return null;
    for (let i = 1; i < points.length; i++) {
      const [a, b] = [points[i - 1], points[i]];
      if (x > b[key]) continue;
      const at = a[key] > 0 ? Math.log(x / a[key]) / Math.log(b[key] / a[key]) : (x - a[key]) / (b[key] - a[key]);
      return a.hit_ratio + (b.hit_ratio - a.hit_ratio) * at;
    }
    return points[0].hit_ratio; // one point, x on it
  }

  function panelFor(spec) {
    const field = root.querySelector(`[data-field="${spec.path}"]`);
    if (!field) return null;
    const chart = RelayGR.el("div", { class: "chart cache-curve-chart" });
    const sentence = RelayGR.el("p", { class: "muted small", dataset: { role: "curve-sentence" } });
    const panel = RelayGR.el("div", { class: "cache-curve small", dataset: { role: `curve-${spec.axis}` } }, chart, sentence);
    field.append(panel);
    return { field, panel, chart, sentence };
  }

  function formValue(path) {
    const input = document.getElementById(`f-${path}`);
    const text = input ? (input.tagName === "OUTPUT" ? input.textContent : input.value).trim() : "";
    return text === "" ? NaN : Number(text);
  }

  /* "512 MiB per instance: about 81% hits (now 73% at 256 MiB)." and what the instances measured. */
  function sentence(spec, body, points, live, proposed) {
    const sampled = body.sampling_rate < 1
      ? ` (curves from a sample: the ${fmt.count(body.entries_whole)} most requested entries whole, the others at `
        + `${fmt.pct(body.sampling_rate, 1)})` : "";
    const measured = ` Measured over the last ${windowWords(body.window)}: ${fmt.pct(body.measured_hit_ratio, 0)}${sampled}.`;
    const now = `now ${fmt.pct(body.live.hit_ratio, 0)} at ${number(live)} ${spec.unit}`;
    if (!Number.isFinite(proposed)) return `Enter a number to see its predicted hit ratio (${now}).${measured}`;
    const ratio = interpolate(points, spec.key, proposed);
    if (ratio === null) {
      const [first, last] = [points[0][spec.key], points[points.length - 1][spec.key]];
      const where = proposed > last ? `past the computed curve, which ends at ${number(last)} ${spec.unit}`
        : `before the computed curve, which starts at ${number(first)} ${spec.unit}`;
      return `${spec.says(proposed)} is ${where}: no prediction (${now}).${measured}`;
    }
    if (proposed === live) return `${spec.says(proposed)} (live): about ${fmt.pct(ratio, 0)} hits.${measured}`;
    return `${spec.says(proposed)}: about ${fmt.pct(ratio, 0)} hits (${now}).${measured}`;
  }

  function draw(spec, view, body) {
    const points = body.axes[spec.axis] || [];
    const live = spec.live(body.live);
    if (!points.length || live === undefined) {
      view.panel.remove(); // the live revision runs no such tier
      return;
    }
    const render = () => {
      const proposed = formValue(spec.path);
      const ratio = interpolate(points, spec.key, proposed);
      view.sentence.textContent = sentence(spec, body, points, live, proposed);
      const traces = [
        { type: "scatter", mode: "lines+markers", x: points.map((p) => p[spec.key]), y: points.map((p) => p.hit_ratio),
          name: "predicted", line: { color: Charts.color(0), width: 2 }, marker: { size: 4 },
          hovertemplate: `%{x:,} ${spec.unit}: %{y:.1%}<extra></extra>` },
        { type: "scatter", mode: "markers", x: [live], y: [body.live.hit_ratio], name: "live", marker: LIVE_MARKER,
          hovertemplate: `live %{x:,} ${spec.unit}: %{y:.1%}<extra></extra>` },
        { type: "scatter", mode: "markers", x: ratio === null ? [] : [proposed], y: ratio === null ? [] : [ratio],
          name: "proposed", marker: PROPOSED_MARKER, hovertemplate: `proposed %{x:,} ${spec.unit}: %{y:.1%}<extra></extra>` },
      ];
      Charts.draw(view.chart, traces, {
        margin: { l: 52, r: 12, t: 28, b: 40 },
        font: { size: 11, color: "#1e293b" }, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#ffffff",
        xaxis: { type: "log", title: { text: spec.title, standoff: 4 }, gridcolor: "#eef2f7", linecolor: "#cbd5e1",
                 automargin: true },
        yaxis: { title: { text: "hit ratio", standoff: 4 }, range: [0, 1.02], tickformat: ".0%", dtick: 0.25,
                 gridcolor: "#eef2f7", zeroline: false, automargin: true },
        // Above the plot, on its own row: inside it, the legend would cover the curve's top.
        showlegend: true, legend: { orientation: "h", x: 0, y: 1, yref: "container", yanchor: "top", font: { size: 10 } },
        hovermode: "closest",
      });
      view.panel.dataset.proposed = ratio === null ? "" : String(proposed);
    };
    render();
    document.getElementById(`f-${spec.path}`)?.addEventListener("input", render);
    root.querySelector('[data-role="form"]').addEventListener("relaygr:filled", render);
  }

  async function load(views) {
    let body;
    try {
      body = await api(`${base}/cache-curves/?window=15m`);
    } catch (error) {
      // Said once, beside the first field: the 409's message names the window and what the capture holds.
      const [[, first], ...rest] = views;
      first.chart.remove();
      first.sentence.textContent = error.status === 409 ? error.message
        : `The cache curves could not be loaded: ${error.message}`;
      rest.forEach(([, view]) => view.panel.remove());
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
    views.forEach(([, view]) => seen.observe(view.field));
  } else {
    start();
  }
})();
