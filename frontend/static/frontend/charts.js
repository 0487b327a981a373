/* Figures from the metrics endpoint (GET /api/v1/pools/<pool>/metrics/?window=): time axis, publish
   annotations on every time chart, the SLO line, loading/empty/error overlays, and the SLO summary
   the overview and the live view both show. */
"use strict";

const Charts = (() => {
  const COLORS = ["#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d", "#dc2626"];
  const SLO_COLOR = "#dc2626";
  const PLOT_CONFIG = {
    displaylogo: false, responsive: true,
    modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d", "toggleSpikelines"],
  };

  const color = (i) => COLORS[i % COLORS.length];
  const line = (x, y, name, extra = {}) => ({ type: "scatter", mode: "lines", x, y, name, connectgaps: false, ...extra });

  /* Cache lookups as stacked shares: HBM hit, DRAM hit, joined a reload, miss (s: the pool's series
     or one instance's). */
  function lookups(container, m, x, s) {
    const area = (y, name, c) => line(x, scale(y, 100), name, { stackgroup: "lookups", line: { color: c, width: 0.5 } });
    draw(container, [
      area(s.hbm_hit_ratio, "HBM hit", "#059669"),
      area(s.dram_hit_ratio, "DRAM hit", "#2563eb"),
      area(s.inflight_join_ratio, "joined a reload in flight", "#a855f7"),
      area(s.miss_ratio, "miss (recompute)", "#dc2626"),
    ], layout(m, { yTitle: "% of lookups", ySuffix: "%", yRange: [0, 100] }));
  }
  const times = (m) => m.timestamps.map((t) => new Date(t * 1000));
  const scale = (values, factor) => values.map((v) => (v === null ? null : v * factor));

  /* Every publish (and rollback, which publishes) in the window: a dashed vertical line and a label. */
  function publishMarks(m) {
    const shapes = [];
    const labels = [];
    for (const a of m.annotations || []) {
      const x = new Date(a.ts * 1000);
      const rollback = a.kind === "rollback";
      shapes.push({
        type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1,
        line: { color: rollback ? "#b45309" : "#475569", width: 1.5, dash: "dash" },
      });
      labels.push({
        x, xref: "x", y: 1, yref: "paper", yanchor: "bottom", showarrow: false,
        text: `${rollback ? "rollback " : ""}gen ${a.generation}`,
        hovertext: `${rollback ? "Rollback" : "Publish"} of generation ${a.generation} by ${a.actor} at ${x.toLocaleTimeString()}`,
        font: { size: 10, color: rollback ? "#b45309" : "#334155" }, bgcolor: "rgba(255,255,255,0.85)",
      });
    }
    return { shapes, labels };
  }

  function sloLine(m) {
    if (m.slo_ms === null || m.slo_ms === undefined) return { shapes: [], labels: [] };
    return {
      shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: m.slo_ms, y1: m.slo_ms,
                 line: { color: SLO_COLOR, width: 1.5, dash: "dot" } }],
      labels: [{ xref: "paper", x: 0, xanchor: "left", y: m.slo_ms, yanchor: "bottom", showarrow: false,
                 text: `SLO ${m.slo_ms} ms`, font: { size: 10, color: SLO_COLOR } }],
    };
  }

  function layout(m, { yTitle = "", yTickformat, ySuffix, withSlo = false, barmode, height, legend = true, yRange } = {}) {
    const marks = publishMarks(m);
    const slo = withSlo ? sloLine(m) : { shapes: [], labels: [] };
    return {
      height,
      margin: { l: 56, r: 12, t: 22, b: 36 },
      font: { family: "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size: 11, color: "#1e293b" },
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#ffffff",
      xaxis: { type: "date", range: [new Date(m.start * 1000), new Date(m.end * 1000)], gridcolor: "#eef2f7",
               linecolor: "#cbd5e1" },
      yaxis: { title: { text: yTitle, standoff: 6 }, rangemode: "tozero", gridcolor: "#eef2f7", zeroline: false,
               tickformat: yTickformat, ticksuffix: ySuffix, range: yRange, automargin: true },
      showlegend: legend,
      legend: { orientation: "h", y: -0.2, x: 0, font: { size: 10 } },
      hovermode: "x unified",
      barmode,
      bargap: 0.05,
      shapes: [...marks.shapes, ...slo.shapes],
      annotations: [...marks.labels, ...slo.labels],
      uirevision: `${m.pool}-${m.window}`, // keep zoom and hidden traces across refreshes
    };
  }

  function hasValues(traces) {
    return traces.some((t) => (t.y || []).some((v) => v !== null && v !== undefined && v !== 0));
  }

  /* Draws (or updates in place) the figure inside a .chart container and marks whether it shows data. */
  function draw(container, traces, figureLayout) {
    let plot = container.querySelector(".plot");
    if (!plot) {
      plot = document.createElement("div");
      plot.className = "plot";
      container.prepend(plot);
    }
    Plotly.react(plot, traces, figureLayout, PLOT_CONFIG);
    container.dataset.hasData = String(hasValues(traces));
    container.dataset.annotations = String(figureLayout.annotations.filter((a) => /gen \d+/.test(a.text)).length);
  }

  /* Overlay text on a chart: null hides it; kind is "loading", "empty" or "error". */
  function overlay(container, text, kind = "loading") {
    let state = container.querySelector(".chart-state");
    if (!state) {
      state = document.createElement("div");
      state.className = "chart-state";
      container.append(state);
    }
    state.hidden = !text;
    state.textContent = text || "";
    state.dataset.kind = kind;
    container.dataset.state = text ? kind : "ready";
  }

  const lastOf = (values) => {
    for (let i = values.length - 1; i >= 0; i -= 1) if (values[i] !== null && values[i] !== undefined) return values[i];
    return null;
  };

  /* The SLO figures of a window: P50/P99 from merged buckets (the server's totals), share within
     the SLO, SLO-compliant throughput over the part of the window that has traffic, error-budget burn
     and a health verdict. */
  function summary(m) {
    const totals = m.fleet.totals || {};
    const hasData = (totals.rank_requests || 0) > 0;
    const rates = m.fleet.rank_per_s || [];
    const first = rates.findIndex((v) => v !== null && v > 0);
    const now = Math.min(Date.now() / 1000, m.end);
    const activeS = first >= 0 ? Math.max(m.step_s, now - m.timestamps[first]) : null;
    const within = totals.slo_compliance_ratio;
    const target = m.slo_target_ratio;
    let burn = null;
    if (within !== null && within !== undefined && target !== null && target !== undefined) {
      burn = target < 1 ? (1 - within) / (1 - target) : (within < 1 ? Infinity : 0);
    }
    const p99 = totals.p99_ms;
    let health = "nodata";
    if (hasData) health = (burn !== null && burn > 1) || (p99 !== null && m.slo_ms !== null && p99 > m.slo_ms) ? "atrisk" : "healthy";
    return {
      hasData, health, p99, p50: totals.p50_ms, within, target, burn,
      goodput: hasData && activeS ? totals.rank_within_slo / activeS : null,
      throughput: hasData && activeS ? totals.rank_requests / activeS : null,
    };
  }

  const HEALTH_TEXT = { healthy: "healthy", atrisk: "at risk", nodata: "no data yet" };

  /* Incremental polls. An answer holds the points from `from` on (the whole window, or from the
     `since` a poll sent); `splice` keeps the held points still in the window ([start, from)) and
     appends the answer's, in every array of `fresh` (nested objects of arrays too). */
  function splice(heldTimes, held, start, from, fresh) {
    const keep = [];
    heldTimes.forEach((t, i) => { if (t >= start && t < from) keep.push(i); });
    const join = (old, add) => {
      if (Array.isArray(add)) return Array.isArray(old) ? keep.map((i) => old[i]).concat(add) : add;
      if (add && typeof add === "object" && old && typeof old === "object" && !Array.isArray(old)) {
        const out = {};
        for (const [key, value] of Object.entries(add)) out[key] = join(old[key], value);
        return out;
      }
      return add;
    };
    return join(held, fresh);
  }

  /* A window's figures as polled incrementally: `query()` is what to ask next (`since` once
     something is held), `merge(answer, keys)` folds the answer's `keys` series in and returns the
     whole window. */
  class SeriesWindow {
    constructor() { this.m = null; }
    reset() { this.m = null; }
    query() {
      const t = this.m ? this.m.timestamps : [];
      return t.length ? `&since=${t[t.length - 1]}` : "";
    }
    merge(answer, keys) {
      const held = this.m && this.m.window === answer.window ? this.m : null;
      const merged = { ...answer };
      if (held) {
        for (const key of keys) merged[key] = splice(held.timestamps, held[key], answer.start, answer.from, answer[key]);
        merged.timestamps = splice(held.timestamps, held.timestamps, answer.start, answer.from, answer.timestamps);
      }
      this.m = merged;
      return merged;
    }
  }

  return { color, line, times, scale, layout, draw, lookups, overlay, summary, lastOf, splice, SeriesWindow, HEALTH_TEXT };
})();
