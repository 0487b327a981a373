/* Fleet: every instance's reported state, and whether the pool converged on the desired generation. */
"use strict";

(() => {
  const { api, Poller, fmt, el } = RelayGR;
  const root = document.getElementById("fleet");
  const pool = root.dataset.pool;
  const part = (role) => root.querySelector(`[data-role="${role}"]`);
  let publishKey = null;
  let publishSeenAt = null;

  function memory(used, budget) {
    const share = budget > 0 ? Math.min(1, used / budget) : 0;
    return el("div", { class: "meter-cell" },
      el("span", {}, `${fmt.bytes(used)} / ${fmt.bytes(budget)}`),
      el("span", { class: "meter" }, el("span", { style: `width:${(share * 100).toFixed(1)}%` })));
  }

  function row(i, desired) {
    const state = i.config_state;
    const config = el("div", {},
      el("span", { class: `badge state-${state.toLowerCase()}` }, state),
      i.config_state === "NACK" ? el("span", { class: "small" }, ` generation ${i.nacked_generation} refused`) : null,
      i.error ? el("div", { class: "field-error" }, i.error) : null);
    return el("tr", { dataset: { instance: i.instance, live: String(i.live), upToDate: String(i.up_to_date) },
                      class: i.live ? "" : "dead" },
      el("td", {}, i.instance),
      el("td", {}, el("span", { class: `badge ${i.live ? "state-live" : "state-dead"}` }, i.live ? "live" : "gone")),
      el("td", {}, i.device || "–"),
      el("td", { class: `num ${i.applied_generation === desired ? "" : "bad"}` }, i.applied_generation || "–"),
      el("td", {}, config),
      el("td", { class: "num" }, fmt.age(i.heartbeat_age_s)),
      el("td", { class: "num" }, memory(i.hbm_bytes, i.hbm_budget_bytes)),
      el("td", { class: "num" }, memory(i.dram_bytes, i.dram_budget_bytes)),
      el("td", {}, i.pid || "–"));
  }

  function render(status, detail) {
    const live = status.instances.filter((i) => i.live);
    const acked = live.filter((i) => i.up_to_date);
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
    box.dataset.state = status.converged ? "converged" : (live.length ? "converging" : "empty");
    badge.dataset.health = status.converged ? "healthy" : "atrisk";
    badge.textContent = status.converged ? "converged" : (live.length ? "converging" : "no live instance");
    const nacked = live.filter((i) => i.config_state === "NACK" && i.nacked_generation === desired);
    let summary = `${acked.length} of ${live.length} live instance${live.length === 1 ? "" : "s"} ACKed generation ${desired}`
      + ` (${status.expected_instances} expected).`;
    if (nacked.length) summary += ` ${nacked.length} refused it (NACK) and keep running their last good generation.`;
    else if (!status.converged && live.length) summary += ` Waiting ${fmt.age((Date.now() - publishSeenAt) / 1000)}.`;
    if (status.published_generation < desired) {
      summary += ` Generation ${desired} is not yet written to Redis (published ${status.published_generation}); `
        + "run manage.py relaygr_sync or publish again.";
    }
    part("summary").textContent = summary;
    part("progress").style.width = `${live.length ? (100 * acked.length) / live.length : 0}%`;
    part("empty").hidden = status.instances.length > 0;
    const rows = status.instances.map((i) => row(i, desired));
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 9, class: "muted" }, "No instances.")));
    part("instances").querySelector("tbody").replaceChildren(...rows);
  }

  async function load() {
    const base = `/api/v1/pools/${encodeURIComponent(pool)}/`;
    const [status, detail] = await Promise.all([api(`${base}status/`), api(base)]);
    render(status, detail);
  }

  new Poller(load, {
    intervalMs: 1000,
    onError(err, { retryInMs }) {
      part("summary").textContent = err.status === 0
        ? `Reconnecting to the server — retrying in ${Math.round((retryInMs || 0) / 1000)} s.` : err.message;
      part("converged").textContent = "unknown";
      delete part("converged").dataset.health;
    },
  }).start();
})();
