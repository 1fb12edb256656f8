"""InnerTest (paper eq. 22c, Bollapragada et al. 2018):

    θ_inner = √( 1/(|B|(|B|−1)) · [ Σ_n (g_nᵀ g_B)² / ‖g_B‖⁴ − |B| ] ),

the smallest band width θ for which the practical inner product test (22a) holds.
"""

from __future__ import annotations

from cockpit.engine.statistics import GRAM_MEAN
from cockpit.quantities.descriptor import ORANGE, Descriptor
from cockpit.quantities.gradient_tests import GRADIENT_TESTS, GradientTest, sqrt_nonneg


class InnerTest(GradientTest):
    descriptor = Descriptor(panel=GRADIENT_TESTS, color=ORANGE, reads_gradient=True)
    needs = frozenset({GRAM_MEAN})  # g_nᵀg_B only: no individual gradient norms

    def formula(self, n: int, S: float, G: float, D2: float) -> float:
        return sqrt_nonneg((D2 / G**2 - n) / (n * (n - 1)))
