"""The step pipeline behind :class:`cockpit.Cockpit`.

* :mod:`~cockpit.step.sequence`: the steps in the loop's order: which tracked step a
  ``with cockpit(step, ...)`` block belongs to, step numbering, when a step is complete.
* :mod:`~cockpit.step.tracked_step`: one tracked step, from its first block through its
  backward passes (micro-batches) to its values and, after the optimizer step, those of
  its update.
* :mod:`~cockpit.step.instruments`: preparing and computing one instrument (a failure is
  recorded, never raised).
* :mod:`~cockpit.step.recorder`: where every value goes: memory, the run log, the sinks.
* :mod:`~cockpit.step.watched_run`: what every step of one Cockpit shares.
* :mod:`~cockpit.step.hist_range`: the automatic range of the gradient histograms.
* :mod:`~cockpit.step.instrument_traits`: what the pipeline asks of an instrument beyond its
  descriptor (:mod:`cockpit.quantities.descriptor`).
* :mod:`~cockpit.step.warn_once`: warnings, once per kind.
"""
