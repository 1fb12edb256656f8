"""Every threshold of the diagnosis, with the reason for its value.

Calibrated on the bug zoo (``benchmarks/diagnosis.py``, table in benchmarks/RESULTS.md):
runs of 60–80 steps, economy tracked every step. Change a value here and re-run the zoo.
"""

# ---------------------------------------------------------------------- general
#: A check needs at least this many recorded steps: a statistic of two or three steps is
#: one noisy sample, not a trend.
MIN_STEPS = 8
#: The first share of the steps is left out where a check looks for persistent behaviour:
#: the first steps from a random initialisation are atypical (α, gradient norms settle).
WARMUP_SHARE = 0.2
#: "Persistently" means at this share of the remaining steps or more: a majority, so that
#: a few noisy steps neither raise nor suppress a finding.
PERSISTENT_SHARE = 0.6

# ---------------------------------------------------------------------- learning rate
#: α > 1: the step ended higher up the other side of the fitted parabola than it started
#: (eq. 10); healthy runs stay mostly in [−1, 1] (paper Fig. 5: the best runs have mean α
#: slightly above 0).
ALPHA_OVERSHOOT = 1.0
#: Share of steps with α above ALPHA_OVERSHOOT that names an overshooting learning rate.
ALPHA_OVERSHOOT_SHARE = 0.5
#: lr·λ_max > 2: gradient descent on a quadratic diverges along the sharpest direction.
LR_TIMES_LAMBDA_MAX = 2.0
#: A loss at this multiple of its start (median of the first three steps) right after a
#: step with α > ALPHA_OVERSHOOT is an overshoot; healthy runs in the zoo never exceed 1.1×,
#: overshooting ones reach 3.9–5×.
LOSS_SPIKE = 1.5
#: How many steps before the loss spike a step with α > ALPHA_OVERSHOOT is looked for
#: (momentum carries an overshoot over a few steps).
SPIKE_LOOKBACK = 3
#: Σ_t ‖g_B,t‖·‖s_t‖ (the first-order bound on what the steps can change) below this share
#: of the loss: even straight downhill, the whole run could not move the loss by 20 %.
#: Zoo: crawling runs 6e-5–0.07; healthy runs ≥ 1.4; plateaus of other bugs ≥ 0.38.
LR_SMALL_REACH = 0.2
#: "The loss barely moves": it fell by less than this share from the first to the last fifth
#: of the run. A run whose loss falls by more is making progress, whatever α says.
LOSS_PROGRESS = 0.05
#: lr_too_small needs this many steps: the first-order reach Σ‖g_B‖·‖s‖ grows with the steps,
#: so early in a run a slow start reads as a crawl (SGD lr 0.01 with momentum on digits did
#: at 20 steps; a run on random labels, whose loss cannot fall, at 8).
LR_SMALL_MIN_STEPS = 24
#: Where Alpha is recorded, lr_too_small also needs its median at or below this: α toward −1
#: says the steps end near where they started on the fitted parabola; a median near 0 says
#: they reach the valley floor, so a loss that does not fall is not the learning rate's
#: fault (random labels, a plateau). Not −0.5 or −0.25: a tiny SGD step's fit is noise-dominated
#: (zoo: SGD lr 1e-5 on digits −0.45, SGD lr 1e-4 on logreg −0.16 … −0.20; healthy runs
#: −0.9 … −0.03, so α alone names nothing; random labels on an MLP: −0.02 … −0.11).
LR_SMALL_ALPHA = -0.1

# ---------------------------------------------------------------------- gradient scale
#: Root-mean-square of one input element seen by the first layer (standardized data: ≈ 1;
#: raw 8-bit pixels: ≈ 100; the digits' raw 0…16 pixels: ≈ 7). Above 4 the inputs are
#: several times their standardized scale.
INPUT_RMS = 4.0
#: A weight layer whose mini-batch gradient elements are this many times smaller (RMS,
#: median over the run) than the largest layer's "barely learns": two orders of magnitude.
#: Healthy MLPs and CNNs in the zoo stay within a factor 6 (21 for a CNN trained without
#: zero_grad); sigmoid stacks of 6–8 layers reach 10^3–10^6.
VANISHING_RATIO = 100.0
#: ‖g_B‖ persistently above this is huge for the usual losses (cross-entropy's gradient
#: w.r.t. the logits has norm ≤ √2 per sample; healthy runs in the zoo stay below 5).
GRADNORM_HUGE = 100.0
#: ‖g_B‖ growing this many times over its start is exploding, whatever its absolute size.
GRADNORM_GROWTH = 1e3

