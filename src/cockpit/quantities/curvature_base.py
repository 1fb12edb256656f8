"""Shared machinery of the diagonal-curvature instruments (HessTrace, TICDiag, TICTrace):
the ``curvature=`` option and one computation per step, shared between instruments."""

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
        self._diagonal: dict[str, Tensor] | None = None
        self.method_used: str | None = None

    def prepare(self, step: int, tracker, optimizer, losses: Tensor | None) -> None:
        self._diagonal = None
        if losses is None:
            return
        method = resolve_method(self.curvature, tracker, self.mc_threshold, self.max_backprops)
        key = ("diagonal", method, self.loss, self.mc_samples)
        if key not in tracker.step_cache:
            tracker.step_cache[key] = diagonal_curvature(
                method, tracker, losses, tracker.params, loss=self.loss,
                num_samples=self.mc_samples, generator=self.generator,
                max_backprops=self.max_backprops,
            )
        self._diagonal = tracker.step_cache[key]
        self.method_used = method

    def take_diagonal(self) -> dict[str, Tensor]:
        diagonal, self._diagonal = self._diagonal, None
        if diagonal is None:
            raise RuntimeError("the curvature of this step was not computed")
        return diagonal
