"""Shared machinery of the diagonal-curvature instruments (HessTrace, TICDiag, TICTrace):
the ``curvature=`` option and one computation per backward pass, shared between instruments.

The diagonal is computed on each backward pass's graph (before the user's backward) for the
mean loss of its N_k samples, and added to the step's statistics as N_k · diag_k: the
diagonal of the mean loss over a step split into micro-batches or processes is then
Σ_k N_k diag_k / N, exactly (the Hessian and the GGN of a mean are the weighted means)."""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.curvature.diagonal import check_method, diagonal_curvature, resolve_method
from cockpit.quantities.base import Quantity
from cockpit.schedules import Schedule


class DiagonalCurvatureQuantity(Quantity):
    """An instrument that reads the diagonal curvature of L_B (see
    :mod:`cockpit.curvature.diagonal` for the methods)."""

    def __init__(
        self,
        schedule: Schedule | int | None = None,
        curvature: str = "auto",
        *,
        loss: str | None = None,
        mc_samples: int = 1,
        mc_threshold: int = 32,
        max_backprops: int = 512,
        seed: int = 0,
    ):
        super().__init__(schedule)
        if curvature != "auto":
            check_method(curvature)
        if loss not in (None, "cross_entropy", "mse"):
            raise ValueError(
                f"loss must be 'cross_entropy', 'mse' or None (recognize), got {loss!r}; "
                "for other losses use curvature='hutchinson'"
            )
        self.curvature, self.loss = curvature, loss
        self.mc_samples, self.mc_threshold = mc_samples, mc_threshold
        self.max_backprops = max_backprops
        self.generator = torch.Generator().manual_seed(seed)
        self.method_used: str | None = None
        self.sample_sum_keys = (
            f"diagonal/{curvature}/{loss}/{mc_samples}/{mc_threshold}/{max_backprops}",)

    def prepare(self, step: int, tracker, optimizer, losses: Tensor | None) -> None:
        if losses is None:
            return
        method = resolve_method(self.curvature, tracker, self.mc_threshold, self.max_backprops)
        key = ("diagonal", method, self.loss, self.mc_samples)
        if key not in tracker.step_cache:  # shared by the instruments of this backward
            diagonal = diagonal_curvature(
                method, tracker, losses, tracker.params, loss=self.loss,
                num_samples=self.mc_samples, generator=self.generator,
                max_backprops=self.max_backprops,
            )
            n = losses.shape[0]
            tracker.step_cache[key] = diagonal
            tracker.add_sample_sums(self.sample_sum_keys[0],
                                    {k: d * n for k, d in diagonal.items()})
        self.method_used = method

    def take_diagonal(self, data) -> dict[str, Tensor]:
        """diag(curvature) of the step's mean loss, from the step's statistics."""
        sums = None if data.stats is None else data.stats.sample_sums.get(self.sample_sum_keys[0])
        if not sums or not data.stats.num_samples:
            raise RuntimeError("the curvature of this step was not computed")
        n = data.stats.num_samples
        return {k: s / n for k, s in sums.items()}