# ---------------------------------------------------------------------- units
#: A layer with at least this share of dead units (zero gradient for every sample).
DEAD_UNIT_SHARE = 0.5
#: Steps with fewer samples are not read for dead units: with a handful of samples a living
#: ReLU unit is inactive on all of them by chance (probability ≈ 2^−|B| for a unit active
#: half of the time, and far more for a sparse layer).
DEAD_MIN_BATCH = 16
#: frozen_parameters needs at least this many recorded updates of exactly zero.
FROZEN_MIN_STEPS = 5
#: A parameter's gradient norm below this share of the network's is rounding noise, not a
#: gradient that should move it: a bias right before a BatchNorm gets exactly 0 in exact
#: arithmetic, ~3e-8 of the network's gradient norm in float32, and its update vanishes in
#: the rounding of the parameter (UpdateSize 0) although it is in the optimizer.
FROZEN_GRADIENT_SHARE = 1e-5

# ---------------------------------------------------------------------- update ratio
#: A weight layer whose ‖Δθ‖/‖θ‖ is this many times the median of the other weight layers'
#: (at a persistent share of the steps) learns faster than the rest. Healthy runs reach
#: 3.3× in the zoo (one conv layer of a CNN under AdamW) and 5.7× in the activations case
#: study (the first layer of a ReLU CNN on raw digits); a layer at 100× the learning rate
#: reaches ≈ 50× under SGD with momentum but only 7–8× under Adam/AdamW (its weights grow,
#: which pulls the ratio back): those are not named — no threshold separates them from
#: healthy runs.
UPDATE_RATIO_FASTER = 10.0
#: The same the other way: a layer at 1/20 of the others' ratio barely learns (healthy runs:
#: ≥ 1/2.9; not exercised by a zoo case, hence the wider margin).
UPDATE_RATIO_SLOWER = 20.0
#: The median of fewer other weight tensors is no baseline: in a healthy two-layer network
#: with BatchNorm the last layer moved 5.9× as fast as the first (relative to its size).
UPDATE_RATIO_MIN_OTHERS = 2
#: ‖Δθ‖/‖θ‖ at or above this changes a layer by a third of itself per step, 300× the
#: ≈ 1e-3 rule of thumb (healthy runs in the zoo: ≤ 0.05 over their first 60 steps).
UPDATE_RATIO_HUGE = 0.3

# ---------------------------------------------------------------------- accumulation
#: missing_zero_grad reads GradientHeld (0 or 1 per tracked step: direct evidence), so it
#: needs no threshold of its own beyond PERSISTENT_SHARE: GradientMismatch is not thresholded
#: because editing gradients on purpose (clip_grad_value_ gives ≈ 0.37) makes it positive too.

# ---------------------------------------------------------------------- noise
#: NormTest θ at or above this: the mini-batch gradient's squared norm is ≥ 90 % noise
#: (θ² is the noise share, see rules/noise.py).
NORM_TEST_NOISE = 0.95
#: Median InnerTest at or above this with θ ≈ 1: the samples disagree along the batch
#: gradient, so it is a too-small batch and not a plateau (pure noise gives ≈ 0, see
#: rules/noise.py). Zoo: plateaus 0.02–0.10, batches of 2–4: 0.13–0.28.
INNER_TEST_SIGNAL = 0.12
#: Mean |Δloss| between consecutive steps at or above this share of the mean loss: the
#: mini-batch loss jumps by a tenth of itself from batch to batch. Zoo: batches of 2–4:
#: 0.12–0.41; the same batch every step (no sampling noise) or a plateau: ≤ 0.02.
LOSS_JITTER = 0.1
#: The loss over the noisy steps still falls to at most this share (the median of their
#: last third against that of their first): the run makes progress through the noise, so the
#: batch is not too small for it (a digits MLP trained to a train loss of 0.02 has θ ≥ 0.95 at
#: most late steps, the loss jumping by a large share of its small value). Zoo: batches of
#: 2–4 keep ≥ 0.6 of their loss.
NOISY_LOSS_PROGRESS = 0.5
