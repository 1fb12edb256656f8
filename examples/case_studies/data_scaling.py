"""Case study (a), paper §3.1 / Fig. 3: incorrectly scaled data.

The same network (the digits CNN, Adam with its default learning rate, which copes with
either scale) is trained on the same digits images twice: once on the raw pixel values
0…16 as scikit-learn ships them, once standardized. The whole-network histogram of the
individual gradients (each run's range set from its first step; drawn on one axis) is much
wider for the raw data, and
the layer-wise view shows where: the first layer, whose individual gradients δ_n x_nᵀ carry
the input's scale. ``cockpit diagnose`` names ``unscaled_inputs`` for the raw run and
nothing for the standardized one.

    python examples/case_studies/data_scaling.py [--steps 60] [--out case-studies/data_scaling]
"""

# test-arguments: --steps 12

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import digits, element_rms, median_over_steps, outside_share, save_figures, train
from cockpit import diagnose
from cockpit.benchmark.problems.digits import digits_cnn

COMPARE_STEPS = 10  # widths are compared over the first steps, from the same weights


def run(steps: int = 60, out: str | Path = "case-studies/data_scaling", seed: int = 0,
        figure: bool = True) -> dict:
    """Train both runs; returns their outputs, findings and the measured widths (median
    over the first COMPARE_STEPS steps: both runs start from the same initial weights, so
    there the histograms differ only by the data's scale)."""
    out = Path(out)
    result: dict = {}
    for name, raw in (("raw", True), ("normalized", False)):
        torch.manual_seed(seed)  # the same initial weights for both runs
        model = digits_cnn()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = digits(raw, seed)
        output = train(model, x, y, optimizer, steps, out / name, seed=seed)
        start = {s: output[s] for s in sorted(output)[:COMPARE_STEPS]}
        result[name] = {
            "output": output,
            "findings": diagnose(out / name),
            "rms": median_over_steps(start, element_rms),
            "first_layer_rms": median_over_steps(start, lambda v: element_rms(v, "0.weight")),
            "outside": median_over_steps(start, outside_share),
        }
    result["width_factor"] = result["raw"]["rms"] / result["normalized"]["rms"]
    if figure:
        result["figures"] = draw(result, out)
    return result


def draw(result: dict, out: Path) -> list[Path]:
    """Fig. 3: the two whole-network histograms at the last compared step; then each
    run's layer-wise view (cockpit.view.plot_layers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np


    # one x axis: each run's histogram range was set from its own first step, so on a
    # shared axis the raw run's wider histogram is seen, not only read off the ticks
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharex=True)
    for ax, name in zip(axes, ("raw", "normalized"), strict=True):
        output = result[name]["output"]
        hist = output[sorted(output)[COMPARE_STEPS - 1]]["GradHist1d"]
        counts, edges = np.asarray(hist["counts"]), np.asarray(hist["edges"])
        ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="C0")
        ax.set_yscale("log")
        ax.set_title(f"{name} inputs, step {COMPARE_STEPS - 1}: RMS of g_n,j = "
                     f"{result[name]['rms']:.3g}\n"
                     f"{result[name]['outside']:.3%} of elements beyond ±{hist['range']:.3g} "
                     "(edge bins)",
                     fontsize=9)
        ax.set_xlabel("individual gradient element")
    fig.suptitle(f"Same images, raw vs normalised: histogram {result['width_factor']:.1f}× "
                 "wider for raw data", fontsize=10)
    fig.tight_layout()
    return save_figures(fig, out, "data_scaling", ("raw", "normalized"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="case-studies/data_scaling")
    args = parser.parse_args(argv)
    result = run(args.steps, args.out)
    for name in ("raw", "normalized"):
        r = result[name]
        codes = [f.code for f in r["findings"] if f.is_problem] or ["nothing"]
        print(f"{name:>10}: RMS of individual gradient elements {r['rms']:.3g} (first layer "
              f"{r['first_layer_rms']:.3g}), {r['outside']:.3%} beyond the histogram's "
              f"range ±{r['output'][max(r['output'])]['GradHist1d']['range']:.3g}; diagnose names "
              f"{', '.join(codes)}")
    print(f"raw-data histogram is {result['width_factor']:.1f}× wider (first "
          f"{COMPARE_STEPS} steps, same initial weights)")
    print("figures: " + ", ".join(str(p) for p in result["figures"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
