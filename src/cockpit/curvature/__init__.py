"""Curvature primitives: Hessian-vector products, Lanczos, Hutchinson, loss-Hessian factors.

Used by the curvature instruments HessMaxEV (eq. 26), HessTrace (B.8), TICDiag (eq. 29)
and TICTrace (eq. 28).
"""

from cockpit.curvature.hutchinson import hutchinson_diagonal, hutchinson_trace, rademacher_like
from cockpit.curvature.hvp import HessianVectorProduct, flatten_tensors, unflatten_like
from cockpit.curvature.lanczos import EigResult, lanczos_max_eigenvalue, power_iteration
from cockpit.curvature.loss_factors import (
    SUPPORTED_KINDS,
    exact_sqrt_factor,
    loss_hessian_wrt_output,
    mc_sqrt_factor,
)

__all__ = [
    "SUPPORTED_KINDS",
    "EigResult",
    "HessianVectorProduct",
    "exact_sqrt_factor",
    "flatten_tensors",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "lanczos_max_eigenvalue",
    "loss_hessian_wrt_output",
    "mc_sqrt_factor",
    "power_iteration",
    "rademacher_like",
    "unflatten_like",
]
