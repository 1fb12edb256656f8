"""CABS: the batch size proposed by Balles et al. 2017 (paper eq. 12),

    |B| ← η · [ (1/|B|) Σ_n ‖g_n − g_B‖² ] / L_B
        = η · [ (1/|B|) Σ_n ‖g_n‖² − ‖g_B‖² ] / L_B,

with η the learning rate of the optimizer's (single) parameter group. Without an optimizer,
or with groups of different learning rates, it is None with a note.
"""

from __future__ import annotations

from cockpit.engine.statistics import NORMS
from cockpit.quantities.base import Quantity, StepData, Value, to_float
from cockpit.quantities.descriptor import Descriptor
from cockpit.quantities.gradient_tests import sample_sq_norm_total


class CABS(Quantity):
    descriptor = Descriptor(reads_gradient=True)
    needs = frozenset({NORMS})

    def compute(self, data: StepData) -> dict[str, Value]:
        assert data.stats is not None and data.losses is not None
        if data.learning_rate is None:
            data.notes["CABS"] = (
                "needs the learning rate: pass optimizer= to Cockpit (one learning rate for all "
                "parameter groups)"
            )
            return {"CABS": None}
        n = data.stats.num_samples
        S = sample_sq_norm_total(data)
        G = sum(data.grad_sq_norm(k) for k in data.stats.norms)
        loss = to_float(data.losses.double().mean())
        return {"CABS": data.learning_rate * (S / n - G) / loss}
