/* Shared by every page: the API client (session cookie + CSRF header), a poller that survives
   server restarts, the connection indicator, formatting. No dependencies. */
"use strict";

const RelayGR = (() => {
  const csrfToken = () => document.querySelector('meta[name="csrf-token"]')?.content || "";

  class ApiError extends Error {
    constructor(message, status, data) {
      super(message);
      this.status = status; // 0: the server could not be reached
      this.data = data || {};
    }
  }

  /* JSON in, JSON out; a non-2xx answer or a network failure throws ApiError with the server's
     `detail` and, for a 400/409, its `errors` by field path. */
  async function api(url, { method = "GET", body, timeoutMs = 8000 } = {}) {
    const headers = { Accept: "application/json" };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (method !== "GET") headers["X-CSRFToken"] = csrfToken();
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), timeoutMs);
    let response;
    try {
      response = await fetch(url, {
        method, headers, credentials: "same-origin", signal: controller.signal,
        body: body === undefined ? undefined : JSON.stringify(body),
      });
    } catch (err) {
      throw new ApiError("The server cannot be reached.", 0);
    } finally {
      clearTimeout(timer);
    }
    let data = null;
    try {
      data = await response.json();
    } catch (err) {
      data = null;
    }
    if (!response.ok) {
      const detail = (data && data.detail) || `The server answered HTTP ${response.status}.`;
      throw new ApiError(detail, response.status, data);
    }
    return data;
  }

  /* The header's connection indicator: one per page, fed by every poller. */
  const connection = {
    set(state, text) {
      const el = document.getElementById("connection");
      if (!el) return;
      el.dataset.state = state;
      el.textContent = text;
    },
  };

  /* Calls `load` every `intervalMs`; after a failure retries with exponential backoff (capped) and
     shows "reconnecting", so a restarted server is picked up again without a page reload. A 401/403
     stops: the session is gone and retrying cannot help. */
  class Poller {
    constructor(load, { intervalMs = 1000, maxBackoffMs = 5000, onError } = {}) {
      this.load = load;
      this.intervalMs = intervalMs;
      this.maxBackoffMs = maxBackoffMs;
      this.onError = onError || (() => {});
      this.failures = 0;
      this.timer = null;
      this.generation = 0; // bumps on restart, so a stale in-flight load does not reschedule
    }

    start() {
      this.stop();
      const generation = ++this.generation;
      const tick = async () => {
        if (generation !== this.generation) return;
        const startedAt = performance.now();
        let delay;
        try {
          await this.load();
          // A fixed cadence: the time a load took counts against the interval.
          delay = Math.max(0, this.intervalMs - (performance.now() - startedAt));
          this.failures = 0;
          connection.set("live", "● live");
        } catch (err) {
          if (generation !== this.generation) return;
          if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
            connection.set("error", "session ended — log in again");
            this.onError(err, { fatal: true });
            return;
          }
          this.failures += 1;
          delay = Math.min(this.maxBackoffMs, this.intervalMs * 2 ** this.failures);
          connection.set("reconnecting", `reconnecting… (attempt ${this.failures})`);
          this.onError(err, { fatal: false, retryInMs: delay });
        }
        if (generation === this.generation) this.timer = setTimeout(tick, delay);
      };
      tick();
    }

    stop() {
      this.generation += 1;
      clearTimeout(this.timer);
      this.timer = null;
    }
  }

  const fmt = {
    ms(v) {
      if (v === null || v === undefined) return "–";
      return v >= 100 ? `${v.toFixed(0)} ms` : v >= 10 ? `${v.toFixed(1)} ms` : `${v.toFixed(2)} ms`;
    },
    pct(v, digits = 1) {
      return v === null || v === undefined ? "–" : `${(v * 100).toFixed(digits)}%`;
    },
    rate(v) {
      if (v === null || v === undefined) return "–";
      return v >= 100 ? `${v.toFixed(0)}/s` : `${v.toFixed(v >= 10 ? 1 : 2)}/s`;
    },
    bytes(v) {
      if (v === null || v === undefined) return "–";
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0;
      let x = v;
      while (x >= 1024 && i < units.length - 1) { x /= 1024; i += 1; }
      return `${x.toFixed(x >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
    },
    count(v) {
      return v === null || v === undefined ? "–" : Number(v).toLocaleString("en-US");
    },
    age(seconds) {
      if (seconds === null || seconds === undefined) return "–";
      if (seconds < 60) return `${seconds.toFixed(1)} s`;
      if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.floor(seconds % 60)} s`;
      return `${(seconds / 3600).toFixed(1)} h`;
    },
    time(isoOrUnix) {
      const d = typeof isoOrUnix === "number" ? new Date(isoOrUnix * 1000) : new Date(isoOrUnix);
      return d.toLocaleString("en-GB", { hour12: false });
    },
  };

  /* Element factory: el("td", {class: "num"}, "text", child) — text is always escaped. */
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      // Through the CSSOM: the Content-Security-Policy refuses style attributes, not style properties.
      else if (key === "style") node.style.cssText = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  /* A list of the core's words the server renders into the page (a data attribute of the body), in the
     server's order; empty where the page has none. */
  function fromServer(name) {
    try {
      return JSON.parse(document.body.dataset[name] || "[]");
    } catch (err) {
      return [];
    }
  }
  /* The pre-infer refusal reasons (relay_engine.core.telemetry): [{reason, label, refusal}]; `refusal`
     is false for one that is no refusal at all (the prefix is already cached). */
  const refusalReasons = () => fromServer("refusalReasons");
  /* Why a ranking request found its prefix in no tier (relay_engine.core.telemetry): [{reason, label,
     family, family_label, detail}] in the core's order, the keys of `misses_by_reason` and `misses_per_s`;
     `family` groups the reasons that are cases of one (evicted from a tier, not admitted for a reason). */
  const missReasons = () => fromServer("missReasons");
  /* Where a lookup can be served from (relay_engine.core.outcomes): [{outcome, label}], the keys of the
     series' `lookup_ratio`. */
  const outcomes = () => fromServer("outcomes");
  /* Every cache tier the core can run, in lookup order: [{tier, bytes, budget_bytes}], the last two the
     names of its level gauges in the series answers. */
  const cacheTiers = () => fromServer("cacheTiers");

  /* The window picker: buttons with data-window; the choice goes in the URL (?window=). */
  function windowPicker(onChange) {
    const buttons = document.querySelectorAll(".window-picker button[data-window]");
    buttons.forEach((button) => button.addEventListener("click", () => {
      buttons.forEach((b) => b.setAttribute("aria-pressed", String(b === button)));
      const url = new URL(window.location.href);
      url.searchParams.set("window", button.dataset.window);
      window.history.replaceState(null, "", url);
      onChange(button.dataset.window);
    }));
  }

  // The pool switcher in the header keeps the current tab.
  document.addEventListener("DOMContentLoaded", () => {
    const select = document.getElementById("pool-switch");
    if (select) {
      select.addEventListener("change", () => {
        window.location.href = `/pools/${encodeURIComponent(select.value)}/${select.dataset.tab}`;
      });
    }
  });

  return { api, ApiError, Poller, connection, fmt, el, windowPicker, refusalReasons, missReasons, outcomes, cacheTiers };
})();
