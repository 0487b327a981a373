/* Config editor, the canary: the publish panel's canary options as the publish body, and what a
   publish says when the rollout is refused or starts. */
"use strict";

RelayGR.editor.canary = (() => {
  const { el } = RelayGR;
  const { state, part } = RelayGR.editor;
  const ROLLOUT_FIELDS = ["rollout", "strategy", "canary_instances", "bake_s", "max_burn"];

  /* The publish body of a canary (the server validates every field), or undefined: all at once. */
  function body() {
    const options = part("canary-options");
    if (!options || !options.elements.canary.checked) return undefined;
    const number = (name) => Number(options.elements[name].value);
    return { strategy: "canary", canary_instances: number("canary_instances"), bake_s: number("bake_s"),
             max_burn: number("max_burn") };
  }

  /* Whether a refused publish names the rollout: a canary baking, or the canary options refused. */
  function refusesRollout(err) {
    return Boolean(err.data.errors) && Object.keys(err.data.errors).some((name) => ROLLOUT_FIELDS.includes(name));
  }

  function baking(revision) {
    return el("p", { class: "ok-box" }, `Generation ${revision.generation} is baking as a canary: `,
      el("a", { href: `/pools/${encodeURIComponent(state.pool)}/` }, "watch it on the live view"), ".");
  }

  return { body, refusesRollout, baking };
})();
