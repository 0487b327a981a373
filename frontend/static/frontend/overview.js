/* SLO overview: one card per pool, refreshed every 2 s from each pool's metrics (the pool's own
   series only, polled incrementally). */
"use strict";

(() => {
  const { api, Poller, fmt } = RelayGR;
  const cards = [...document.querySelectorAll(".pool-card[data-pool]")];
  let windowName = new URL(window.location.href).searchParams.get("window") || "1h";
  const held = cards.map(() => new Charts.SeriesWindow());

  function renderCard(card, m) {
    const s = Charts.summary(m);
    const figure = (name) => card.querySelector(`[data-figure="${name}"]`);
    const badge = card.querySelector('[data-role="health"]');
    card.dataset.state = s.health;
    badge.textContent = Charts.HEALTH_TEXT[s.health];
    badge.dataset.health = s.health;
    figure("p99").textContent = s.p99 === null ? "–" : `${fmt.ms(s.p99)} / ${m.slo_ms} ms`;
    figure("p99").dataset.state = s.p99 === null ? "" : (s.p99 > m.slo_ms ? "bad" : "good");
    figure("within").textContent = s.within === null || s.within === undefined
      ? "–" : `${fmt.pct(s.within, 2)} of ≥ ${fmt.pct(s.target, 1)}`;
    figure("within").dataset.state = s.burn === null ? "" : (s.burn > 1 ? "bad" : "good");
    figure("goodput").textContent = s.goodput === null ? "–" : fmt.rate(s.goodput);
    figure("burn").textContent = s.burn === null ? "–" : (Number.isFinite(s.burn) ? `${s.burn.toFixed(2)}×` : "∞");
    figure("burn").dataset.state = s.burn === null ? "" : (s.burn > 1 ? "bad" : "good");

    m.data_start = Charts.dataStart(m, m.fleet.instances);
    const container = card.querySelector('[data-chart="p99"]');
    const x = Charts.times(m);
    Charts.draw(container, [
      // Markers too: a pool that just started has one or two points, which a bare line does not show.
      { type: "scatter", mode: "lines+markers", x, y: m.fleet.p99_ms, name: "P99", line: { color: "#1d4ed8", width: 2 },
        marker: { size: 3 } },
    ], { ...Charts.layout(m, { yTitle: "P99 ms", withSlo: true, legend: false }), height: 170,
         margin: { l: 48, r: 8, t: 18, b: 40 } });
    Charts.overlay(container, s.hasData ? null : "No ranking traffic in this window yet: start the pool's workers and send traffic.",
                   "empty");
  }

  async function load() {
    const results = await Promise.all(cards.map((card, i) =>
      api(`/api/v1/pools/${encodeURIComponent(card.dataset.pool)}/metrics/?window=${windowName}&top=0${held[i].query()}`)));
    results.forEach((m, i) => renderCard(cards[i], held[i].merge(m, ["fleet"])));
  }

  function onError(err, { fatal, retryInMs }) {
    const text = fatal ? err.message : `${err.status === 0 ? "Reconnecting to the server" : err.message} — retrying in ${Math.round(retryInMs / 1000)} s.`;
    for (const card of cards) Charts.overlay(card.querySelector('[data-chart="p99"]'), text, "error");
  }

  if (cards.length) {
    const poller = new Poller(load, { intervalMs: 2000, onError });
    RelayGR.windowPicker((name) => {
      windowName = name;
      held.forEach((w) => w.reset());
      poller.start();
    });
    poller.start();
  }

  const create = document.getElementById("create-pool");
  if (create) {
    create.addEventListener("submit", async (event) => {
      event.preventDefault();
      const form = new FormData(create);
      const error = create.querySelector('[data-role="create-error"]');
      try {
        await api("/api/v1/pools/", { method: "POST", body: {
          name: form.get("name"), expected_instances: Number(form.get("expected_instances")) } });
        window.location.reload();
      } catch (err) {
        error.textContent = err.data && err.data.errors
          ? Object.entries(err.data.errors).map(([k, v]) => `${k}: ${v.join(" ")}`).join("; ") : err.message;
      }
    });
  }
})();
