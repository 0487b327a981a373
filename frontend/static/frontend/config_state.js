/* Config editor, shared state: the one object the editor's parts (config_*.js, wired by config.js)
   read and write, and the helpers more than one part needs. What a single part needs stays in it. */
"use strict";

RelayGR.editor = (() => {
  const state = {
    // From the server as the page loaded: pool, can_edit, fields; live (the desired revision) and
    // latest_generation move on with each publish, rollback and what-if revision made here.
    ...JSON.parse(document.getElementById("editor-state").textContent),
    editingOverride: undefined, // an uploaded editing section (null: none), until published or discarded
    lastCheck: { valid: true, changes: [] }, // the newest dry-run check's answer
    busy: false, // a publish or a rollback in flight
    stale: false, // a publish was refused as stale: only reloading the latest revision helps
    latest: null, // the pool's newest revision as the history last read it
    previewing: false, // a preview in flight
  };
  const root = document.getElementById("editor");
  const part = (role) => document.querySelector(`[data-role="${role}"]`);
  const base = `/api/v1/pools/${encodeURIComponent(state.pool)}`;

  const shown = (v) => {
    if (v === null || v === undefined) return "—";
    const text = JSON.stringify(v);
    return text.length > 60 ? `${text.slice(0, 57)}…` : text;
  };

  /* The pool's latest revision when it is an unpublished what-if of exactly the spec whose sha256 this
     is (an earlier preview made it) and still the latest this page knows: a preview or a publish uses it
     instead of creating the same spec again. */
  function whatIfTwin(sha256) {
    const { latest } = state;
    return latest && sha256 && latest.generation === state.latest_generation && latest.generation > state.live.generation
      && !latest.was_desired && latest.rollout_state === null && latest.sha256 === sha256 ? latest : null;
  }

  /* The panel's buttons as the state allows them. */
  function updateButtons() {
    const publish = part("publish");
    if (!publish) return;
    const { lastCheck, busy, stale } = state;
    const dirty = lastCheck.changes.length > 0;
    publish.disabled = busy || stale || !lastCheck.valid || !dirty;
    const reused = lastCheck.valid && dirty ? whatIfTwin(lastCheck.sha256) : null;
    publish.textContent = `Publish generation ${reused ? reused.generation : state.latest_generation + 1}`;
    part("preview").disabled = busy || state.previewing || stale || !lastCheck.valid || !dirty;
    part("reset").disabled = busy || (!dirty && state.editingOverride === undefined);
  }

  return { state, root, part, base, shown, whatIfTwin, updateButtons };
})();
