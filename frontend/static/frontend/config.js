/* Config editor, the wiring: the live revision in the form (config_form.js); every edit dry-run
   checked (config_checks.js); publish, all at once or as a canary, and rollback (config_publish.js,
   config_canary.js) with the history (config_history.js); the what-if preview (config_preview.js).
   The parts share one state object (config_state.js), loaded first. */
"use strict";

(() => {
  const { el } = RelayGR;
  const { state, root, part, form, checks, publish, history, preview } = RelayGR.editor;

  form.fill(state.live.spec);
  history.load();
  if (!state.can_edit) return;
  if (state.latest_generation > state.live.generation) {
    publish.say(el("p", { class: "notice small" }, `Generation ${state.latest_generation} exists but is not published; `
      + `this form shows the live generation ${state.live.generation}. Publishing creates generation ${state.latest_generation + 1}, `
      + `or publishes generation ${state.latest_generation} itself when the form holds its spec.`));
  }
  root.querySelector('[data-role="form"]').addEventListener("input", (event) => {
    const { path, section } = event.target.dataset;
    if (section) form.showSection(section);
    if (path || section) checks.scheduleCheck();
  });
  part("editing-file").addEventListener("change", form.onEditingFile);
  part("editing-npy-apply").addEventListener("click", form.onNpyApply);
  part("editing-remove").addEventListener("click", () => {
    part("editing-file").value = "";
    form.replaceEditing(null); // the spec without an edit: the model runs unedited
  });
  part("publish").addEventListener("click", publish.publish);
  part("preview").addEventListener("click", preview.runPreview);
  preview.loadScorecard();
  part("reset").addEventListener("click", () => {
    state.editingOverride = undefined;
    part("editing-file").value = "";
    part("editing-npy-file").value = "";
    part("editing-npy-errors").replaceChildren();
    form.fill(state.live.spec);
    checks.check();
  });
  root.querySelector('[data-role="form"]').addEventListener("submit", (event) => event.preventDefault());
  checks.check();
})();
