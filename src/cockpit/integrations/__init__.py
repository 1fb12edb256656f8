"""Cockpit in trainers that own the training loop: thin adapters that drive the same
:class:`~cockpit.Cockpit` a plain loop uses (never a second engine).

- :mod:`cockpit.integrations.lightning` — ``CockpitCallback`` for a Lightning ``Trainer``;
- :mod:`cockpit.integrations.transformers` — ``CockpitCallback`` for a Hugging Face
  ``Trainer`` and ``sequence_losses`` (individual losses of a model's output).

Each is imported on its own, so neither framework is needed for the other.
"""
