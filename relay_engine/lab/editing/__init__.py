"""Model editing for semantic consistency: locate heads by probing, derive directions, build the edit.

The workflow of Yang et al. ("Enhancing Semantic Consistency of Large Language Models through
Model Editing"), in the inference-time-intervention style:

1. Pairs of semantically equivalent inputs, each labelled *consistent* or not by the model's own
   outputs (GR: same top-10 for a history and its rewrite; LLM: same answer across paraphrased
   instructions).
2. Per attention head, a linear probe on the head's output predicts that label; the top-K heads by
   held-out probe accuracy are kept (``probes.locate_heads``).
3. Per kept head a direction: ``mean(consistent) − mean(all)`` ("mean_shift"), or the same made a
   unit vector and scaled by the activations' standard deviation along it ("iti") (``directions.directions``).
   For GR the edit can also be fitted directly, by gradient descent on equivalent pairs, to make each
   rewrite score like its original while the original's scores stay those of the unedited model:
   constant per-head vectors ("fit", ``fitting.fit_head_biases``; K then keeps the heads with the
   largest vectors) or input-dependent low-rank maps of each layer's head outputs ("lowrank",
   ``fitting.fit_lowrank_maps``: ``h + α·Rᵀ(W·h + b − R·h)``, LoReFT's form).
4. At inference, ``α · direction`` is added to those heads' outputs, or the maps are applied
   (``directions.build_editing`` gives the ``editing`` section of the policy; the engine serves it).

The configuration type and its validation live in the core (``relay_engine.core.config``), and so
does its file I/O (``relay_engine.core.editing_io``, shared with the editor's upload); everything
built here goes through ``parse_policy`` so it is exactly what the control plane and the workers
accept.

Modules: ``probes`` (probe data splits, per-head probes, head location), ``directions``
(directions and the ``editing`` section), ``fitting`` (fitted head vectors and low-rank maps),
``gr_eval`` (the synthetic GR evaluation), ``llm`` (the same on a real LLM), ``llm_stats`` (its
statistics and selection rule), ``reviews`` (generated labelled reviews), ``cli`` (the command).
``python -m relay_engine.editing eval`` runs the whole loop on the synthetic GR model for each
base-model seed; ``eval-llm`` does the same on a real pretrained LLM (optional extra).
"""
