"""The instruments. Each file holds one instrument and reads like its equation."""

from cockpit.quantities.alpha import Alpha
from cockpit.quantities.base import Quantity, StepData
from cockpit.quantities.cabs import CABS
from cockpit.quantities.dead_units import DeadUnits
from cockpit.quantities.descriptor import (
    Descriptor,
    Panel,
    describes_the_batch,
    descriptor_of,
    needs_initial_parameters,
    pending_reason,
    problem_scopes,
    reads_gradient,
)
from cockpit.quantities.distance import Distance, UpdateSize
from cockpit.quantities.early_stopping import EarlyStopping
from cockpit.quantities.grad_hist import GradHist1d, GradHist2d
from cockpit.quantities.grad_norm import GradNorm
from cockpit.quantities.gradient_noise_scale import GradientNoiseScale
from cockpit.quantities.hess_density import HessDensity
from cockpit.quantities.hess_max_ev import HessMaxEV
from cockpit.quantities.hess_top_ev import HessTopEV
from cockpit.quantities.hess_trace import HessTrace
from cockpit.quantities.inner_test import InnerTest
from cockpit.quantities.loss import Loss
from cockpit.quantities.mean_gsnr import MeanGSNR
from cockpit.quantities.norm_test import NormTest
from cockpit.quantities.ortho_test import OrthoTest
from cockpit.quantities.parameters import Parameters
from cockpit.quantities.tic import TICDiag, TICTrace
from cockpit.quantities.time import Time
from cockpit.quantities.update_ratio import ParamNorm, UpdateRatio

__all__ = [
    "CABS",
    "Alpha",
    "DeadUnits",
    "Descriptor",
    "Distance",
    "EarlyStopping",
    "GradHist1d",
    "GradHist2d",
    "GradNorm",
    "GradientNoiseScale",
    "HessDensity",
    "HessMaxEV",
    "HessTopEV",
    "HessTrace",
    "InnerTest",
    "Loss",
    "MeanGSNR",
    "NormTest",
    "OrthoTest",
    "Panel",
    "ParamNorm",
    "Parameters",
    "Quantity",
    "StepData",
    "TICDiag",
    "TICTrace",
    "Time",
    "UpdateRatio",
    "UpdateSize",
    "describes_the_batch",
    "descriptor_of",
    "needs_initial_parameters",
    "pending_reason",
    "problem_scopes",
    "reads_gradient",
]
