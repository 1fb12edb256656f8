"""Case study (b), paper §3.2 / Fig. 4: vanishing gradients seen only layer-wise.

Two 3C3D-style networks (three convolutions, three linear layers, DeepOBS's Xavier
initialisation) are trained on scikit-learn's digits, one with ReLU, one with sigmoid
activations. Their whole-network histograms of individual gradients look alike — both a
narrow spike at zero — but the layer-wise view shows that the sigmoid network's first
layers receive gradients orders of magnitude smaller than its last ones. ``cockpit
diagnose`` names ``vanishing_gradients`` for the sigmoid network and nothing for ReLU.

    python examples/case_studies/activations.py [--steps 60] [--out case-studies/activations]
"""

# test-arguments: --steps 12

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import digits, element_rms, median_over_steps, save_figures, train
from cockpit import diagnose
from cockpit.benchmark.problems.small_nets import xavier_init

WEIGHTS = ["0.weight", "3.weight", "6.weight", "9.weight", "11.weight", "13.weight"]


def digits_3c3d(activation: type[nn.Module]) -> nn.Sequential:
    """3C3D shrunk to 8×8 inputs: conv 1→16 3×3 same, act, max-pool 2; conv 16→32 3×3
    same, act, max-pool 2; conv 32→32 3×3 same, act; linear 128→64, act; 64→32, act;
    32→10. Conv weights Xavier-normal, linear Xavier-uniform, biases 0 (as DeepOBS)."""
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), activation(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), activation(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), activation(), nn.Flatten(),
        nn.Linear(32 * 2 * 2, 64), activation(),
        nn.Linear(64, 32), activation(),
        nn.Linear(32, 10),
    )
    return xavier_init(model)  # DeepOBS's 3C3D initialization


def center_share(hist: dict) -> float:
    """Share of the elements in the two bins next to zero (|g| < 0.04 with the paper's
    100 bins over [−2, 2]): the spike a whole-network histogram shows."""
    counts = np.asarray(hist["counts"], dtype=np.float64)
    edges = np.asarray(hist["edges"], dtype=np.float64)
    center = (edges[:-1] < 0.04 + 1e-12) & (edges[1:] > -0.04 - 1e-12)
    return float(counts[center].sum() / counts.sum())


def run(steps: int = 60, out: str | Path = "case-studies/activations", seed: int = 0,
        figure: bool = True) -> dict:
    out = Path(out)
    x, y = digits(raw=False, seed=seed)
    result: dict = {}
    for name, act in (("relu", nn.ReLU), ("sigmoid", nn.Sigmoid)):
        torch.manual_seed(seed)
        model = digits_3c3d(act)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        output = train(model, x, y, optimizer, steps, out / name, seed=seed)
        last = output[max(output)]
        layer_rms = {w: median_over_steps(output, lambda v, w=w: element_rms(v, w))
                     for w in WEIGHTS}
        result[name] = {
            "output": output,
            "findings": diagnose(out / name),
            "layer_rms": layer_rms,
            "spread": max(layer_rms.values()) / min(layer_rms.values()),
            "hist": last["GradHist1d"],
            "center": median_over_steps(output, lambda v: center_share(v["GradHist1d"])),
        }
    result["first_layer_factor"] = (result["relu"]["layer_rms"][WEIGHTS[0]]
                                    / result["sigmoid"]["layer_rms"][WEIGHTS[0]])
    if figure:
        result["figures"] = draw(result, out)
    return result


def draw(result: dict, out: Path) -> list[Path]:
    """Fig. 4: whole-network histograms side by side, per-layer RMS of the individual
    gradients; then each network's layer-wise view (cockpit.view.plot_layers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, axes = plt.subplots(1, 3, figsize=(12, 3.3))
    for ax, name in zip(axes[:2], ("relu", "sigmoid"), strict=True):
        hist = result[name]["hist"]
        counts, edges = np.asarray(hist["counts"]), np.asarray(hist["edges"])
        ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="C0")
        ax.set_title(f"{name}: whole network, {result[name]['center']:.1%} within ±0.04",
                     fontsize=9)
        ax.set_xlabel("individual gradient element")
    ax = axes[2]
    for name, color in (("relu", "C0"), ("sigmoid", "C3")):
        rms = [result[name]["layer_rms"][w] for w in WEIGHTS]
        ax.semilogy(range(1, len(WEIGHTS) + 1), rms, "o-", color=color, label=name)
    ax.set_xlabel("weight layer (input → output)")
    ax.set_ylabel("RMS of g_n,j")
    ax.set_title("layer-wise", fontsize=9)
    ax.legend(fontsize=8)
    fig.suptitle("Whole-network histograms alike (a spike at zero); first layer's gradients "
                 f"{result['first_layer_factor']:.0f}× smaller with sigmoid", fontsize=10)
    fig.tight_layout()
    return save_figures(fig, out, "activations", ("relu", "sigmoid"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="case-studies/activations")
    args = parser.parse_args(argv)
    result = run(args.steps, args.out)
    for name in ("relu", "sigmoid"):
        r = result[name]
        codes = [f.code for f in r["findings"] if f.is_problem] or ["nothing"]
        print(f"{name:>8}: layer RMS spread {r['spread']:.3g}×; diagnose names "
              f"{', '.join(codes)}")
    print(f"whole-network histograms: {result['relu']['center']:.1%} (ReLU) and "
          f"{result['sigmoid']['center']:.1%} (sigmoid) of the elements within ±0.04; "
          f"first layer {result['first_layer_factor']:.3g}× smaller with sigmoid")
    print("figures: " + ", ".join(str(p) for p in result["figures"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
