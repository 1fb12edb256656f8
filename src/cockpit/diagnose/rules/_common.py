"""Helpers the checks share: layer order, per-layer gradient scales, persistence."""

from __future__ import annotations

import math

import numpy as np

from cockpit.diagnose.record import HIST_TOTAL, RunRecord


def layer_order(record: RunRecord) -> list[str]:
    """Parameter names in the model's order (first layer first).

    The run log's metadata lists them in ``named_parameters()`` order; without it, Distance
    and UpdateSize are recorded in that order too; GradNorm comes in backward order.
    """
    meta = getattr(record, "meta", {}) or {}
    if isinstance(meta.get("parameters"), dict) and meta["parameters"]:
        known = set(record.parameters("GradNorm"))
        return [p for p in meta["parameters"] if p in known]
    for instrument in ("Distance", "UpdateSize"):
        found = record.parameters(instrument)
        if found:
            return found
    return list(reversed(record.parameters("GradNorm")))


def weight_tensors(record: RunRecord) -> list[str]:
    """Parameters that hold a layer's weights (not biases or norm scales), model order.

    From the metadata's shapes when known (≥ 2 dimensions); otherwise by name."""
    meta = getattr(record, "meta", {}) or {}
    shapes = meta.get("parameters") if isinstance(meta.get("parameters"), dict) else None
    names = layer_order(record)
    if shapes:
        return [p for p in names if len(shapes.get(p, [])) >= 2]
    return [p for p in names if p.rsplit(".", 1)[-1] == "weight"]


def element_rms(record: RunRecord, param: str, since: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """(steps, root-mean-square of the individual-gradient elements g_n,j of ``param``).

    From recorded values only: NormTest (eq. 19c) gives Σ_n‖g_n‖² = ‖g_B‖²·(|B| +
    |B|(|B|−1)·θ²), GradNorm gives ‖g_B‖, GradHist1d's total count is |B|·D, BatchSize is
    |B|; the RMS is √(Σ_n‖g_n‖² / (|B|·D)). Steps where any is missing are left out.
    """
    steps, g = record.series(f"GradNorm/{param}", since)
    s_nt, nt = record.series(f"NormTest/{param}", since)
    s_tot, tot = record.series(f"GradHist1d/{param}{HIST_TOTAL}", since)
    s_b, b = record.series("BatchSize", since)
    common = np.intersect1d(np.intersect1d(steps, s_nt), np.intersect1d(s_tot, s_b))
    if common.size == 0:
        return common, np.empty(0)

    def at(s, v):
        return v[np.searchsorted(s, common)]

    g, nt, tot, b = at(steps, g), at(s_nt, nt), at(s_tot, tot), at(s_b, b)
    with np.errstate(invalid="ignore", divide="ignore"):
        sum_sq = g**2 * (b + b * (b - 1) * nt**2)
        rms = np.sqrt(sum_sq / tot)
    keep = np.isfinite(rms)
    return common[keep], rms[keep]


def batch_rms(record: RunRecord, param: str, since: int | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """(steps, ‖g_B‖/√D of ``param``): the RMS of the mini-batch gradient's elements.
    D from GradHist1d's total count / BatchSize; without them ‖g_B‖ alone (D unknown)."""
    steps, g = record.series(f"GradNorm/{param}", since)
    s_tot, tot = record.series(f"GradHist1d/{param}{HIST_TOTAL}", since)
    s_b, b = record.series("BatchSize", since)
    meta = getattr(record, "meta", {}) or {}
    shape = (meta.get("parameters") or {}).get(param) if isinstance(
        meta.get("parameters"), dict) else None
    if shape is not None:
        return steps, g / math.sqrt(max(math.prod(shape), 1))
    common = np.intersect1d(np.intersect1d(steps, s_tot), s_b)
    if common.size == 0:
        return steps, g
    d = tot[np.searchsorted(s_tot, common)] / b[np.searchsorted(s_b, common)]
    return common, g[np.searchsorted(steps, common)] / np.sqrt(d)


def share(mask: np.ndarray) -> float:
    """Share of True in ``mask`` (0 for an empty mask)."""
    return float(np.mean(mask)) if mask.size else 0.0


def after_warmup(steps: np.ndarray, values: np.ndarray, skip: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Drop the first ``skip`` share of the steps (at least one step kept)."""
    if steps.size < 2:
        return steps, values
    start = min(int(len(steps) * skip), len(steps) - 1)
    return steps[start:], values[start:]


def pick(steps: np.ndarray, values: np.ndarray, k: int = 4) -> tuple[tuple, tuple]:
    """Up to k (step, value) pairs spread over the series, as evidence."""
    if steps.size == 0:
        return (), ()
    idx = np.unique(np.linspace(0, len(steps) - 1, min(k, len(steps))).astype(int))
    return tuple(int(s) for s in steps[idx]), tuple(float(v) for v in values[idx])


def sum_sq_individual(record: RunRecord, param: str, since: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(steps, Σ_n ‖g_n‖² of ``param``) from NormTest and GradNorm (eq. 19c inverted:
    Σ_n‖g_n‖² = ‖g_B‖²·(|B| + |B|(|B|−1)·θ²))."""
    s_g, g = record.series(f"GradNorm/{param}", since)
    s_nt, nt = record.series(f"NormTest/{param}", since)
    s_b, b = record.series("BatchSize", since)
    common = np.intersect1d(np.intersect1d(s_g, s_nt), s_b)
    g = g[np.searchsorted(s_g, common)]
    nt = nt[np.searchsorted(s_nt, common)]
    b = b[np.searchsorted(s_b, common)]
    with np.errstate(invalid="ignore"):
        return common, g**2 * (b + b * (b - 1) * nt**2)


def parameter_size(record: RunRecord, param: str) -> float | None:
    """Number of elements of ``param`` (metadata, else GradHist1d count / BatchSize)."""
    meta = getattr(record, "meta", {}) or {}
    shapes = meta.get("parameters") if isinstance(meta.get("parameters"), dict) else None
    if shapes and param in shapes:
        return float(math.prod(shapes[param]))
    s_tot, tot = record.series(f"GradHist1d/{param}{HIST_TOTAL}")
    s_b, b = record.series("BatchSize")
    common = np.intersect1d(s_tot, s_b)
    if common.size == 0:
        return None
    return float(tot[np.searchsorted(s_tot, common[-1])] / b[np.searchsorted(s_b, common[-1])])
