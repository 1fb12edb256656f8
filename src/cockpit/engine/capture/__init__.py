"""Capture: what the model's forward and the user's backward pass hand Cockpit at a tracked
step — each layer call's inputs (forward hooks) and output gradients (tensor hooks), the
loss weights ∂L/∂ℓ_n (a hook on the per-sample losses), the per-sample shares of broadcast
parameters, and the model under ``torch.compile``.

* :mod:`.hooks` — :class:`~.hooks.Capture`: the hooks on the model, units and calls;
* :mod:`.broadcast` — parameters broadcast over the batch (e.g. positional embeddings);
* :mod:`.activations` — the activation calls the curvature backpropagation records;
* :mod:`.compiled` — eager execution of a compiled model at tracked steps.
"""
