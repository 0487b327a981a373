/* Fleet: whether the pool converged on the desired generation (counts over every instance), and the
   instances' reported state a page at a time, those that keep it from converging first. */
"use strict";

(() => {
  const { api, Poller, fmt, el, cacheTiers } = RelayGR;
  const root = document.getElementById("fleet");
  const pool = root.dataset.pool;
  const part = (role) => root.querySelector(`[data-role="${role}"]`);
  let publishKey = null;
  let publishSeenAt = null;
  const PAGE_SIZE = 50;
  let offset = 0;

  function memory(used, budget) {
    const share = budget > 0 ? Math.min(1, used / budget) : 0;
    return el("div", { class: "meter-cell" },
      el("span", {}, `${fmt.bytes(used)} / ${fmt.bytes(budget)}`),
      el("span", { class: "meter" }, el("span", { style: `width:${(share * 100).toFixed(1)}%` })));
  }

  /* One column per cache tier an instance of the pool runs (`status.tiers`, in lookup order), named as the
     server names the core's tiers; a tier the page does not know yet shows by its name. */
  const tierLabel = (tier) => (cacheTiers().find((t) => t.tier === tier) || { label: tier }).label;
  let tierColumns = null;

  function heading(tiers) {
    const key = tiers.join(",");
    if (key === tierColumns) return;
    tierColumns = key;
    const head = part("instances").querySelector("thead tr");
    head.querySelectorAll("th[data-tier]").forEach((th) => th.remove());
    const pid = head.querySelector('th[data-role="pid"]');
    tiers.forEach((tier) => head.insertBefore(
      el("th", { class: "num", dataset: { tier } }, `${tierLabel(tier)} bytes / budget`), pid));
  }

  function tierCell(i, tier) {
    const levels = (i.tiers || {})[tier];
    return el("td", { class: "num", dataset: { tier } }, levels ? memory(levels.bytes, levels.budget_bytes) : "–");
  }

  function row(i, desired, tiers) {
    const state = i.config_state;
    const config = el("div", {},
      el("span", { class: `badge state-${state.toLowerCase()}` }, state),
      i.config_state === "NACK" ? el("span", { class: "small" }, ` generation ${i.nacked_generation} refused`) : null,
      i.error ? el("div", { class: "field-error" }, i.error) : null);
    // A canary instance runs its own generation while the canary bakes: judged against that one.
    const wanted = i.desired_generation || desired;
    return el("tr", { dataset: { instance: i.instance, live: String(i.live), upToDate: String(i.up_to_date),
                                 canary: String(Boolean(i.canary)) },
                      class: i.live ? "" : "dead" },
      el("td", {}, i.instance, i.canary ? el("span", { class: "badge state-canary", title: `canary of generation ${wanted}` },
                                             "canary") : null),
      el("td", {}, el("span", { class: `badge ${i.live ? "state-live" : "state-dead"}` }, i.live ? "live" : "gone")),
      el("td", {}, i.device || "–"),
      el("td", { class: `num ${i.applied_generation === wanted ? "" : "bad"}` }, i.applied_generation || "–"),
      el("td", {}, config),
      el("td", { class: "num" }, fmt.age(i.heartbeat_age_s)),
      ...tiers.map((tier) => tierCell(i, tier)),
      el("td", {}, i.pid || "–"));
  }

  function render(status, detail) {
    const { acked, nacked, waiting } = status.counts;
    const live = status.live_instances;
    const desired = status.desired_generation;
    const key = `${desired}@${detail.desired_at}`;
    if (key !== publishKey) {
      publishKey = key;
      publishSeenAt = Date.now();
    }
    part("publish").textContent = `generation ${desired}${detail.desired_by ? ` by ${detail.desired_by}` : ""}`
      + (detail.desired_at ? ` at ${fmt.time(detail.desired_at)}` : "");
    const badge = part("converged");
    const box = part("convergence");
    box.dataset.state = status.converged ? "converged" : (live ? "converging" : "empty");
    badge.dataset.health = status.converged ? "healthy" : "atrisk";
    badge.textContent = status.converged ? "converged" : (live ? "converging" : "no live instance");
    const canaries = status.instances.filter((i) => i.canary);
    let summary = `${acked} of ${live} live instance${live === 1 ? "" : "s"} ACKed `
      + (canaries.length ? `their desired generation (${desired}; canary ${canaries[0].desired_generation} on `
                           + `${canaries.map((i) => i.instance).join(", ")})` : `generation ${desired}`)
      + ` (${status.expected_instances} expected).`;
    if (nacked) summary += ` ${nacked} refused it (NACK) and keep running their last good generation.`;
    else if (!status.converged && live) summary += ` Waiting for ${waiting}, ${fmt.age((Date.now() - publishSeenAt) / 1000)}.`;
    if (status.published_generation < desired) {
      summary += ` Generation ${desired} is not yet written to Redis (published ${status.published_generation}); `
        + "run manage.py relaygr_sync or publish again.";
    }
    part("summary").textContent = summary;
    part("progress").style.width = `${live ? (100 * acked) / live : 0}%`;
    part("empty").hidden = status.total_instances > 0;
    heading(status.tiers);
    const rows = status.instances.map((i) => row(i, desired, status.tiers));
    if (!rows.length) {
      rows.push(el("tr", {}, el("td", { colspan: 7 + status.tiers.length, class: "muted" }, "No instances.")));
    }
    part("instances").querySelector("tbody").replaceChildren(...rows);
    const last = Math.min(status.total_instances, offset + status.instances.length);
    part("page").textContent = status.total_instances ? `${offset + 1}–${last} of ${status.total_instances}` : "";
    part("prev").disabled = offset === 0;
    part("next").disabled = last >= status.total_instances;
  }

  async function load() {
    const base = `/api/v1/pools/${encodeURIComponent(pool)}/`;
    const [status, detail] = await Promise.all([
      api(`${base}status/?order=problems&limit=${PAGE_SIZE}&offset=${offset}`), api(base)]);
    render(status, detail);
  }

  const poller = new Poller(load, {
    intervalMs: 1000,
    onError(err, { retryInMs }) {
      part("summary").textContent = err.status === 0
        ? `Reconnecting to the server — retrying in ${Math.round((retryInMs || 0) / 1000)} s.` : err.message;
      part("converged").textContent = "unknown";
      delete part("converged").dataset.health;
    },
  });
  part("prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE_SIZE); poller.start(); });
  part("next").addEventListener("click", () => { offset += PAGE_SIZE; poller.start(); });
  poller.start();
})();
