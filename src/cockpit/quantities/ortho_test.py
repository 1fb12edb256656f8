"""OrthoTest (paper eq. 25a, Bollapragada et al. 2018):

    ν_ortho = √( 1/(|B|(|B|−1)) · Σ_n ‖ g_n/‖g_B‖ − (g_nᵀg_B/‖g_B‖²) g_B/‖g_B‖ ‖² )
            = √( 1/(|B|(|B|−1)) · Σ_n [ ‖g_n‖²/‖g_B‖² − (g_nᵀg_B)²/‖g_B‖⁴ ] ),

the smallest band width ν for which the practical orthogonality test holds.

Note on eq. (25b): the appendix prints the expansion of (25a) as
Σ_n [‖g_n‖²/‖g_B‖² − 2(g_nᵀg_B)²/‖g_B‖⁴ + 1]. Expanding the square in (25a) gives
−2(g_nᵀg_B)²/‖g_B‖⁴ + (g_nᵀg_B)²/‖g_B‖⁴ for the last two terms, not −2(…) + 1; the printed
form equals ours minus the InnerTest sum Σ_n(g_nᵀg_B/‖g_B‖² − 1)² and can become negative.
We compute (25a), the quantity the test is defined by: the sample variance of the individual
gradients' components orthogonal to g_B, in units of ‖g_B‖².
"""

from __future__ import annotations

from cockpit.quantities.descriptor import GREEN, Descriptor
from cockpit.quantities.gradient_tests import GRADIENT_TESTS, GradientTest, sqrt_nonneg


class OrthoTest(GradientTest):
    descriptor = Descriptor(panel=GRADIENT_TESTS, color=GREEN, reads_gradient=True)
    def formula(self, n: int, S: float, G: float, D2: float) -> float:
        return sqrt_nonneg((S / G - D2 / G**2) / (n * (n - 1)))
