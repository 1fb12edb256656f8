"""``cockpit demo``: train a small CNN on scikit-learn's digits with Cockpit attached.

Real data shipped with a package (no download): 1,437 training images of 8×8 digits. The
run log goes to ``--logdir``; the cockpit view is drawn to ``<logdir>/cockpit_view.png``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from cockpit import Cockpit, configuration
from cockpit.benchmark.problems.digits import digits_cnn, load_digits_tensors, minibatches

DESCRIPTION = """Train a small CNN on scikit-learn's digits with Cockpit attached.

Real data shipped with a package (no download): 1,437 training images of 8x8 digits, SGD
with momentum, the economy instruments. Prints a summary table, writes the run log to
--logdir and draws the cockpit view to <logdir>/cockpit_view.png. Seeded and run on one
thread: every run gives the same numbers."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cockpit demo", description=DESCRIPTION,
                                formatter_class=_HelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch-size", type=int, default=64, help="images per mini-batch")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--track-every", type=int, default=1,
                   help="compute the instruments every k steps")
    p.add_argument("--logdir", default=None,
                   help="run directory (default: cockpit-runs/demo-<time>)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initialization, the data split and the batch order")
    p.add_argument("--no-plot", action="store_true", help="do not draw the cockpit view")
    return p


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, every option's default shown."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


FIRST_TRACKED_STEP = ("first tracked step: timing 3 ways to form each convolution's "
                      "individual gradients (once per layer shape, a few seconds)")


def run_demo(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # One thread: the order of torch's CPU reductions depends on the thread count, and the
    # training amplifies its last-bit differences (1e-7 of the loss after 100 steps); with
    # one thread every run of the same torch build gives the same numbers (and the small
    # network trains as fast on a busy machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_and_report(args)
    finally:
        torch.set_num_threads(threads)


def _train_and_report(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits_tensors(args.seed)
    model = digits_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    logdir = Path(args.logdir or f"cockpit-runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    cockpit = Cockpit(model, configuration("economy", args.track_every), optimizer=opt,
                      logdir=str(logdir))
    batches = minibatches(x_train, y_train, args.batch_size, args.seed)
    progress = tqdm(range(args.steps), desc="training with Cockpit", unit="step")
    for step in progress:
        x, y = next(batches)
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        if step == 0:  # Cockpit picks its fastest convolution kernels: the bar would freeze
            progress.set_postfix_str(FIRST_TRACKED_STEP)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        # the loss of this step (tqdm redraws at most every 0.1 s)
        progress.set_postfix(loss=f"{losses.mean().item():.3f}", refresh=False)
    cockpit.close()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(summary(cockpit.get_output(), accuracy))
    print(f"\nrun log: {logdir}/cockpit.sqlite")
    if not args.no_plot:
        try:
            from cockpit.view import plot_run

            figure_path = logdir / "cockpit_view.png"
            plot_run(logdir, figure_path)
            print(f"cockpit view: {figure_path}")
        except Exception as error:  # the demo's training result stands without the figure
            print(f"(could not draw the cockpit view: {error})")
    print(f"live view: cockpit view {logdir}    (then open http://127.0.0.1:8050)")
    print(f"export:    cockpit export {logdir} --format json")
    return 0


SUMMARY_ROWS = [
    ("Loss", "mini-batch loss"),
    ("GradNorm", "‖g_B‖, mini-batch gradient norm"),
    ("Distance", "‖θ_t − θ_0‖, distance from the start"),
    ("UpdateSize", "‖θ_{t+1} − θ_t‖, size of the step taken"),
    ("NormTest", "norm test: gradient noise radius"),
    ("InnerTest", "inner-product test: parallel noise"),
    ("OrthoTest", "orthogonality test: orthogonal noise"),
    ("Alpha", "α: −1 undershoot … 0 valley floor … +1 overshoot"),
]


def summary(output: dict, accuracy: float | None = None) -> str:
    """A readable table of the instruments at the first, middle and last tracked step."""
    steps = sorted(output)
    if not steps:
        return "no tracked steps"
    picks = sorted({steps[0], steps[len(steps) // 2], steps[-1]})
    lines = ["", "Cockpit summary"]
    header = f"{'instrument':<46}" + "".join(f"{'step ' + str(s):>12}" for s in picks)
    lines += [header, "-" * len(header)]
    for name, description in SUMMARY_ROWS:
        if not any(name in output[s] for s in picks):
            continue
        cells = []
        for s in picks:
            value = output[s].get(name)
            cells.append(f"{value:>12.4g}" if isinstance(value, float) and
                         not math.isnan(value) else f"{'—':>12}")
        lines.append(f"{description:<46}" + "".join(cells))
    hist = output[steps[-1]].get("GradHist1d")
    if isinstance(hist, dict):
        from cockpit.view._hist import Histogram

        counts, edges = hist["counts"], hist["edges"]
        if counts.sum() > 0:
            spread = Histogram(steps[-1], counts.astype(float), edges).central(0.99)
            lines.append(f"{'99 % of individual gradient elements within ±':<46}"
                         f"{spread:>12.3g}   (GradHist1d, last step)")
    if accuracy is not None:
        lines.append(f"\ntest accuracy after training: {accuracy:.1%}")
    return "\n".join(lines)
