"""Colors, fonts and panel titles of the cockpit view, defined once for every panel."""

from __future__ import annotations

BLUE = "#1f5fa8"
ORANGE = "#e07b00"
GREEN = "#2e8b57"
PURPLE = "#7b3fa0"
RED = "#d62728"
GRAY = "#6e6e6e"
LIGHT_GRAY_FACE = "#ececec"  # the "gray panels": what most practitioners track already

# One color per instrument, used wherever the instrument appears.
COLORS: dict[str, str] = {
    "Loss": "#333333",
    "GradNorm": BLUE,
    "Distance": BLUE,
    "UpdateSize": ORANGE,
    "Alpha": BLUE,
    "AlphaRecent": ORANGE,
    "NormTest": BLUE,
    "InnerTest": ORANGE,
    "OrthoTest": GREEN,
    "GradHist1d": BLUE,
    "GradHist2d": BLUE,
    "HessMaxEV": PURPLE,
    "HessTrace": PURPLE,
    "TICDiag": GREEN,
    "TICTrace": ORANGE,
    "LearningRate": GRAY,
    "BatchSize": GRAY,
}

FONT_SIZES = {"base": 8.5, "title": 10.0, "suptitle": 13.0, "small": 7.5}

# Panel key -> title. A panel key is the instrument (or instrument group) it shows.
PANEL_TITLES: dict[str, str] = {
    "Alpha": "α: step size relative to the local quadratic minimum",
    "Distances": "Distance from init ‖θ_t − θ_0‖ and update size ‖θ_t+1 − θ_t‖",
    "GradNorm": "Gradient norm ‖g_B‖",
    "GradientTests": "Gradient tests: how noisy is the batch?",
    "GradHist1d": "Histogram of individual gradient elements g_n,j",
    "GradHist2d": "Parameters θ_j vs. individual gradients g_n,j",
    "HessMaxEV": "Largest Hessian eigenvalue λ_max(H_B): sharpness",
    "HessDensity": "Hessian eigenvalue density (stochastic Lanczos quadrature)",
    "HessTrace": "Hessian trace Tr(H_B): average curvature",
    "TIC": "Takeuchi information criterion (TIC)",
    "Layers": "Individual gradient elements per layer",
    "Findings": "Diagnosis: what the instruments say",
    "Loss": "Mini-batch loss L_B(θ)",
    "LearningRate": "Learning rate",
    "BatchSize": "Batch size",
}

# Titles of parts of a panel (not panels of their own).
SUB_TITLES: dict[str, str] = {
    "TestGeometry": "Test geometry",
    "HistZoom": "Zoom on the data",
}

# Thresholds of the gradient tests used by Bollapragada et al. (paper App. B.6).
THETA_NORM = 0.9
THETA_INNER = 0.9
NU_ORTHO = 5.84  # tan(80°)

ALPHA_RANGE = 1.5  # α axis shows [-1.5, 1.5]; values outside are clipped into the edge bins
GRAD_HIST_RANGE = (-2.0, 2.0)  # x range of GradHist1d when its edges reach further
