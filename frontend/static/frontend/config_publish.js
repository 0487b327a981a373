/* Config editor, publish and rollback: publish creates a revision on top of the generation this page
   knows (a stale one is refused by the API with 409, never overwritten) and publishes it, all at once
   or as a canary; rollback publishes an earlier generation again; then the fleet's convergence. A
   publish of the spec of the latest, unpublished revision (a what-if a preview made) publishes that
   revision instead of creating the same spec again. */
"use strict";

RelayGR.editor.publish = (() => {
  const { api, el } = RelayGR;
  const editor = RelayGR.editor;
  const { state, part, base, whatIfTwin, updateButtons } = editor;
  let convergenceTimer = null;

  function say(...children) {
    part("publish-result")?.replaceChildren(...children);
  }

  function adopt(revision) {
    state.live = { generation: revision.generation, spec: revision.spec, sha256: revision.sha256,
                   author: revision.author, comment: revision.comment, created_at: revision.created_at };
    state.latest_generation = Math.max(state.latest_generation, revision.generation);
    state.editingOverride = undefined;
    part("live-generation").textContent = `generation ${revision.generation}`;
    part("live-author").textContent = revision.author;
    part("live-sha").textContent = revision.sha256.slice(0, 12);
    editor.form.fill(revision.spec);
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

  async function publish() {
    state.busy = true;
    updateButtons();
    const parent = state.latest_generation;
    const canary = editor.canary.body();
    say(el("p", {}, `Creating generation ${parent + 1}…`));
    let revision;
    try {
      const spec = editor.form.candidate();
      revision = whatIfTwin((await editor.checks.checkNow(spec)).sha256) || await api(`${base}/revisions/`, { method: "POST", body: {
        parent_generation: parent, spec, comment: part("comment").value } });
      await api(`${base}/revisions/${revision.generation}/publish/`, { method: "POST", body: canary });
    } catch (err) {
      state.busy = false;
      if (revision && editor.canary.refusesRollout(err)) {  // the revision exists, unpublished
        say(el("p", { class: "error-box", role: "alert" },
          `Generation ${revision.generation} was created but not published: ${err.message} `
          + Object.entries(err.data.errors).map(([name, messages]) => `${name}: ${messages.join(" ")}`).join("; ")));
      } else if (err.status === 409) await refuseStale(parent, err);
      else if (err.status === 400 && err.data.errors) {
        editor.checks.renderErrors(err.data.errors);
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
    state.busy = false;
    adopt(revision);
    if (canary) {
      say(editor.canary.baking(revision));
    } else {
      const done = el("div", {}, el("p", { class: "ok-box" }, `Published generation ${revision.generation} (sha256 ${revision.sha256.slice(0, 12)}).`));
      say(done);
      watchConvergence(revision.generation, done);
    }
    await Promise.all([editor.checks.check(), editor.history.load()]);
  }

  async function refuseStale(parent, err, refused = "Not published") {
    state.stale = true;
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
    state.busy = true;
    updateButtons();
    say(el("p", {}, `Rolling back to generation ${generation}…`));
    // On top of the latest generation this page knows: a revision created since makes it a 409.
    const parent = state.latest_generation;
    try {
      const result = await api(`${base}/rollback/`, { method: "POST",
        body: { to_generation: generation, parent_generation: parent } });
      const revision = await api(`${base}/revisions/${result.generation}/`);
      state.busy = false;
      adopt(revision);
      const done = el("div", {}, el("p", { class: "ok-box" },
        `Rolled back: generation ${revision.generation} restores generation ${generation} and is live.`));
      say(done);
      watchConvergence(revision.generation, done);
      await Promise.all([editor.checks.check(), editor.history.load()]);
    } catch (err) {
      state.busy = false;
      if (err.status === 409) await refuseStale(parent, err, "Not rolled back");
      else say(el("p", { class: "error-box", role: "alert" }, `Rollback refused: ${err.message}`));
      updateButtons();
    }
  }

  return { say, publish, rollback };
})();
