/* Config editor: the live revision in a form; every edit is dry-run checked by the schema (errors by
   field path, diff against the live revision); publish creates a revision on top of the generation
   this page loaded (a stale one is refused by the API with 409, never overwritten) and publishes it;
   history with one-click rollback to any generation that once ran on the whole pool; convergence of the
   fleet after either. A preview or a publish of the spec of the latest, unpublished revision (a
   what-if a preview made) uses that revision instead of creating the same spec again. */
"use strict";

(() => {
  const { api, fmt, el } = RelayGR;
  const state = JSON.parse(document.getElementById("editor-state").textContent);
  const pool = state.pool;
  const base = `/api/v1/pools/${encodeURIComponent(pool)}`;
  const root = document.getElementById("editor");
  const part = (role) => document.querySelector(`[data-role="${role}"]`);
  const NUMBER = /^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/;
  const LATENCY_MODEL = "trigger.latency_model";

  let editingOverride; // an uploaded editing section, until published or discarded
  let checkSeq = 0;
  let lastCheck = { valid: true, changes: [] };
  let busy = false;
  let stale = false; // a publish was refused as stale: only reloading the latest revision helps
  let convergenceTimer = null;
  let latest = null; // the pool's newest revision as the history last read it
  let previewing = false;
  let previewSeq = 0;

  const getPath = (obj, path) => path.split(".").reduce((o, k) => (o === null || o === undefined ? undefined : o[k]), obj);
  function setPath(obj, path, value) {
    const keys = path.split(".");
    let o = obj;
    for (const k of keys.slice(0, -1)) {
      if (o[k] === null || typeof o[k] !== "object") o[k] = {};
      o = o[k];
    }
    o[keys[keys.length - 1]] = value;
  }
  const input = (path) => root.querySelector(`[data-path="${path}"]`);

  /* --- form <-> spec ------------------------------------------------------------------------ */

  function fill(spec) {
    for (const f of state.fields) {
      const node = input(f.path);
      const value = getPath(spec, f.path);
      if (node.tagName === "OUTPUT") node.textContent = value === null || value === undefined ? "—" : String(value);
      else if (f.kind === "bool") node.checked = Boolean(value);
      else node.value = value === null || value === undefined ? "" : String(value);
    }
    renderEditing(spec.editing);
  }

  /* The spec the form describes. Text that is not a number is sent as it is, so the schema's own
     message ("must be a number …, got 'abc'") names the problem. */
  function candidate() {
    const spec = structuredClone(state.live.spec);
    const latency = {};
    for (const f of state.fields) {
      const node = input(f.path);
      let value;
      if (f.kind === "bool") value = node.checked;
      else {
        const text = node.value.trim();
        value = text === "" ? (f.nullable ? null : "") : (NUMBER.test(text) ? Number(text) : text);
      }
      if (f.path.startsWith(`${LATENCY_MODEL}.`)) {
        if (value !== "") latency[f.path.slice(LATENCY_MODEL.length + 1)] = value;
      } else {
        setPath(spec, f.path, value);
      }
    }
    spec.trigger.latency_model = Object.keys(latency).length ? latency : null;
    if (editingOverride !== undefined) spec.editing = editingOverride;
    return spec;
  }

  /* --- checking ----------------------------------------------------------------------------- */

  const stripSpec = (path) => (path.startsWith("spec.") ? path.slice(5) : path === "spec" ? "(root)" : path);

  function renderErrors(errors) {
    root.querySelectorAll("[data-error-for]").forEach((node) => { node.textContent = ""; });
    root.querySelectorAll(".field.invalid").forEach((node) => node.classList.remove("invalid"));
    const other = [];
    for (const [rawPath, messages] of Object.entries(errors || {})) {
      const path = stripSpec(rawPath);
      const text = messages.join(" ");
      const target = root.querySelector(`[data-error-for="${CSS.escape(path)}"]`)
        || (path.startsWith("editing") ? root.querySelector('[data-error-for="editing"]') : null);
      if (target) {
        target.textContent = target.textContent ? `${target.textContent} ${path}: ${text}` : (target.dataset.errorFor === path ? text : `${path}: ${text}`);
        target.closest(".field")?.classList.add("invalid");
      } else {
        other.push(`${path}: ${text}`);
      }
    }
    const box = part("other-errors");
    if (box) {
      box.hidden = other.length === 0;
      box.replaceChildren(...other.map((t) => el("div", {}, t)));
    }
  }

  const shown = (v) => {
    if (v === null || v === undefined) return "—";
    const text = JSON.stringify(v);
    return text.length > 60 ? `${text.slice(0, 57)}…` : text;
  };

  function renderDiff(allChanges) {
    const table = part("diff");
    if (!table) return;
    // "editing: null" replaced by an object shows as that object's fields; the null itself says nothing.
    const changes = allChanges.filter((c) => c.before !== null || c.after !== null);
    const status = part("diff-status");
    table.hidden = changes.length === 0;
    status.textContent = changes.length === 0
      ? `No changes against the live revision (generation ${state.live.generation}).`
      : `${changes.length} change${changes.length === 1 ? "" : "s"} against the live revision (generation ${state.live.generation}):`;
    table.querySelector("tbody").replaceChildren(...changes.map((c) => el("tr", { dataset: { change: c.path } },
      el("td", {}, el("code", {}, c.path)),
      el("td", { class: "before" }, shown(c.before)),
      el("td", { class: "after" }, shown(c.after)))));
  }

  function updateButtons() {
    const publish = part("publish");
    if (!publish) return;
    const dirty = lastCheck.changes.length > 0;
    publish.disabled = busy || stale || !lastCheck.valid || !dirty;
    const reused = lastCheck.valid && dirty ? whatIfTwin(lastCheck.sha256) : null;
    publish.textContent = `Publish generation ${reused ? reused.generation : state.latest_generation + 1}`;
    part("preview").disabled = busy || previewing || stale || !lastCheck.valid || !dirty;
    part("reset").disabled = busy || (!dirty && editingOverride === undefined);
  }

  async function check() {
    const seq = ++checkSeq;
    let result;
    try {
      result = await api(`/ui/pools/${encodeURIComponent(pool)}/check/`, { method: "POST", body: { spec: candidate() } });
    } catch (err) {
      if (seq !== checkSeq) return;
      lastCheck = { valid: false, changes: [] };
      renderErrors({ "(root)": [`The check could not run: ${err.message}`] });
      updateButtons();
      return;
    }
    if (seq !== checkSeq) return; // a newer edit is being checked
    lastCheck = result;
    root.dataset.valid = String(result.valid);
    renderErrors(result.errors);
    renderDiff(result.changes);
    updateButtons();
  }

  let debounce = null;
  function scheduleCheck() {
    clearTimeout(debounce);
    debounce = setTimeout(check, 200);
  }

  /* --- editing section (read-only view, optional upload) ------------------------------------ */

  function renderEditing(editing) {
    const box = part("editing");
    const remove = part("editing-remove");
    if (remove) remove.hidden = !editing;
    if (!editing) {
      box.replaceChildren(el("p", { class: "muted small" },
        "No model edits: the model runs unedited. Edits (a bias on chosen attention heads along a consistency "
        + "direction, scaled by α, or an input-dependent low-rank map of their outputs) are produced by the "
        + "editing workflow."));
      return;
    }
    const fp = editing.fingerprint || {};
    const norm = (d) => Math.sqrt((d || []).reduce((a, v) => a + (typeof v === "number" ? v * v : 0), 0));
    const edits = editing.edits || [];
    const maps = editing.lowrank || [];
    const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
    box.replaceChildren(...[  // replaceChildren writes a null as the text "null": leave the absent parts out
      el("p", { class: "small" }, `Model: ${fp.num_layers} layers × ${fp.num_heads} heads × head_dim ${fp.head_dim}; `
        + `scope: ${editing.scope || "candidates"}; ${plural(edits.length, "biased head")}, `
        + `${plural(maps.length, "low-rank map")}.`),
      edits.length ? el("table", { class: "data compact", dataset: { role: "editing-biases" } },
        el("thead", {}, el("tr", {}, el("th", {}, "Layer"), el("th", {}, "Head"), el("th", { class: "num" }, "α"),
                           el("th", { class: "num" }, "‖direction‖"), el("th", {}, "direction (first values)"))),
        el("tbody", {}, edits.map((e) => el("tr", {},
          el("td", {}, e.layer), el("td", {}, e.head), el("td", { class: "num" }, e.alpha),
          el("td", { class: "num" }, norm(e.direction).toFixed(3)),
          el("td", { class: "small" }, Array.isArray(e.direction)
            ? `${e.direction.slice(0, 4).map((v) => (typeof v === "number" ? v.toFixed(3) : String(v))).join(", ")}${e.direction.length > 4 ? ", …" : ""}` : "?"))))) : null,
      maps.length ? el("table", { class: "data compact", dataset: { role: "editing-lowrank" } },
        el("caption", { class: "small" }, "Low-rank maps: h + α·Rᵀ(W·h + b − R·h) on the listed heads' outputs"),
        el("thead", {}, el("tr", {}, el("th", {}, "Layer"), el("th", {}, "Heads"), el("th", { class: "num" }, "Rank"),
                           el("th", { class: "num" }, "α"), el("th", { class: "num" }, "‖b‖"))),
        el("tbody", {}, maps.map((m) => el("tr", {},
          el("td", {}, m.layer), el("td", {}, Array.isArray(m.heads) ? m.heads.join(", ") : "?"),
          el("td", { class: "num" }, Array.isArray(m.rotation) ? m.rotation.length : "?"),
          el("td", { class: "num" }, m.alpha === undefined ? 1 : m.alpha),
          el("td", { class: "num" }, norm(m.source_bias).toFixed(3)))))) : null,
      editing.provenance && Object.keys(editing.provenance).length
        ? el("details", {}, el("summary", { class: "small" }, "Provenance"), el("pre", {}, JSON.stringify(editing.provenance, null, 2)))
        : null,
    ].filter(Boolean));
  }

  function onEditingFile(event) {
    const file = event.target.files[0];
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => {
      try {
        const parsed = JSON.parse(reader.result);
        editingOverride = parsed && typeof parsed === "object" && "editing" in parsed ? parsed.editing : parsed;
      } catch (err) {
        root.querySelector('[data-error-for="editing"]').textContent = `${file.name} is not JSON: ${err.message}`;
        return;
      }
      renderEditing(editingOverride);
      check();
    };
    reader.readAsText(file);
  }

  /* NumPy directions: the server reads the arrays (np.load, no pickles) and judges the section with
     the schema; a valid one replaces the editing section like a JSON upload, errors list by field. */
  async function onNpyApply() {
    const list = part("editing-npy-errors");
    const file = part("editing-npy-file").files[0];
    if (!file) {
      list.replaceChildren(el("li", { dataset: { path: "file" } }, "file: choose an .npy or .npz file first"));
      return;
    }
    const form = new FormData();
    form.append("file", file);
    form.append("rows", part("editing-npy-rows").value);
    form.append("scope", part("editing-npy-scope").value);
    root.querySelectorAll('[data-role="editing-npy-fp"]').forEach((node) => form.append(node.name, node.value));
    let data;
    try {
      const response = await fetch(`/ui/pools/${encodeURIComponent(pool)}/editing-upload/`, {
        method: "POST", body: form, credentials: "same-origin",
        headers: { Accept: "application/json", "X-CSRFToken": document.querySelector('meta[name="csrf-token"]')?.content || "" },
      });
      data = await response.json().catch(() => ({ detail: `The server answered HTTP ${response.status}.` }));
    } catch (err) {
      data = { detail: "The server cannot be reached." };
    }
    if (!data.errors && data.detail) data.errors = { "(upload)": [data.detail] };
    const errors = Object.entries(data.errors || {});
    list.replaceChildren(...errors.map(([path, messages]) => el("li", { dataset: { path } }, `${path}: ${messages.join(" ")}`)));
    if (!data.valid) return;
    editingOverride = data.editing;
    renderEditing(editingOverride);
    check();
  }

  /* --- publish, rollback, convergence -------------------------------------------------------- */

  function say(...children) {
    part("publish-result")?.replaceChildren(...children);
  }

  function adopt(revision) {
    state.live = { generation: revision.generation, spec: revision.spec, sha256: revision.sha256,
                   author: revision.author, comment: revision.comment, created_at: revision.created_at };
    state.latest_generation = Math.max(state.latest_generation, revision.generation);
    editingOverride = undefined;
    part("live-generation").textContent = `generation ${revision.generation}`;
    part("live-author").textContent = revision.author;
    part("live-sha").textContent = revision.sha256.slice(0, 12);
    fill(revision.spec);
    if (part("comment")) part("comment").value = "";
  }

  function watchConvergence(generation, target) {
    clearInterval(convergenceTimer);
    const started = Date.now();
    const line = el("p", { class: "convergence-line", dataset: { role: "convergence", generation: String(generation) } }, "Waiting for the fleet…");
    target.append(line);
    const poll = async () => {
      let status;
      try {
        status = await api(`${base}/status/`);
      } catch (err) {
        line.textContent = `Fleet status unavailable: ${err.message}`;
        return;
      }
      const live = status.instances.filter((i) => i.live);
      const acked = live.filter((i) => i.up_to_date);
      const nacked = live.filter((i) => i.config_state === "NACK" && i.nacked_generation === generation);
      const waited = ((Date.now() - started) / 1000).toFixed(1);
      line.dataset.converged = String(status.converged);
      if (status.converged) {
        line.replaceChildren(el("span", { class: "badge", dataset: { health: "healthy" } }, "converged"),
          ` all ${live.length} live instances ACKed generation ${generation} (${waited} s).`);
        clearInterval(convergenceTimer);
      } else if (nacked.length) {
        line.replaceChildren(el("span", { class: "badge", dataset: { health: "atrisk" } }, "NACK"),
          ` ${nacked.length} instance(s) refused generation ${generation}: ${nacked[0].error}`);
      } else if (!live.length) {
        line.textContent = "No live instance in this pool: the revision applies when workers start.";
        clearInterval(convergenceTimer);
      } else {
        line.textContent = `Converging: ${acked.length} of ${live.length} live instances ACKed generation ${generation} (${waited} s)…`;
      }
      if (Date.now() - started > 120000) clearInterval(convergenceTimer);
    };
    poll();
    convergenceTimer = setInterval(poll, 1000);
  }

  /* The publish body of a canary (the server validates every field), or undefined: all at once. */
  function canaryBody() {
    const options = part("canary-options");
    if (!options || !options.elements.canary.checked) return undefined;
    const number = (name) => Number(options.elements[name].value);
    return { strategy: "canary", canary_instances: number("canary_instances"), bake_s: number("bake_s"),
             max_burn: number("max_burn") };
  }

  async function publish() {
    busy = true;
    updateButtons();
    const parent = state.latest_generation;
    say(el("p", {}, `Creating generation ${parent + 1}…`));
    let revision;
    try {
      const spec = candidate();
      revision = whatIfTwin((await checkNow(spec)).sha256) || await api(`${base}/revisions/`, { method: "POST", body: {
        parent_generation: parent, spec, comment: part("comment").value } });
      await api(`${base}/revisions/${revision.generation}/publish/`, { method: "POST", body: canaryBody() });
    } catch (err) {
      busy = false;
      const rolloutError = revision && err.data.errors && Object.keys(err.data.errors)
        .some((name) => ["rollout", "strategy", "canary_instances", "bake_s", "max_burn"].includes(name));
      if (rolloutError) {  // a canary baking, or the canary options refused: the revision exists, unpublished
        say(el("p", { class: "error-box", role: "alert" },
          `Generation ${revision.generation} was created but not published: ${err.message} `
          + Object.entries(err.data.errors).map(([name, messages]) => `${name}: ${messages.join(" ")}`).join("; ")));
      } else if (err.status === 409) await refuseStale(parent, err);
      else if (err.status === 400 && err.data.errors) {
        renderErrors(err.data.errors);
        say(el("p", { class: "error-box", role: "alert" }, `Not published: ${err.message}`));
      } else if (revision) {
        say(el("p", { class: "error-box", role: "alert" },
          `Generation ${revision.generation} was created but not published: ${err.message} `
          + "Publish it again from the API, or run manage.py relaygr_sync when Redis is back."));
      } else {
        say(el("p", { class: "error-box", role: "alert" }, `Not published: ${err.message}`));
      }
      updateButtons();
      return;
    }
    busy = false;
    adopt(revision);
    if (canaryBody()) {
      say(el("p", { class: "ok-box" }, `Generation ${revision.generation} is baking as a canary: `,
        el("a", { href: `/pools/${encodeURIComponent(pool)}/` }, "watch it on the live view"), "."));
    } else {
      const done = el("div", {}, el("p", { class: "ok-box" }, `Published generation ${revision.generation} (sha256 ${revision.sha256.slice(0, 12)}).`));
      say(done);
      watchConvergence(revision.generation, done);
    }
    await Promise.all([check(), loadHistory()]);
  }

  async function refuseStale(parent, err, refused = "Not published") {
    stale = true;
    let who = "";
    try {
      const detail = await api(`${base}/`);
      who = ` The pool is now at generation ${detail.latest_generation}`
        + (detail.desired_by ? `; generation ${detail.desired_generation} was published by ${detail.desired_by}` : "") + ".";
    } catch (ignored) {
      who = "";
    }
    const reload = el("button", { type: "button", onclick: () => window.location.reload() }, "Load the latest revision");
    say(el("div", { class: "error-box stale", role: "alert", dataset: { role: "stale" } },
      el("strong", {}, `${refused}: someone changed this pool's configuration after you opened it.`),
      el("p", {}, `You edited generation ${parent}.${who} Nothing was overwritten and your edits are still in the form. `
        + "Load the latest revision (your unsaved edits are discarded), re-apply your change and publish again."),
      el("p", { class: "small muted" }, err.message),
      reload));
  }

  async function rollback(generation) {
    busy = true;
    updateButtons();
    say(el("p", {}, `Rolling back to generation ${generation}…`));
    // On top of the latest generation this page knows: a revision created since makes it a 409.
    const parent = state.latest_generation;
    try {
      const result = await api(`${base}/rollback/`, { method: "POST",
        body: { to_generation: generation, parent_generation: parent } });
      const revision = await api(`${base}/revisions/${result.generation}/`);
      busy = false;
      adopt(revision);
      const done = el("div", {}, el("p", { class: "ok-box" },
        `Rolled back: generation ${revision.generation} restores generation ${generation} and is live.`));
      say(done);
      watchConvergence(revision.generation, done);
      await Promise.all([check(), loadHistory()]);
    } catch (err) {
      busy = false;
      if (err.status === 409) await refuseStale(parent, err, "Not rolled back");
      else say(el("p", { class: "error-box", role: "alert" }, `Rollback refused: ${err.message}`));
      updateButtons();
    }
  }

  /* --- history -------------------------------------------------------------------------------- */

  async function toggleDiff(row, generation) {
    const next = row.nextElementSibling;
    if (next && next.classList.contains("diff-row")) {
      next.remove();
      return;
    }
    const cell = el("td", { colspan: 4 }, "Loading…");
    row.after(el("tr", { class: "diff-row" }, cell));
    try {
      const diff = await api(`${base}/revisions/${generation}/diff/`);
      cell.replaceChildren(diff.changes.length
        ? el("table", { class: "data compact" }, el("tbody", {}, diff.changes.map((c) => el("tr", {},
          el("td", {}, el("code", {}, c.path)), el("td", { class: "before" }, shown(c.before)), el("td", { class: "after" }, shown(c.after))))))
        : el("span", { class: "muted small" }, `Same spec as generation ${diff.against}.`));
    } catch (err) {
      cell.textContent = err.message;
    }
  }

  async function loadHistory() {
    const tbody = part("history").querySelector("tbody");
    let page;
    try {
      page = await api(`${base}/revisions/?limit=25`);
    } catch (err) {
      tbody.replaceChildren(el("tr", {}, el("td", { colspan: 4, class: "field-error" }, `History unavailable: ${err.message}`)));
      return;
    }
    [latest] = page.results;
    updateButtons();
    tbody.replaceChildren(...page.results.map((r) => {
      const live = r.generation === state.live.generation;
      const past = live ? null : pastOf(r);
      const row = el("tr", { dataset: { generation: String(r.generation), past: past ? past.key : "" },
                             class: live ? "live" : (past ? "never-live" : "") });
      const actions = el("td", { class: "nowrap" },
        el("button", { type: "button", class: "link small", onclick: () => toggleDiff(row, r.generation) }, "diff"));
      // Only a generation that once ran on the whole pool is one to go back to.
      if (state.can_edit && !live && r.was_desired) {
        actions.append(" ", el("button", { type: "button", class: "small", dataset: { role: "rollback" },
          onclick: () => rollback(r.generation) }, `Roll back to ${r.generation}`));
      }
      row.append(
        el("td", {}, String(r.generation), live ? el("span", { class: "badge", dataset: { health: "healthy" } }, "live") : null),
        el("td", { class: "small" }, fmt.time(r.created_at), el("br"), r.author),
        el("td", { class: "small" }, r.comment || "—", r.restored_from ? el("div", { class: "muted" }, `restores generation ${r.restored_from}`) : null,
          past ? el("div", { class: "past", dataset: { role: "past" } }, past.text) : null),
        actions);
      return row;
    }));
  }

  /* A revision that never ran on the whole pool: a canary that was not promoted, or a what-if (made for
     a preview, never published). null for one that did. */
  const CANARY_ENDS = { baking: "baking now", promoted: "promoted", rolled_back: "rolled back", aborted: "aborted" };
  function pastOf(r) {
    if (r.was_desired) return null;
    if (r.rollout_state) return { key: "canary", text: `canary, ${CANARY_ENDS[r.rollout_state] || r.rollout_state}: never live on the whole pool` };
    return { key: "what-if", text: "what-if, never published" };
  }

  /* --- what-if preview ---------------------------------------------------------------------------- */

  function sayPreview(...children) {
    part("preview-result")?.replaceChildren(...children);
  }

  /* The pool's latest revision when it is an unpublished what-if of exactly the spec whose sha256 this
     is (an earlier preview made it) and still the latest this page knows: a preview or a publish uses it
     instead of creating the same spec again. */
  function whatIfTwin(sha256) {
    return latest && sha256 && latest.generation === state.latest_generation && latest.generation > state.live.generation
      && !latest.was_desired && latest.rollout_state === null && latest.sha256 === sha256 ? latest : null;
  }

  /* The check of `spec` as it is now (the form may have changed since the last one answered). */
  async function checkNow(spec) {
    const result = await api(`/ui/pools/${encodeURIComponent(pool)}/check/`, { method: "POST", body: { spec } });
    if (!result.valid) {
      renderErrors(result.errors);
      throw new RelayGR.ApiError("The change does not pass the check: see the fields marked.", 400, result);
    }
    return result;
  }

  /* The revision the form describes (created, not published) for the API's preview of a generation. */
  async function revisionToPreview() {
    const spec = candidate();
    const existing = whatIfTwin((await checkNow(spec)).sha256);
    if (existing) return existing;
    const revision = await api(`${base}/revisions/`, { method: "POST", body: {
      parent_generation: state.latest_generation, spec, comment: part("comment").value || "what-if preview" } });
    state.latest_generation = revision.generation;
    latest = revision;
    return revision;
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  async function runPreview() {
    const seq = ++previewSeq;
    const window = part("preview-window").value;
    previewing = true;
    updateButtons();
    let preview;
    try {
      sayPreview(el("p", { class: "muted small" }, "Creating the revision to preview…"));
      const revision = await revisionToPreview();
      loadHistory();
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
        previewing = false;
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
        + ` on ${r.instances} instances (${r.instances_note}); ${r.profile.note}.`
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

  /* --- wiring ---------------------------------------------------------------------------------- */

  fill(state.live.spec);
  loadHistory();
  if (state.can_edit) {
    if (state.latest_generation > state.live.generation) {
      say(el("p", { class: "notice small" }, `Generation ${state.latest_generation} exists but is not published; `
        + `this form shows the live generation ${state.live.generation}. Publishing creates generation ${state.latest_generation + 1}, `
        + `or publishes generation ${state.latest_generation} itself when the form holds its spec.`));
    }
    root.querySelector('[data-role="form"]').addEventListener("input", (event) => {
      if (event.target.dataset.path) scheduleCheck();
    });
    part("editing-file").addEventListener("change", onEditingFile);
    part("editing-npy-apply").addEventListener("click", onNpyApply);
    part("editing-remove").addEventListener("click", () => {
      editingOverride = null;  // the spec without an edit: the model runs unedited
      part("editing-file").value = "";
      renderEditing(null);
      check();
    });
    part("publish").addEventListener("click", publish);
    part("preview").addEventListener("click", runPreview);
    loadScorecard();
    part("reset").addEventListener("click", () => {
      editingOverride = undefined;
      part("editing-file").value = "";
      part("editing-npy-file").value = "";
      part("editing-npy-errors").replaceChildren();
      fill(state.live.spec);
      check();
    });
    root.querySelector('[data-role="form"]').addEventListener("submit", (event) => event.preventDefault());
    check();
  }
})();
