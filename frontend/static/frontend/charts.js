/* Figures from the metrics endpoint (GET /api/v1/pools/<pool>/metrics/?window=): time axis, the
   marks of the pool's history on every time chart (its creation, publishes, rollbacks, each canary's
   start and end), the SLO line, loading/empty/error overlays, and the SLO summary the overview and
   the live view both show. */
"use strict";

const Charts = (() => {
  const COLORS = ["#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d", "#dc2626"];
  const SLO_COLOR = "#dc2626";
  const FONT_FAMILY = "system-ui, -apple-system, Segoe UI, Roboto, sans-serif";
  const PLOT_CONFIG = {
    displaylogo: false, responsive: true,
    modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d", "toggleSpikelines"],
  };
  // A series with this few points also gets markers: one point alone is no line at all.
  const FEW_POINTS = 30;

  const color = (i) => COLORS[i % COLORS.length];
  const present = (v) => v !== null && v !== undefined;
  function line(x, y, name, extra = {}) {
    const few = (y || []).filter(present).length <= FEW_POINTS;
    return { type: "scatter", mode: few ? "lines+markers" : "lines", marker: { size: 4 }, x, y, name,
             connectgaps: false, ...extra };
  }

  /* Cache lookups as stacked shares, one area per outcome the server knows, in its order and with its
     labels (s: the pool's series or one instance's). */
  function lookups(container, m, x, s) {
    const shares = s.lookup_ratio || {};
    draw(container, RelayGR.outcomes().map((o, i) => line(x, scale(shares[o.outcome] || [], 100), o.label, {
      stackgroup: "lookups", line: { color: color(i), width: 0.5 } })),
    layout(m, { yTitle: "% of lookups", ySuffix: "%", yRange: [0, 100] }));
  }

  /* Misses per second by reason, stacked (s: the pool's series or one instance's), and on a second
     axis the share of lookups served without a recompute. The reasons of one family (evicted from a
     tier, not admitted for a reason) share a hue and a legend group, the tier or refusal in each one's
     label; a reason with no miss in the window gets no legend entry. */
  const MISS_HUES = ["220,38,38", "217,119,6", "37,99,235", "124,58,237", "8,145,178", "101,163,13", "219,39,119",
                     "71,85,105", "180,83,9", "13,148,136"];
  function misses(container, m, x, s) {
    const reasons = RelayGR.missReasons();
    const rates = s.misses_per_s || {};
    const families = [...new Set(reasons.map((r) => r.family))];
    const traces = [];
    families.forEach((family, i) => {
      const members = reasons.filter((r) => r.family === family);
      const grouped = members.length > 1;
      members.forEach((r, j) => {
        if (!(rates[r.reason] || []).some((v) => v)) return;
        const alpha = grouped ? 1 - (0.65 * j) / (members.length - 1) : 0.9;
        traces.push({ type: "bar", x, y: rates[r.reason], name: r.label, hovertemplate: "%{y:.3~f}/s",
                      marker: { color: `rgba(${MISS_HUES[i % MISS_HUES.length]},${alpha.toFixed(2)})` },
                      ...(grouped ? { legendgroup: family, legendgrouptitle: { text: `${r.family_label}:` } } : {}) });
      });
    });
    traces.push(line(x, scale(s.hit_ratio || [], 100), "hit ratio (no recompute)", {
      yaxis: "y2", hovertemplate: "%{y:.1f}%", line: { color: "#0f172a", width: 2 } }));
    container.dataset.reasons = String(traces.length - 1);
    draw(container, traces, layout(m, { yTitle: "misses/s", barmode: "stack",
                                        y2: { title: "hit ratio", suffix: "%", range: [0, 100], dtick: 25 } }));
  }

  /* A window's misses in one sentence, the most frequent reason first: "412 misses: 61% evicted from
     HBM, 22% first visit, …"; misses counted under no reason (published before miss reasons were) said apart. */
  function missBreakdown(totals) {
    const total = totals.misses || 0;
    if (!total) return "No misses in this window.";
    const counts = totals.misses_by_reason || {};
    const reasons = RelayGR.missReasons().filter((r) => counts[r.reason] > 0)
      .sort((a, b) => counts[b.reason] - counts[a.reason]);
    const parts = reasons.map((r) => `${RelayGR.fmt.pct(counts[r.reason] / total, 0)} ${r.label}`);
    const unattributed = total - reasons.reduce((sum, r) => sum + counts[r.reason], 0);
    if (unattributed > 0) parts.push(`${RelayGR.fmt.count(unattributed)} under no reason (published before reasons were)`);
    return `${RelayGR.fmt.count(total)} miss${total === 1 ? "" : "es"}: ${parts.join(", ")}.`;
  }

  /* The cache tiers that had a budget in the window (s: the pool's series or one instance's), each with
     its level series: [{tier, used, budget}] in lookup order. A tier no instance ran is left out. */
  function tiersIn(s) {
    return RelayGR.cacheTiers().map((t) => ({ tier: t.tier, used: s[t.bytes] || [], budget: s[t.budget_bytes] || [] }))
      .filter((t) => t.budget.some((v) => v));
  }

  /* Each tier's occupancy as a share of its budget, one line per tier; `list` (optional) gets, for each
     tier with a budget now, its newest bytes used and budget as text. */
  function tierOccupancy(container, m, x, s, list) {
    const tiers = tiersIn(s);
    const share = (t) => t.used.map((u, i) => (u === null || !t.budget[i] ? null : (100 * u) / t.budget[i]));
    draw(container, tiers.map((t, i) => line(x, share(t), t.tier, { line: { color: color(i), width: 2 } })),
         layout(m, { yTitle: "% of the tier's budget", ySuffix: "%" }));
    if (!list) return;
    list.replaceChildren(...tiers.filter((t) => lastOf(t.budget)).map((t) => {
      const used = lastOf(t.used);
      const budget = lastOf(t.budget);
      return RelayGR.el("li", { dataset: { tier: t.tier } }, RelayGR.el("strong", {}, t.tier), " ",
        `${RelayGR.fmt.bytes(used)} of ${RelayGR.fmt.bytes(budget)}`,
        RelayGR.el("span", { class: "muted" }, budget ? ` (${RelayGR.fmt.pct(used / budget)})` : ""));
    }));
  }
  const times = (m) => m.timestamps.map((t) => new Date(t * 1000));
  const scale = (values, factor) => values.map((v) => (v === null ? null : v * factor));

  /* When the first point of `values` that holds data starts (unix s), or null: a young pool's charts
     begin there instead of at the window's start (``xRange``). */
  function dataStart(m, values) {
    const i = (values || []).findIndex((v) => present(v) && v !== 0);
    return i < 0 ? null : m.timestamps[i];
  }

  /* The x range: the window, or from the pool's first data (or an earlier mark in the window) when the
     pool is younger than the window, so its first minutes fill the chart instead of its right edge. */
  function xRange(m) {
    const first = m.data_start;
    if (!present(first)) return [m.start, m.end];
    const marks = (m.annotations || []).map((a) => a.ts).filter((t) => t >= m.start && t <= m.end);
    const from = Math.min(first, ...marks);
    return [Math.max(m.start, Math.min(from - m.step_s, m.end - 3 * m.step_s)), m.end];
  }

  // The marks' colours by kind: publishes slate, a rollback amber, a canary violet, its end by outcome.
  const MARK_STYLE = {
    created: { color: "#475569", dash: "dash" }, publish: { color: "#475569", dash: "dash" },
    rollback: { color: "#b45309", dash: "dash" }, canary: { color: "#7c3aed", dash: "dot" },
    promoted: { color: "#047857", dash: "dot" }, rolled_back: { color: "#b91c1c", dash: "dot" },
    aborted: { color: "#b91c1c", dash: "dot" },
  };
  const LABEL_FONT_PX = 10;
  const LABEL_PAD_PX = 6; // the label box's border and padding, both sides
  const LABEL_GAP_PX = 4;
  const ROW_PX = 15;
  const MAX_ROWS = 3;
  const MERGED_WIDEST = "99 changes";

  let measure = null;
  function textWidth(text) {
    if (!measure) measure = document.createElement("canvas").getContext("2d");
    measure.font = `${LABEL_FONT_PX}px ${FONT_FAMILY}`;
    return measure.measureText(text).width;
  }

  const escapeText = (text) => String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  function hoverText(marks) {
    return marks.map((a) => `${escapeText(a.detail || a.label)} (${new Date(a.ts * 1000).toLocaleTimeString()})`).join("<br>");
  }

  /* The marks' labels on a plot `widthPx` wide showing `range` (ms): each above its line, inside the
     chart (anchored left or right at the edges), in the lowest of MAX_ROWS rows where it overlaps no
     other; one with no free row joins the label to its left, which then reads "N changes" (its hover
     text lists them all). Every label reserves the width of the widest merged text, so a merge never
     makes it overlap. Returns the annotations and the top margin they need. */
  function placeLabels(marks, widthPx, range) {
    const [x0, x1] = range;
    const rowEnds = Array(MAX_ROWS).fill(-Infinity);
    const placed = [];
    for (const mark of marks) {
      const t = mark.ts * 1000;
      if (t < x0 || t > x1) continue;
      const at = ((t - x0) / (x1 - x0)) * widthPx;
      const width = Math.max(textWidth(mark.label), textWidth(MERGED_WIDEST)) + LABEL_PAD_PX;
      let anchor = "center";
      let left = at - width / 2;
      if (left < 0) { anchor = "left"; left = at; }
      if (left + width > widthPx) { anchor = "right"; left = at - width; }
      const row = rowEnds.findIndex((end) => end + LABEL_GAP_PX <= left);
      if (row >= 0) {
        rowEnds[row] = left + width;
        placed.push({ marks: [mark], row, anchor, x: new Date(t) });
      } else if (placed.length) {
        placed[placed.length - 1].marks.push(mark);
      }
    }
    const rows = placed.reduce((most, p) => Math.max(most, p.row + 1), 1);
    const annotations = placed.map((p) => {
      const [first] = p.marks;
      const style = MARK_STYLE[first.kind] || MARK_STYLE.publish;
      return {
        x: p.x, xref: "x", y: 1, yref: "paper", yanchor: "bottom", xanchor: p.anchor, yshift: p.row * ROW_PX,
        showarrow: false, text: p.marks.length > 1 ? `${p.marks.length} changes` : first.label,
        hovertext: hoverText(p.marks),
        font: { size: LABEL_FONT_PX, color: p.marks.length > 1 ? "#334155" : style.color },
        bgcolor: "rgba(255,255,255,0.9)", borderpad: 1,
      };
    });
    return { annotations, marginTop: 8 + rows * ROW_PX };
  }

  /* Every mark in the window: a vertical line in its kind's style (its label comes from placeLabels,
     once the plot's width is known). */
  function markLines(m) {
    return (m.annotations || []).map((a) => {
      const style = MARK_STYLE[a.kind] || MARK_STYLE.publish;
      const x = new Date(a.ts * 1000);
      return { type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1,
               line: { color: style.color, width: 1.5, dash: style.dash } };
    });
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

  // Date ticks on one line, never rotated (rotated ones ran into the legend): the format by tick spacing.
  const TICK_FORMATS = [
    { dtickrange: [null, 60000], value: "%H:%M:%S" },
    { dtickrange: [60000, 86400000], value: "%H:%M" },
    { dtickrange: [86400000, null], value: "%b %d" },
  ];

  /* A chart's layout; `y2` ({title, suffix, range, dtick}) adds a second y axis on the right, for traces with
     `yaxis: "y2"`. */
  function layout(m, { yTitle = "", yTickformat, ySuffix, withSlo = false, barmode, height, legend = true, yRange,
                       y2 } = {}) {
    const slo = withSlo ? sloLine(m) : { shapes: [], labels: [] };
    const [from, to] = xRange(m);
    return {
      height,
      margin: { l: 56, r: y2 ? 56 : 12, t: 8 + ROW_PX, b: 36 },
      font: { family: FONT_FAMILY, size: 11, color: "#1e293b" },
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#ffffff",
      xaxis: { type: "date", range: [new Date(from * 1000), new Date(to * 1000)], gridcolor: "#eef2f7",
               linecolor: "#cbd5e1", tickangle: 0, nticks: 7, tickformatstops: TICK_FORMATS, automargin: true },
      yaxis: { title: { text: yTitle, standoff: 6 }, rangemode: "tozero", gridcolor: "#eef2f7", zeroline: false,
               tickformat: yTickformat, ticksuffix: ySuffix, range: yRange, automargin: true },
      // Only when asked: Plotly reads every yaxis<N> key, an undefined one too.
      ...(y2 ? { yaxis2: { title: { text: y2.title, standoff: 6 }, overlaying: "y", side: "right", range: y2.range,
                           tickmode: y2.dtick ? "linear" : undefined, tick0: 0, dtick: y2.dtick, ticksuffix: y2.suffix, showgrid: false, zeroline: false, automargin: true } } : {}),
      showlegend: legend,
      // Below the tick labels, at the figure's foot: a legend placed on the plot's own scale ran into them.
      legend: { orientation: "h", x: 0, yref: "container", y: 0, yanchor: "bottom", font: { size: 10 } },
      hovermode: "x unified",
      barmode,
      bargap: 0.05,
      shapes: [...markLines(m), ...slo.shapes],
      annotations: slo.labels,
      meta: { marks: (m.annotations || []).slice().sort((a, b) => a.ts - b.ts) },
      uirevision: `${m.pool}-${m.window}`, // keep zoom and hidden traces across refreshes
    };
  }

  function hasValues(traces) {
    return traces.some((t) => (t.y || []).some((v) => v !== null && v !== undefined && v !== 0));
  }

  const marksOf = (figureLayout) => (figureLayout.meta && figureLayout.meta.marks) || [];

  /* The layout with the marks' labels placed for a plot `widthPx` wide showing `range` (ms). */
  function withLabels(figureLayout, widthPx, range) {
    const marks = marksOf(figureLayout);
    if (!marks.length) return figureLayout;
    const labels = placeLabels(marks, widthPx, range);
    return { ...figureLayout, annotations: [...(figureLayout.annotations || []), ...labels.annotations],
             margin: { ...figureLayout.margin, t: Math.max(figureLayout.margin.t, labels.marginTop) } };
  }

  const rangeMs = (range) => range.map((v) => new Date(v).getTime());

  /* Draws (or updates in place) the figure inside a .chart container and marks whether it shows data.
     The marks' labels are placed for the plot's width and x range as drawn: when either differs from
     what they were placed for (the first draw's guess of the width, the user's zoom), they are placed
     again and the figure drawn once more. */
  function draw(container, traces, figureLayout) {
    let plot = container.querySelector(".plot");
    if (!plot) {
      plot = document.createElement("div");
      plot.className = "plot";
      container.prepend(plot);
    }
    const before = plot._fullLayout && plot._fullLayout._size;
    let widthPx = before ? before.w : container.clientWidth - figureLayout.margin.l - figureLayout.margin.r;
    let range = figureLayout.xaxis && figureLayout.xaxis.range ? rangeMs(figureLayout.xaxis.range) : null;
    Plotly.react(plot, traces, range ? withLabels(figureLayout, widthPx, range) : figureLayout, PLOT_CONFIG);
    const drawn = plot._fullLayout;
    if (range && marksOf(figureLayout).length && drawn && drawn._size && drawn.xaxis.range) {
      const drawnRange = rangeMs(drawn.xaxis.range);
      const off = Math.abs(drawn._size.w - widthPx) > 0.5
        || drawnRange.some((v, i) => Math.abs(v - range[i]) > 1e-4 * (range[1] - range[0]));
      if (off) {
        widthPx = drawn._size.w;
        range = drawnRange;
        Plotly.react(plot, traces, withLabels(figureLayout, widthPx, range), PLOT_CONFIG);
      }
    }
    container.dataset.hasData = String(hasValues(traces));
    container.dataset.annotations = String(marksOf(figureLayout).length);
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

  return { color, line, times, scale, dataStart, layout, draw, lookups, misses, missBreakdown, tiersIn, tierOccupancy, overlay, summary, lastOf, splice, SeriesWindow,
           HEALTH_TEXT };
})();
