"""NormTest (paper eq. 19c, Byrd et al. 2012):

    θ_norm = √( 1/(|B|(|B|−1)) · [ Σ_n ‖g_n‖² / ‖g_B‖² − |B| ] ),

the smallest radius θ for which the practical norm test (19a) holds.
"""

from __future__ import annotations

from cockpit.engine.statistics import NORMS
from cockpit.quantities.descriptor import BLUE, Descriptor
from cockpit.quantities.gradient_tests import GRADIENT_TESTS, GradientTest, sqrt_nonneg


class NormTest(GradientTest):
    descriptor = Descriptor(panel=GRADIENT_TESTS, color=BLUE, reads_gradient=True)
    needs = frozenset({NORMS})  # ‖g_n‖ only: no projections on g_B

    def formula(self, n: int, S: float, G: float, D2: float) -> float:
        return sqrt_nonneg((S / G - n) / (n * (n - 1)))
