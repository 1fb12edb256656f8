"""The engine: from the user's forward and backward pass to the additive statistics of a
tracked step. Its rooms, in the order the data flows through them:

1. :mod:`.capture` — hooks record each layer call's inputs and output gradients;
2. :mod:`.rules` — one small rule per layer type turns (inputs, output gradients) into the
   individual gradients' :class:`~.rules.sample_grads.SampleGrads` (closed forms where the
   layer has them; ``torch.func`` otherwise);
3. :mod:`.processing` — per layer call: the loss weights divided out, the rule called, every
   requested statistic formed in one pass (:mod:`.statistics`, the registry; the exact
   :mod:`.histograms`), dot products with known directions fused;
4. :mod:`.reduction` — the one reduction point: micro-batches merged, processes combined;
5. :mod:`.readout` — the step's values cross from the device to the host once.

:class:`~.tracker.ModuleTracker` composes capture and processing, which share the tracked
backward pass' :class:`~.backward_state.BackwardState`; :class:`~.engine_view.EngineView`
is all that instruments and curvature code may ask of it; :class:`~.request.StepRequest` is
what they ask for. :mod:`.sharded` handles parameters sharded by ``fully_shard`` (FSDP2):
hooks on the unsharded parameters, norms of local shards summed over ranks, whole tensors
gathered where a per-sample projection needs them. :mod:`.update_prediction` predicts the
optimizer's step for Alpha and :mod:`.update_fit` fits the measured step in the span of a
basis; :mod:`.workspace` keeps scratch buffers from step to step.
"""
