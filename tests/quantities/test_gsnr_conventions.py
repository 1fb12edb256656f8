"""MeanGSNR and EarlyStopping: the documented Cockpit convention (noise-free elements
excluded, no ε) and the original package's (ε = 1e-5 added to the variance, mean over all D
elements), both against brute-force individual gradients (torch.func) in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, quantities
from tests.reference import early_stopping, individual_gradients, mean_gsnr, rel_close


def relu_cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(4 * 3 * 3, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    return model, x, y


def original_definitions(G: torch.Tensor, epsilon: float = 1e-5) -> tuple[float, float]:
    """The original package's formulas on [N, D] individual gradients (all D elements):
    GSNR_j = ḡ_j² / (biased variance_j + ε); EarlyStopping = 1 − N/D Σ_j ḡ_j² /
    (unbiased variance_j + ε)."""
    n = G.shape[0]
    mean = G.mean(0)
    biased = (G - mean).pow(2).mean(0)
    unbiased = biased * n / (n - 1)
    gsnr = (mean.pow(2) / (biased + epsilon)).mean().item()
    stopping = 1 - n / G.shape[1] * (mean.pow(2) / (unbiased + epsilon)).sum().item()
    return gsnr, stopping


def test_original_convention_reproduced_and_differs_from_default():
    model, x, y = relu_cnn()
    grads = individual_gradients(model, lambda o, t: F.cross_entropy(o, t, reduction="none"),
                                 x, y)
    blocks = [g.double().reshape(g.shape[0], -1) for g in grads.values()]
    G = torch.cat(blocks, 1)
    gsnr_original, stopping_original = original_definitions(G)

    outputs = {}  # one Cockpit per convention (two instruments of a class share a name)
    for convention in ("cockpit", "original"):
        model_c, x_c, y_c = relu_cnn()
        c = Cockpit(model_c, [quantities.MeanGSNR(convention=convention),
                              quantities.EarlyStopping(convention=convention)], strict=True)
        losses = F.cross_entropy(model_c(x_c), y_c, reduction="none")
        with c(0, losses=losses):
            losses.mean().backward()
        c.close()
        outputs[convention] = c.get_output()[0]

    assert rel_close(outputs["original"]["MeanGSNR"], gsnr_original, 1e-5)
    assert rel_close(outputs["original"]["EarlyStopping"], stopping_original, 1e-5)
    assert rel_close(outputs["cockpit"]["MeanGSNR"], mean_gsnr(blocks), 1e-5)
    assert rel_close(outputs["cockpit"]["EarlyStopping"], early_stopping(blocks), 1e-5)
    # the case that motivates two conventions: they give clearly different numbers here
    ratio = outputs["cockpit"]["MeanGSNR"] / outputs["original"]["MeanGSNR"]
    assert ratio > 1.5, ratio  # 1.86 here
    assert (G.pow(2).sum(0) == 0).any()  # dead ReLU elements: excluded vs counted in D
    for convention in ("cockpit", "original"):
        per_param = [v for k, v in outputs[convention].items() if k.startswith("MeanGSNR/")]
        assert len(per_param) == len(grads)


def test_convention_is_checked():
    with pytest.raises(ValueError, match="original"):
        quantities.MeanGSNR(convention="paper")
    with pytest.raises(ValueError, match="epsilon"):
        quantities.EarlyStopping(convention="original", epsilon=-1.0)
