"""Synthetic Cockpit outputs in the data contract's format, for examples, docs and tests.

The numbers imitate a small CNN (DeepOBS 3C3D-like parameter names) trained with SGD: a
decaying noisy loss, slowly growing distance from the initialization, α scattered around
a positive mean (overshooting the local minimum), gradient tests of order one and
heavy-tailed individual-gradient histograms. They are *not* the output of a real run.

Instruments computed from the same statistics in Cockpit agree here as they do there
(:func:`_derived_values`): the gradient noise scale follows from the norm test, the batch
size and the gradient norm; parameter norms and update-to-weight ratios from the distance
and the update size; the top Hessian eigenvalues bracket λ_max; the eigenvalue density's
mean is Tr(H)/D.
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

PARAMS_3C3D: dict[str, tuple[int, ...]] = {
    "conv1.weight": (64, 3, 5, 5),
    "conv1.bias": (64,),
    "conv2.weight": (96, 64, 3, 3),
    "conv2.bias": (96,),
    "conv3.weight": (128, 96, 3, 3),
    "conv3.bias": (128,),
    "fc1.weight": (512, 1152),
    "fc1.bias": (512,),
    "fc2.weight": (256, 512),
    "fc2.bias": (256,),
    "fc3.weight": (10, 256),
    "fc3.bias": (10,),
}

CONFIG_INSTRUMENTS: dict[str, tuple[str, ...]] = {
    "economy": (
        "Loss", "GradNorm", "Distance", "UpdateSize", "Alpha", "NormTest", "InnerTest",
        "OrthoTest", "GradHist1d", "LearningRate", "BatchSize", "GradientNoiseScale",
        "ParamNorm", "UpdateRatio",
    ),
    "business": ("HessTrace", "TICDiag"),
    "full": ("HessMaxEV", "GradHist2d", "TICTrace"),
}
# In no configuration (as in cockpit.configurations): ``synthetic_output(instruments=...)``.
OTHER_INSTRUMENTS: tuple[str, ...] = ("HessTopEV", "HessDensity")
NOISE_SCALE_SMOOTHING = 0.9  # β of GradientNoiseScale's moving averages (its default)
TOP_EIGENVALUES = 3  # k of HessTopEV (its default)
DENSITY_PROBES, DENSITY_STEPS = 4, 12  # P probes × m Lanczos steps of HessDensity


def instruments_of(config: str) -> tuple[str, ...]:
    """Instrument names of ``"economy"``, ``"business"`` or ``"full"`` (cumulative)."""
    order = ["economy", "business", "full"]
    names: list[str] = []
    for level in order[: order.index(config) + 1]:
        names.extend(CONFIG_INSTRUMENTS[level])
    return tuple(names)


def _hist1d(rng: np.random.Generator, scale: float, n: int, bins: int = 100) -> dict:
    edges = np.linspace(-2.0, 2.0, bins + 1)
    samples = rng.laplace(0.0, scale, size=n)
    counts, _ = np.histogram(np.clip(samples, -2.0, 2.0), bins=edges)
    return {"counts": counts.astype(np.int64), "edges": edges}


def _hist2d(rng: np.random.Generator, scale: float, n: int) -> dict:
    edges_grad = np.linspace(-2.0, 2.0, 41)
    edges_param = np.linspace(-0.5, 0.5, 51)
    theta = rng.normal(0.0, 0.08, size=n)
    grad = rng.laplace(0.0, scale, size=n) * (1.0 + 4.0 * np.abs(theta))
    counts, _, _ = np.histogram2d(
        np.clip(grad, -2, 2), np.clip(theta, -0.5, 0.5), bins=[edges_grad, edges_param]
    )
    return {
        "counts": counts.astype(np.int64),
        "edges_grad": edges_grad,
        "edges_param": edges_param,
    }


def synthetic_output(
    config: str = "economy",
    num_steps: int = 400,
    every: int = 5,
    seed: int = 0,
    *,
    per_param: bool = True,
    instruments: tuple[str, ...] | None = None,
) -> dict[int, dict[str, Any]]:
    """A Cockpit output ``{step: {name: value}}`` tracked every ``every`` steps.

    Alpha of the last tracked step is ``None`` (it needs the following step).
    ``instruments`` overrides the configuration's instrument list (it may name
    :data:`OTHER_INSTRUMENTS` too). ``per_param``: also the per-parameter values
    (per-layer histograms and ``"<name>/<parameter>"`` of the per-tensor instruments).
    """
    rng = np.random.default_rng(seed)
    derived = _Derived(np.random.default_rng([seed, 1]), per_param)
    names = set(instruments if instruments is not None else instruments_of(config))
    steps = list(range(0, num_steps + 1, every))
    output: dict[int, dict[str, Any]] = {}
    lr, batch = 0.05, 128
    for i, t in enumerate(steps):
        progress = t / max(num_steps, 1)
        v: dict[str, Any] = {}
        grad_norm = 0.6 + 0.9 * progress + 0.08 * rng.standard_normal()
        if "Loss" in names:
            v["Loss"] = float(2.3 * np.exp(-3.0 * progress) + 0.4 + 0.08 * rng.standard_normal())
        if "GradNorm" in names:
            v["GradNorm"] = float(abs(grad_norm))
        if "Distance" in names:
            v["Distance"] = float(6.0 * np.sqrt(progress) + 0.05 * rng.random())
        if "UpdateSize" in names:
            v["UpdateSize"] = float(lr * abs(grad_norm) * (1 + 0.1 * rng.standard_normal()))
        if "Alpha" in names:
            v["Alpha"] = None if i == len(steps) - 1 else float(rng.normal(0.35, 0.45))
        if "NormTest" in names:
            v["NormTest"] = float(abs(1.8 - 0.8 * progress + 0.2 * rng.standard_normal()))
        if "InnerTest" in names:
            v["InnerTest"] = float(abs(0.9 - 0.4 * progress + 0.1 * rng.standard_normal()))
        if "OrthoTest" in names:
            v["OrthoTest"] = float(abs(2.5 - 1.0 * progress + 0.3 * rng.standard_normal()))
        scale = 0.08 + 0.15 * (1 - progress)
        if "GradHist1d" in names:
            v["GradHist1d"] = _hist1d(rng, scale, 20_000)
            if per_param:
                for j, pname in enumerate(PARAMS_3C3D):
                    v[f"GradHist1d/{pname}"] = _hist1d(rng, scale * (0.3 + 0.25 * j), 2_000)
        if "HessTrace" in names:
            v["HessTrace"] = float(800.0 * np.exp(-4 * progress) + 40 + 5 * rng.random())
        if "TICDiag" in names:
            v["TICDiag"] = float(3.0 + 2.0 * progress + 0.3 * rng.standard_normal())
        if "TICTrace" in names:
            v["TICTrace"] = float(1.5 + 1.0 * progress + 0.2 * rng.standard_normal())
        if "HessMaxEV" in names:
            v["HessMaxEV"] = float(300.0 * np.exp(-5 * progress) + 8 + rng.random())
        if "GradHist2d" in names:
            v["GradHist2d"] = _hist2d(rng, scale, 20_000)
        if "LearningRate" in names:
            v["LearningRate"] = lr * (0.1 if progress > 0.75 else 1.0)
        if "BatchSize" in names:
            v["BatchSize"] = float(batch)
        v.update(derived.values(names, v, progress=progress, grad_norm=abs(grad_norm),
                                batch=batch, lr=lr))
        output[t] = v
    return output


def _fan_in(name: str) -> int:
    """Fan-in of a 3C3D tensor (a bias: that of its layer's weight)."""
    shape = PARAMS_3C3D[name.rsplit(".", 1)[0] + ".weight"]
    return prod(shape[1:])


class _Derived:
    """Values of the instruments that Cockpit computes from the statistics of others, made
    from those others' synthetic values (or, where these are not tracked, from the same
    formulas), with their own random numbers so the others' values do not change.

    * ParamNorm: ‖θ_t,p‖² = ‖θ_0,p‖² + (D_p/D)·‖θ_t − θ_0‖² (a drift orthogonal to θ_0
      in expectation), ‖θ_0,p‖² = D_p / (3 fan_in) (PyTorch's default uniform
      initialization); the total is √(Σ_p ‖θ_t,p‖²).
    * UpdateRatio: per tensor ‖s_p‖/‖θ_t,p‖ with Σ_p ‖s_p‖² = UpdateSize², the total
      UpdateSize/ParamNorm (the update and θ_t of the same step).
    * GradientNoiseScale: with θ = NormTest, G = GradNorm², n = |B|: Σ_n‖g_n‖² =
      G(n + n(n−1)θ²), so tr(Σ) = nθ²G and ‖G‖² = (1 − θ²)G
      (:func:`cockpit.quantities.gradient_noise_scale.noise_and_signal`); B_simple =
      tr(Σ)/‖G‖², NaN where ‖G‖² ≤ 0; the moving averages as the instrument forms them.
    * HessTopEV: ν_1 ≤ λ_max ≤ upper_1 around HessMaxEV, λ_2, λ_3 below it.
    * HessDensity: per probe a bulk of Ritz values near 0 and the top eigenvalues,
      weights summing to 1, the bulk shifted so that Σ_j τ_j θ_j = Tr(H)/D.
    """

    def __init__(self, rng: np.random.Generator, per_param: bool) -> None:
        self.rng = rng
        self.per_param = per_param
        self.numel = {p: prod(s) for p, s in PARAMS_3C3D.items()}
        self.size = sum(self.numel.values())
        self.init_sq = {p: n / (3 * _fan_in(p)) for p, n in self.numel.items()}
        # each tensor's (fixed) share of ‖ḡ‖² and of tr(Σ)
        self.signal_share = self._shares(0.5)
        self.noise_share = self._shares(0.3)
        self.averages: dict[str, tuple[float, float]] = {}

    def _shares(self, spread: float) -> dict[str, float]:
        w = {p: n * float(np.exp(spread * self.rng.standard_normal()))
             for p, n in self.numel.items()}
        total = sum(w.values())
        return {p: x / total for p, x in w.items()}

    def values(self, names: set[str], v: dict[str, Any], *, progress: float,
               grad_norm: float, batch: int, lr: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        rng = self.rng
        if {"ParamNorm", "UpdateRatio"} & names:
            distance = v.get("Distance", 6.0 * np.sqrt(progress))
            sq = {p: self.init_sq[p] + n / self.size * distance**2
                  for p, n in self.numel.items()}
            norm = float(np.sqrt(sum(sq.values())))
            if "ParamNorm" in names:
                out.update(self._with_params("ParamNorm", norm,
                                             {p: float(np.sqrt(x)) for p, x in sq.items()}))
            if "UpdateRatio" in names:
                update = v.get("UpdateSize",
                               lr * grad_norm * (1 + 0.1 * rng.standard_normal()))
                w = {p: n * float(np.exp(0.4 * rng.standard_normal()))
                     for p, n in self.numel.items()}
                total_w = sum(w.values())
                ratio = {p: float(np.sqrt(w[p] / total_w) * update / np.sqrt(sq[p]))
                         for p in sq}
                out.update(self._with_params("UpdateRatio", float(update / norm), ratio))
        if "GradientNoiseScale" in names:
            out.update(self._noise_scale(v, grad_norm, batch))
        if "HessTopEV" in names or "HessDensity" in names:
            top = self._top_eigenvalues(v, progress)
            if "HessTopEV" in names:
                out["HessTopEV"] = top
            if "HessDensity" in names:
                out["HessDensity"] = self._density(v, top["values"], progress)
        return out

    def _with_params(self, name: str, total: float, per_param: dict[str, float]
                     ) -> dict[str, float]:
        out = {name: total}
        if self.per_param:
            out.update({f"{name}/{p}": x for p, x in per_param.items()})
        return out

    def _noise_scale(self, v: dict[str, Any], grad_norm: float, batch: int
                     ) -> dict[str, float | None]:
        theta = v.get("NormTest", abs(1.8 + 0.2 * self.rng.standard_normal()))
        n, G = batch, v.get("GradNorm", grad_norm) ** 2
        trace = n * theta**2 * G
        per_key = {"": (trace, G - trace / n)}
        if self.per_param:
            per_key.update({f"/{p}": (self.noise_share[p] * trace,
                                      self.signal_share[p] * G
                                      - self.noise_share[p] * trace / n)
                            for p in PARAMS_3C3D})
        beta = NOISE_SCALE_SMOOTHING
        out: dict[str, float | None] = {}
        for key, (noise, signal) in per_key.items():
            out["GradientNoiseScale" + key] = _ratio(noise, signal)
            previous = self.averages.get(key)
            previous = self.averages[key] = ((noise, signal) if previous is None else
                                             (beta * previous[0] + (1 - beta) * noise,
                                              beta * previous[1] + (1 - beta) * signal))
            out["GradientNoiseScaleEMA" + key] = _ratio(*previous)
        return out

    def _top_eigenvalues(self, v: dict[str, Any], progress: float) -> dict[str, np.ndarray]:
        rng = self.rng
        lam = v.get("HessMaxEV", 300.0 * np.exp(-5 * progress) + 8 + rng.random())
        exact = lam * np.cumprod([1.0, *(0.45 + 0.2 * rng.random(TOP_EIGENVALUES - 1))])
        width = 1e-3 * (1 + rng.random(TOP_EIGENVALUES))  # relative bracket widths
        below = rng.random(TOP_EIGENVALUES)  # where the exact value sits in the bracket
        return {"values": exact * (1 - below * width),
                "upper": exact * (1 + (1 - below) * width)}

    def _density(self, v: dict[str, Any], top: np.ndarray, progress: float
                 ) -> dict[str, np.ndarray]:
        rng = self.rng
        trace = v.get("HessTrace", 800.0 * np.exp(-4 * progress) + 40 + 5 * rng.random())
        mean = trace / self.size  # ∫ λ ρ(λ) dλ = Tr(H)/D
        P, m, k = DENSITY_PROBES, DENSITY_STEPS, top.size
        nodes, weights = np.empty((P, m)), np.empty((P, m))
        for p in range(P):
            bulk = np.sort(0.02 * top[0] * rng.standard_normal(m - k))
            bulk_w = np.exp(-0.5 * (bulk / (0.01 * top[0])) ** 2) + 1e-3
            top_w = 1e-5 * (1 + rng.random(k))
            bulk_w *= (1 - top_w.sum()) / bulk_w.sum()
            node = np.concatenate([bulk, top[::-1]])
            weight = np.concatenate([bulk_w, top_w[::-1]])
            node[: m - k] -= (weight @ node - mean) / bulk_w.sum()  # the bulk carries the mean
            nodes[p], weights[p] = node, weight
        return {"nodes": nodes, "weights": weights}


def _ratio(noise: float, signal: float) -> float:
    """tr(Σ)/‖G‖², NaN where the estimate of ‖G‖² is not positive (as the instrument)."""
    return noise / signal if signal > 0.0 else float("nan")


def synthetic_meta(config: str = "economy") -> dict[str, Any]:
    """Run metadata in the contract's layout for :func:`synthetic_output`."""
    return {
        "model": "cifar10_3c3d (synthetic)",
        "model_summary": "Net3c3d(conv1, conv2, conv3, fc1, fc2, fc3)",
        "num_parameters": 895_210,
        "parameters": {k: list(s) for k, s in PARAMS_3C3D.items()},
        "optimizer": {"class": "SGD", "lr": 0.05, "momentum": 0.9},
        "configuration": list(instruments_of(config)),
        "schedule": "linear(every=5)",
        "device": "cpu",
    }
