/* Config editor, the form: the live revision's spec in the inputs and the spec the form describes;
   the editing section (shown read-only) and its replacement from a JSON file or NumPy directions. */
"use strict";

RelayGR.editor.form = (() => {
  const { el } = RelayGR;
  const editor = RelayGR.editor;
  const { state, root, part } = editor;
  const NUMBER = /^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/;
  const LATENCY_MODEL = "trigger.latency_model";

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
  // The optional sections (a field's `section`: its group's checkbox turns it on), in the form's order.
  const sections = [...new Set(state.fields.map((f) => f.section).filter(Boolean))];
  const toggle = (section) => root.querySelector(`[data-section="${section}"]`);

  /* A section's fields take input only while it is on (a viewer reads "on" or "off"). */
  function showSection(section) {
    const node = toggle(section);
    if (node.tagName === "OUTPUT") return;
    for (const f of state.fields) if (f.section === section) input(f.path).disabled = !node.checked;
  }

  function fill(spec) {
    for (const section of sections) {
      const value = getPath(spec, section);
      const on = value !== null && value !== undefined;
      const node = toggle(section);
      if (node.tagName === "OUTPUT") node.textContent = on ? "on" : "off";
      else node.checked = on;
    }
    for (const f of state.fields) {
      const node = input(f.path);
      // A field the spec leaves out holds the schema's default (an added field is stored only when changed).
      const stored = getPath(spec, f.path);
      const value = stored === undefined && !f.section ? f.default : stored;
      if (node.tagName === "OUTPUT") node.textContent = value === null || value === undefined ? "—" : String(value);
      else if (f.kind === "bool") node.checked = Boolean(value);
      else node.value = value === null || value === undefined ? "" : String(value);
    }
    sections.forEach(showSection);
    renderEditing(spec.editing);
    // Setting values fires no input event; what draws from the form (the cache curves) redraws on this.
    part("form").dispatchEvent(new Event("relaygr:filled"));
  }

  /* The spec the form describes. Text that is not a number is sent as it is, so the schema's own
     message ("must be a number …, got 'abc'") names the problem. A section that is off is left out of
     the spec (not null: a revision that never had it keeps its hash); in one that is on, an empty field
     is left out, so it takes the schema's default. */
  function candidate() {
    const spec = structuredClone(state.live.spec);
    const latency = {};
    for (const section of sections) {
      const keys = section.split(".");
      const parent = getPath(spec, keys.slice(0, -1).join("."));
      if (toggle(section).checked) setPath(spec, section, {});
      else if (parent && typeof parent === "object") delete parent[keys[keys.length - 1]];
    }
    for (const f of state.fields) {
      const node = input(f.path);
      if (f.section && !toggle(f.section).checked) continue;
      let value;
      if (f.kind === "bool") value = node.checked;
      else {
        const text = node.value.trim();
        if (text === "" && f.section) continue;
        value = text === "" ? (f.nullable ? null : "") : (f.kind !== "text" && NUMBER.test(text) ? Number(text) : text);
      }
      if (f.path.startsWith(`${LATENCY_MODEL}.`)) {
        if (value !== "") latency[f.path.slice(LATENCY_MODEL.length + 1)] = value;
      } else {
        setPath(spec, f.path, value);
      }
    }
    spec.trigger.latency_model = Object.keys(latency).length ? latency : null;
    if (state.editingOverride !== undefined) spec.editing = state.editingOverride;
    return spec;
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

  /* The form's editing section replaced (null: removed), then checked. */
  function replaceEditing(editing) {
    state.editingOverride = editing;
    renderEditing(editing);
    editor.checks.check();
  }

  function onEditingFile(event) {
    const file = event.target.files[0];
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => {
      let parsed;
      try {
        parsed = JSON.parse(reader.result);
      } catch (err) {
        root.querySelector('[data-error-for="editing"]').textContent = `${file.name} is not JSON: ${err.message}`;
        return;
      }
      replaceEditing(parsed && typeof parsed === "object" && "editing" in parsed ? parsed.editing : parsed);
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
      const response = await fetch(`/ui/pools/${encodeURIComponent(state.pool)}/editing-upload/`, {
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
    replaceEditing(data.editing);
  }

  return { fill, candidate, showSection, replaceEditing, onEditingFile, onNpyApply };
})();
