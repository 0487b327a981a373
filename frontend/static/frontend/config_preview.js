/* Config editor, the what-if preview: the revision the form describes (created, not published, or the
   what-if an earlier preview made of the same spec) replayed by the simulator on the pool's captured
   traffic, live against proposed; and the pool's scorecard of published previews. */
"use strict";

RelayGR.editor.preview = (() => {
  const { api, fmt, el } = RelayGR;
  const editor = RelayGR.editor;
  const { state, part, base, whatIfTwin, updateButtons } = editor;
  let previewSeq = 0; // the newest preview asked for: an older one stops polling

  function sayPreview(...children) {
    part("preview-result")?.replaceChildren(...children);
  }

  /* The revision the form describes (created, not published) for the API's preview of a generation. */
  async function revisionToPreview() {
    const spec = editor.form.candidate();
    const existing = whatIfTwin((await editor.checks.checkNow(spec)).sha256);
    if (existing) return existing;
    const revision = await api(`${base}/revisions/`, { method: "POST", body: {
      parent_generation: state.latest_generation, spec, comment: part("comment").value || "what-if preview" } });
    state.latest_generation = revision.generation;
    state.latest = revision;
    return revision;
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  async function runPreview() {
    const seq = ++previewSeq;
    const window = part("preview-window").value;
    state.previewing = true;
    updateButtons();
    let preview;
    try {
      sayPreview(el("p", { class: "muted small" }, "Creating the revision to preview…"));
      const revision = await revisionToPreview();
      editor.history.load();
      const progress = (status) => sayPreview(el("p", { class: "muted small", dataset: { role: "preview-progress" } },
        `Preview of generation ${revision.generation} against live generation ${state.live.generation} on the last `
        + `${window} of captured traffic: ${status}…`));
      progress("queued");
      preview = await api(`${base}/revisions/${revision.generation}/preview/`, { method: "POST", body: { window } });
      const started = Date.now();
      while ((preview.status === "queued" || preview.status === "running") && Date.now() - started < 300000) {
        progress(preview.status);
        await sleep(1000);
        if (seq !== previewSeq) return;
        preview = await api(preview.url);
      }
    } catch (err) {
      if (seq === previewSeq) {
        sayPreview(el("p", { class: "error-box", role: "alert", dataset: { role: "preview-error" } }, `No preview: ${err.message}`));
      }
      return;
    } finally {
      if (seq === previewSeq) {
        state.previewing = false;
        updateButtons();
      }
    }
    if (preview.status === "done") renderPreview(preview);
    else if (preview.status === "failed") {
      sayPreview(el("p", { class: "error-box", role: "alert", dataset: { role: "preview-error" } }, `The preview failed: ${preview.error}`));
    } else sayPreview(el("p", { class: "error-box", role: "alert" }, `The preview is still ${preview.status} after 5 minutes; `
      + `is the control plane's Celery worker running? (${preview.url})`));
  }

  /* "worse" / "better" / "" for proposed against live: beyond 1 % (0.1 point for shares). */
  function verdict(better, live, proposed, share) {
    if (!better || live === null || live === undefined || proposed === null || proposed === undefined) return "";
    const delta = proposed - live;
    const tolerance = share ? 0.001 : Math.abs(live) * 0.01;
    if (Math.abs(delta) <= tolerance) return "";
    return (delta < 0) === (better === "lower") ? "better" : "worse";
  }

  function renderPreview(preview) {
    const r = preview.result;
    const sides = { live: r.live, proposed: r.proposed };
    const slo = r.slo_ms || {};
    const budget = r.hbm_budget_bytes || {};
    // Refusals by reason as the server names them; "already cached" apart: it is no refusal.
    const refused = (f, refusal) => RelayGR.refusalReasons().filter((reason) => reason.refusal === refusal)
      .filter((reason) => (f.preinfer_refused || {})[reason.reason])
      .map((reason) => `${reason.label} ${fmt.count(f.preinfer_refused[reason.reason])}`).join(", ") || "none";
    // Replays that each drew forward times with the pool's measured spread: the lowest to highest P99.
    const replayRange = (side) => {
      const f = side === "relay_off" ? r.relay_off : sides[side];
      return f && f.replicates > 1 && f.p99_range_ms
        ? ` · ${fmt.ms(f.p99_range_ms[0])}–${fmt.ms(f.p99_range_ms[1])} over ${f.replicates} replays` : "";
    };
    const rows = [
      { label: "P99", key: "p99_ms", better: "lower", off: true,
        show: (v, side) => `${fmt.ms(v)} (SLO ${fmt.ms(slo[side] || slo.live)})${replayRange(side)}` },
      { label: "P50", key: "p50_ms", better: "lower", off: true, show: (v) => fmt.ms(v) },
      { label: "Within SLO", key: "within_slo_share", better: "higher", share: true, off: true, show: (v) => fmt.pct(v, 2) },
      { label: "SLO throughput", key: "slo_throughput_qps", better: "higher", off: true, show: (v) => fmt.rate(v) },
      { label: "HBM peak / instance", key: "hbm_peak_bytes", better: "lower", show: (v, side) => `${fmt.bytes(v)} of ${fmt.bytes(budget[side])}` },
      { label: "Hit ratio", key: "hit_ratio", better: "higher", share: true, show: (v) => fmt.pct(v) },
      { label: "Pre-infer admitted", key: "preinfer_admitted", show: (v) => fmt.count(v) },
      { label: "Pre-infer refused", key: "preinfer_refused", show: (v, side) => refused(sides[side], true) },
      { label: "Pre-infer not needed", key: "preinfer_not_needed", show: (v, side) => refused(sides[side], false) },
    ];
    // The relay off on the same traffic (every request runs its whole history): what the relay is worth here.
    const off = r.relay_off || null;
    const table = el("table", { class: "data preview", dataset: { role: "preview-table" } },
      el("thead", {}, el("tr", {}, el("th", {}, "Figure"), el("th", {}, `Live (gen. ${preview.live_generation})`),
        el("th", {}, `Proposed (gen. ${preview.generation})`),
        off ? el("th", { title: "The same requests with no pre-inference and no cache, on the live SLO" },
          "Relay off") : "")),
      el("tbody", {}, ...rows.map((row) => {
        const judged = verdict(row.better, r.live[row.key], r.proposed[row.key], row.share);
        return el("tr", { dataset: { figure: row.key } },
          el("th", {}, row.label),
          el("td", { dataset: { side: "live" } }, row.show(r.live[row.key], "live")),
          el("td", { class: judged, dataset: { side: "proposed" } }, row.show(r.proposed[row.key], "proposed"),
            judged ? el("span", { class: "verdict" }, judged === "worse" ? "▲ worse" : "▼ better") : ""),
          off ? el("td", { class: "muted", dataset: { side: "relay-off" } },
            row.off ? row.show(off[row.key], "relay_off") : "–") : "");
      })));
    const worth = off && off.p99_ms && r.live.p99_ms
      ? el("p", { class: "small", dataset: { role: "preview-relay-worth" } },
        `Without the relay, the same requests would run their whole history each: P99 ${fmt.ms(off.p99_ms)} `
        + `instead of ${fmt.ms(r.live.p99_ms)}, ${fmt.pct(off.within_slo_share, 2)} within the SLO instead of `
        + `${fmt.pct(r.live.within_slo_share, 2)}.`)
      : null;
    const age = Date.now() / 1000 - r.window_to;
    const error = r.model_error === null || r.model_error === undefined
      ? `Simulator error: unknown on this pool (${r.model_error_note}).`
      : `Simulator error: ±${(100 * r.model_error).toFixed(0)} % on P99 (${r.model_error_note}).`;
    // A prediction on another device's times is not this pool's: said first, in the main text.
    const foreign = r.profile.pools_own === false
      ? el("p", { class: "notice", role: "note", dataset: { role: "preview-foreign-profile" } },
        `These times are not this pool's: the simulator used ${r.profile.note}, so P99, P50 and the share within `
        + "the SLO are another device's. The cache figures (hit ratio, admissions, HBM) still hold. Measure this "
        + "pool's device with python -m relay_engine.calibrate (make run does it at start).")
      : null;
    sayPreview(el("div", { dataset: { role: "preview", previewId: String(preview.id) } },
      el("h3", {}, "What-if preview"),
      foreign,
      table,
      worth,
      el("p", { class: "muted small", dataset: { role: "preview-window" } },
        `${fmt.count(r.requests)} requests replayed of ${fmt.count(r.requests_captured)} captured in the last ${r.window}`
        + ` (window ended ${fmt.age(age)} ago)`
        + (r.warmup_lead_s ? `, after the ${fmt.count(r.warmup_requests)} of the ${fmt.age(r.warmup_lead_s)} before it `
          + "(replayed to warm the caches as the instances' were, not measured)" : "")
        + ` on ${r.instances} instances (${r.instances_note})`
        + (r.routing ? `, requests sent ${r.routing}` : "")
        + `; ${r.profile.note}.`
        + (r.host_background && r.host_background.share > 0 ? ` On the host, ${r.host_background.note}.` : "")
        + (r.replicates > 1 ? ` Each figure is the median of ${r.replicates} replays, each drawing every forward's `
          + "time with the spread this pool's forwards measured: a P99 of a few minutes moves that much by chance." : "")
        + (r.sampling ? ` ${r.sampling}.` : "")),
      el("p", { class: "muted small", dataset: { role: "preview-model-error" } }, error)));
  }

  /* The pool's scorecard beside the Preview button: how far its published previews were from what the
     pool then measured (the last 5 scored), or that none was scored yet. */
  async function loadScorecard() {
    const node = part("preview-scorecard");
    if (!node) return;
    try {
      const { summary } = await api(`${base}/previews/scores/`);
      node.textContent = summary.source !== "scorecard" || summary.p99_within_pct === null
        ? "no preview of this pool has been scored yet"
        : `last ${summary.scores} preview${summary.scores > 1 ? "s" : ""} of this pool: P99 within `
          + `±${summary.p99_within_pct.toFixed(0)} %`
          + (summary.within_slo_within_points === null ? ""
            : `, within-SLO share within ±${summary.within_slo_within_points.toFixed(1)} points`);
    } catch (err) {
      node.textContent = `scorecard unavailable: ${err.message}`;
    }
  }

  return { runPreview, loadScorecard };
})();
