/* Config editor, the history: the pool's revisions with their diffs, and one-click rollback to any
   generation that once ran on the whole pool. */
"use strict";

RelayGR.editor.history = (() => {
  const { api, fmt, el } = RelayGR;
  const editor = RelayGR.editor;
  const { state, part, base, shown, updateButtons } = editor;

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

  async function load() {
    const tbody = part("history").querySelector("tbody");
    let page;
    try {
      page = await api(`${base}/revisions/?limit=25`);
    } catch (err) {
      tbody.replaceChildren(el("tr", {}, el("td", { colspan: 4, class: "field-error" }, `History unavailable: ${err.message}`)));
      return;
    }
    [state.latest] = page.results;
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
          onclick: () => editor.publish.rollback(r.generation) }, `Roll back to ${r.generation}`));
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

  return { load };
})();
