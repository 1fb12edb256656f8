"""The modules whose calls the engine records as (module, input z, output a): the smooth
nonlinearities whose second derivatives enter the Hessian's diagonal beyond the GGN
(:mod:`cockpit.curvature.diag_hessian`, which holds σ'' for each elementwise activation
and φ for each normalization listed here; a test keeps both lists equal).
"""

from __future__ import annotations

from torch import nn

# a = σ(z) elementwise, with σ'' ≠ 0
ELEMENTWISE_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.Sigmoid, nn.Tanh, nn.GELU, nn.SiLU, nn.Softplus, nn.ELU)
# a = φ(z) over each normalized slice (a vector nonlinearity)
NORMALIZATIONS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm)


def is_activation(module: nn.Module) -> bool:
    """Whether the engine records the calls of ``module`` (its exact type is listed)."""
    return type(module) in ELEMENTWISE_ACTIVATIONS or type(module) in NORMALIZATIONS
