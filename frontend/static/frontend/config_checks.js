/* Config editor, the checks: every edit is dry-run checked by the server (the schema's errors by field
   path, the diff against the live revision); the answer marks the fields and fills the diff. */
"use strict";

RelayGR.editor.checks = (() => {
  const { api, el } = RelayGR;
  const editor = RelayGR.editor;
  const { state, root, part, shown, updateButtons } = editor;
  const url = `/ui/pools/${encodeURIComponent(state.pool)}/check/`;
  let checkSeq = 0; // the newest check asked for: an older answer is dropped
  let debounce = null;

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

  async function check() {
    const seq = ++checkSeq;
    let result;
    try {
      result = await api(url, { method: "POST", body: { spec: editor.form.candidate() } });
    } catch (err) {
      if (seq !== checkSeq) return;
      state.lastCheck = { valid: false, changes: [] };
      renderErrors({ "(root)": [`The check could not run: ${err.message}`] });
      updateButtons();
      return;
    }
    if (seq !== checkSeq) return; // a newer edit is being checked
    state.lastCheck = result;
    root.dataset.valid = String(result.valid);
    renderErrors(result.errors);
    renderDiff(result.changes);
    updateButtons();
  }

  function scheduleCheck() {
    clearTimeout(debounce);
    debounce = setTimeout(check, 200);
  }

  /* The check of `spec` as it is now (the form may have changed since the last one answered). */
  async function checkNow(spec) {
    const result = await api(url, { method: "POST", body: { spec } });
    if (!result.valid) {
      renderErrors(result.errors);
      throw new RelayGR.ApiError("The change does not pass the check: see the fields marked.", 400, result);
    }
    return result;
  }

  return { renderErrors, check, scheduleCheck, checkNow };
})();
