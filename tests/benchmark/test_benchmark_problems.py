"""DeepOBS test problems: every problem builds with DeepOBS's published parameter counts,
runs a forward/backward step on synthetic data, and its loss, regularizer and accuracy agree
with independent formulas; a few run with Cockpit attached.

Parameter counts are the per-tensor lists DeepOBS's own tests assert (files of
github.com/fsschneider/DeepOBS, cited per problem), compared as multisets because the order
in which torch modules register parameters differs from TensorFlow's variable order.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cockpit import Cockpit, configuration, quantities
from cockpit.benchmark.problems import get_problem, list_problems
from cockpit.benchmark.problems.base import regularized_parameters
from tests.reference import gradient_tests

pytestmark = pytest.mark.usefixtures("one_thread")


def _conv(c_in, c_out, kh, kw=None):
    return [c_in * c_out * kh * (kh if kw is None else kw), c_out]


def _dense(n_in, n_out):
    return [n_in * n_out, n_out]


def _vgg(depth, classes):
    """deepobs/tensorflow/tests/testproblems/test_{cifar10,cifar100,imagenet}_vgg{16,19}.py:
    conv kernels + biases per layer, then 512·7·7→4096→4096→classes."""
    counts = (2, 2, 3, 3, 3) if depth == 16 else (2, 2, 4, 4, 4)
    out, c_in = [], 3
    for filters, n in zip((64, 128, 256, 512, 512), counts, strict=True):
        for _ in range(n):
            out += _conv(c_in, filters, 3)
            c_in = filters
    return out + _dense(512 * 7 * 7, 4096) + _dense(4096, 4096) + _dense(4096, classes)


def _wrn(depth, k, classes):
    """deepobs/pytorch/tests/testproblems/test_svhn_wrn164.py (WRN-16-4): first conv, then
    per group: BN (γ, β), 1×1 shortcut conv, 3×3 conv, BN, 3×3 conv, and per further unit
    BN, conv, BN, conv; final BN and dense. WRN-40-4 follows the same rule with 6 units."""
    units = (depth - 4) // 6
    widths = [16, 16 * k, 32 * k, 64 * k]
    out = [3 * 16 * 9]
    for g in range(1, 4):
        out += [widths[g - 1]] * 2 + [widths[g - 1] * widths[g]] \
            + [widths[g - 1] * widths[g] * 9] + [widths[g]] * 2 + [widths[g] ** 2 * 9]
        for _ in range(units - 1):
            out += [widths[g]] * 2 + [widths[g] ** 2 * 9] + [widths[g]] * 2 \
                + [widths[g] ** 2 * 9]
    return out + [widths[3]] * 2 + _dense(widths[3], classes)


def _bn(c):
    return [c, c]


def _inception():
    """deepobs/tensorflow/tests/testproblems/test_imagenet_inception_v3.py: every conv is a
    bias-free kernel followed by BN (β, γ); the auxiliary and final dense layers have 1,001
    outputs."""
    def cbn(c_in, c_out, kh, kw=None):
        return [c_in * c_out * kh * (kh if kw is None else kw), *_bn(c_out)]
    out = (cbn(3, 32, 3) + cbn(32, 32, 3) + cbn(32, 64, 3) + cbn(64, 80, 1) + cbn(80, 192, 3))
    for c_in, pool in ((192, 32), (256, 64), (288, 64)):
        out += (cbn(c_in, 64, 1) + cbn(c_in, pool, 1) + cbn(c_in, 48, 1) + cbn(48, 64, 5)
                + cbn(c_in, 64, 1) + cbn(64, 96, 3) + cbn(96, 96, 3))
    out += cbn(288, 384, 3) + cbn(288, 64, 1) + cbn(64, 96, 3) + cbn(96, 96, 3)
    for n in (128, 160, 160, 192):
        out += (cbn(768, 192, 1) + cbn(768, 192, 1) + cbn(768, n, 1) + cbn(n, n, 1, 7)
                + cbn(n, 192, 7, 1) + cbn(768, n, 1) + cbn(n, n, 7, 1) + cbn(n, n, 1, 7)
                + cbn(n, n, 7, 1) + cbn(n, 192, 1, 7))
    out += cbn(768, 128, 1) + cbn(128, 768, 5) + _dense(768, 1001)
    out += (cbn(768, 192, 1) + cbn(192, 192, 1, 7) + cbn(192, 192, 7, 1) + cbn(192, 192, 3)
            + cbn(768, 192, 1) + cbn(192, 320, 3))
    for c_in in (1280, 2048):
        out += (cbn(c_in, 320, 1) + cbn(c_in, 384, 1) + cbn(384, 384, 1, 3) + cbn(384, 384, 3, 1)
                + cbn(c_in, 448, 1) + cbn(448, 384, 3) + cbn(384, 384, 1, 3)
                + cbn(384, 384, 3, 1) + cbn(c_in, 192, 1))
    return out + _dense(2048, 1001)


LOGREG = _dense(784, 10)  # deepobs/tensorflow/tests/testproblems/test_mnist_logreg.py
MLP = (_dense(784, 1000) + _dense(1000, 500) + _dense(500, 100)  # test_fmnist_mlp.py
       + _dense(100, 10))
TWO_C_TWO_D = (_conv(1, 32, 5) + _conv(32, 64, 5) + _dense(7 * 7 * 64, 1024)  # test_*_2c2d.py
               + _dense(1024, 10))
VAE = [1 * 64 * 4 * 4, 64, 64 * 64 * 4 * 4, 64, 64 * 64 * 4 * 4, 64,  # test_mnist_vae.py
       7 * 7 * 64 * 8, 8, 7 * 7 * 64 * 8, 8, 8 * 24, 24, 24 * 49, 49,
       1 * 64 * 4 * 4, 64, 64 * 64 * 4 * 4, 64, 64 * 64 * 4 * 4, 64,
       14 * 14 * 64 * 28 * 28, 28 * 28]


def _three_c_three_d(classes):
    """deepobs/pytorch/tests/testproblems/test_cifar10_3c3d.py (10 classes; the 100-class
    variant differs in the last layer only)."""
    return (_conv(3, 64, 5) + _conv(64, 96, 3) + _conv(96, 128, 3) + _dense(3 * 3 * 128, 512)
            + _dense(512, 256) + _dense(256, classes))


ALL_CNN_C = (_conv(3, 96, 3) + _conv(96, 96, 3) * 2 + _conv(96, 192, 3)  # cifar100_allcnnc.py
             + _conv(192, 192, 3) * 3 + _conv(192, 192, 1) + _conv(192, 100, 1))
# the trainable variables of deepobs/tensorflow/testproblems/tolstoi_char_rnn.py: embedding,
# per layer the LSTMCell's kernel [128 + 128, 4·128] (here its two halves W_ih, W_hh) and one
# bias [4·128], softmax weights and bias
CHAR_RNN = [83 * 128, 4 * 128 * 128, 4 * 128 * 128, 4 * 128,
            4 * 128 * 128, 4 * 128 * 128, 4 * 128, 83 * 128, 83]

PUBLISHED = {
    "two_d_beale": [1, 1], "two_d_branin": [1, 1], "two_d_rosenbrock": [1, 1],
    "quadratic_deep": [100],  # deepobs/pytorch/tests/testproblems/test_quadratic_deep.py
    "mnist_logreg": LOGREG, "fmnist_logreg": LOGREG,
    "mnist_mlp": MLP, "fmnist_mlp": MLP,
    "mnist_2c2d": TWO_C_TWO_D, "fmnist_2c2d": TWO_C_TWO_D,
    "mnist_vae": VAE, "fmnist_vae": VAE,
    "cifar10_3c3d": _three_c_three_d(10), "cifar100_3c3d": _three_c_three_d(100),
    "svhn_3c3d": _three_c_three_d(10),
    "cifar10_vgg16": _vgg(16, 10), "cifar10_vgg19": _vgg(19, 10),
    "cifar100_vgg16": _vgg(16, 100), "cifar100_vgg19": _vgg(19, 100),
    "imagenet_vgg16": _vgg(16, 1001), "imagenet_vgg19": _vgg(19, 1001),
    "cifar100_allcnnc": ALL_CNN_C,
    "cifar100_wrn404": _wrn(40, 4, 100), "svhn_wrn164": _wrn(16, 4, 10),
    "imagenet_inception_v3": _inception(),
    "tolstoi_char_rnn": CHAR_RNN,
    # ours (no DeepOBS counterpart): see cockpit/benchmark/problems/digits.py
    "digits_logreg": _dense(64, 10),
    "digits_mlp": _dense(64, 256) + _dense(256, 128) + _dense(128, 10),
    "digits_cnn": _conv(1, 16, 3) + _conv(16, 32, 3) + _dense(512, 64) + _dense(64, 10),
}
# totals as DeepOBS states / its lists sum to (a second, order-free check)
TOTALS = {"mnist_mlp": 1_336_610, "fmnist_2c2d": 3_274_634, "cifar10_3c3d": 895_210,
          "cifar100_allcnnc": 1_387_108, "mnist_vae": 10_151_489, "svhn_wrn164": 2_748_890,
          "cifar10_vgg16": 134_301_514, "imagenet_vgg19": 143_671_337,
          "imagenet_inception_v3": 27_164_082, "tolstoi_char_rnn": 284_499}

# Inception-v3 in training mode needs ≥ 2 samples (its auxiliary head's BatchNorm sees one
# value per channel and sample); everything else runs on a single sample.
BATCH = {"imagenet_inception_v3": 2}


def test_every_listed_problem_has_a_published_count():
    assert sorted(PUBLISHED) == list_problems()
    expected_names = {
        "two_d_beale", "two_d_branin", "two_d_rosenbrock", "quadratic_deep",
        *(f"{d}_{m}" for d in ("mnist", "fmnist") for m in ("logreg", "mlp", "2c2d", "vae")),
        "cifar10_3c3d", "cifar10_vgg16", "cifar10_vgg19", "cifar100_3c3d", "cifar100_vgg16",
        "cifar100_vgg19", "cifar100_allcnnc", "cifar100_wrn404", "svhn_3c3d", "svhn_wrn164",
        "imagenet_vgg16", "imagenet_vgg19", "imagenet_inception_v3", "tolstoi_char_rnn",
        "digits_logreg", "digits_mlp", "digits_cnn"}
    assert set(list_problems()) == expected_names


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_problem_builds_with_published_parameters_and_trains_one_step(name):
    problem = get_problem(name, batch_size=BATCH.get(name, 1), seed=0)
    sizes = [p.numel() for p in problem.model.parameters() if p.requires_grad]
    assert sorted(sizes) == sorted(PUBLISHED[name])
    assert problem.num_parameters() == sum(PUBLISHED[name])
    if name in TOTALS:
        assert problem.num_parameters() == TOTALS[name]

    x, y = next(iter(problem.train_loader))
    assert x.shape[0] == BATCH.get(name, 1)
    output = problem.model(x)
    losses = problem.losses(output, y)
    assert losses.shape == (BATCH.get(name, 1),)
    assert torch.isfinite(losses).all()
    regularizer = problem.regularizer()
    assert regularizer.dim() == 0
    (losses.mean() + regularizer).backward()
    grads = [p.grad for p in problem.model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    accuracy = problem.accuracy(output, y)
    if problem.task in ("classification", "lm"):
        assert 0.0 <= float(accuracy) <= 1.0
    else:
        assert accuracy is None
    if name == "imagenet_inception_v3":
        _check_inception_loss(problem, output, y, losses)
    if problem.l2:
        _check_l2(problem, regularizer)


def _check_inception_loss(problem, output, y, losses):
    """ℓ = CE_ε(main) + 0.4 · CE_ε(aux) with label smoothing ε = 0.1 over 1,001 classes
    (DeepOBS imagenet_inception_v3.py), written out with log-softmax."""
    main, aux = (o.detach().double() for o in output)

    def smoothed_ce(logits):
        logp = torch.log_softmax(logits, dim=1)
        target = torch.full_like(logp, 0.1 / 1001)
        target[torch.arange(len(y)), y] += 0.9
        return -(target * logp).sum(dim=1)

    expected = smoothed_ce(main) + 0.4 * smoothed_ce(aux)
    torch.testing.assert_close(losses.detach().double(), expected, rtol=1e-5, atol=1e-5)


def _check_l2(problem, regularizer):
    """R = λ/2 Σ‖W‖² over the weight tensors DeepOBS regularizes (conv and dense kernels;
    for VGG and Inception-v3 the conv kernels only), never biases or BN parameters."""
    weights = regularized_parameters(problem.model)
    assert weights and all(w.dim() >= 2 for w in weights)
    if "vgg" in problem.name or "inception" in problem.name:
        assert all(w.dim() == 4 for w in weights)
    expected = 0.5 * problem.l2 * sum(float(w.detach().double().pow(2).sum()) for w in weights)
    assert float(regularizer.detach()) == pytest.approx(expected, rel=1e-5)


DEEPOBS_SETTINGS = {  # deepobs/info.py DEFAULT_TEST_PROBLEMS_SETTINGS, and the problems' L2
    "quadratic_deep": (128, 100, None), "mnist_vae": (64, 50, None),
    "fmnist_2c2d": (128, 100, None), "cifar10_3c3d": (128, 100, 0.002),
    "fmnist_vae": (64, 100, None), "cifar100_allcnnc": (256, 350, 5e-4),
    "cifar100_wrn404": (128, 160, 5e-4), "svhn_3c3d": (128, 100, 0.002),
    "svhn_wrn164": (128, 160, 5e-4), "tolstoi_char_rnn": (50, 200, None),
    "mnist_2c2d": (128, 100, None), "mnist_mlp": (128, 100, None),
    "fmnist_mlp": (128, 100, None), "mnist_logreg": (128, 50, None),
    "fmnist_logreg": (128, 50, None),
}


def test_settings_deepobs_defines_are_not_labelled_ours():
    """What deepobs/info.py defines is DeepOBS's, not ours (svhn_3c3d, cifar100_wrn404 and
    fmnist_logreg were labelled "ours")."""
    from cockpit.benchmark.problems.registry import REGISTRY

    for name, (batch_size, epochs, l2) in DEEPOBS_SETTINGS.items():
        spec = REGISTRY[name]
        assert (spec.batch_size, spec.num_epochs, spec.l2) == (batch_size, epochs, l2)
        assert "ours" not in spec.source, (name, spec.source)


@pytest.mark.parametrize("name", sorted(DEEPOBS_SETTINGS))
def test_deepobs_default_batch_size_epochs_and_l2(name):
    problem = get_problem(name)
    assert (problem.batch_size, problem.num_epochs, problem.l2) == DEEPOBS_SETTINGS[name]


def test_two_d_functions_match_their_formulas():
    """Test split has zero noise: the test loss is the deterministic function at the start
    point (DeepOBS: Beale (−4.5, 4.5), Branin (2.5, 12.5), Rosenbrock (−0.5, 1.5))."""
    u, v = -4.5, 4.5
    beale = (1.5 - u + u * v) ** 2 + (2.25 - u + u * v**2) ** 2 + (2.625 - u + u * v**3) ** 2
    u, v = 2.5, 12.5
    b, c, r, s, t = 5.1 / (4 * math.pi**2), 5 / math.pi, 6, 10, 1 / (8 * math.pi)
    branin = (v - b * u**2 + c * u - r) ** 2 + s * (1 - t) * math.cos(u) + s
    u, v = -0.5, 1.5
    rosenbrock = (1 - u) ** 2 + 100 * (v - u**2) ** 2
    for name, value in (("two_d_beale", beale), ("two_d_branin", branin),
                        ("two_d_rosenbrock", rosenbrock)):
        problem = get_problem(name, batch_size=5)
        x, y = next(iter(problem.test_loader))
        assert torch.equal(x, torch.zeros(5, 2))
        torch.testing.assert_close(problem.losses(problem.model(x), y),
                                   torch.full((5,), value, dtype=torch.float32))
        # with noise: ℓ_n = f + u·x_n + v·y_n
        x, y = next(iter(problem.valid_loader))
        (u0, v0) = (p.item() for p in problem.model.parameters())
        expected = value + u0 * x[:, 0].double() + v0 * x[:, 1].double()
        torch.testing.assert_close(problem.losses(problem.model(x), y).double(), expected,
                                   rtol=1e-5, atol=1e-2)
        # DeepOBS: 10,000 noise draws N(0, 1) with seed 42 for train, 44 for valid
        rng = np.random.RandomState(44)
        first = rng.normal(0.0, 1.0, 10_000)[:5]
        np.testing.assert_allclose(x[:, 0].numpy(), first, rtol=1e-6)
        assert problem.train_loader.num_samples == 10_000


def test_quadratic_deep_hessian_is_deepobs_matrix():
    """Q against a fixture written by an independent implementation of DeepOBS's published
    construction (tests/benchmark/fixtures/make_quadratic_deep_hessian.py), and the loss at
    θ = 1 for the data point x = 0: ½·1ᵀQ1 = 267.53 (a QR-drawn rotation gave 461.1)."""
    problem = get_problem("quadratic_deep", batch_size=8)
    fixture = np.load(Path(__file__).parent / "fixtures" / "quadratic_deep_hessian.npy")
    np.testing.assert_allclose(problem.model.hessian.double().numpy(), fixture,
                               rtol=0, atol=1e-5 * np.abs(fixture).max())
    at_zero = problem.losses(problem.model(torch.zeros(1, 100)), torch.zeros(1))
    assert float(at_zero.detach()) == pytest.approx(267.529, abs=2e-3)
    assert 0.5 * fixture.sum() == pytest.approx(267.5293, abs=1e-4)


def test_quadratic_deep_spectrum_and_loss():
    problem = get_problem("quadratic_deep", batch_size=8)
    hessian = problem.model.hessian.double()
    torch.testing.assert_close(hessian, hessian.T)
    eigenvalues = torch.linalg.eigvalsh(hessian)
    assert ((eigenvalues[:90] > 0) & (eigenvalues[:90] < 1)).all()
    assert ((eigenvalues[90:] > 30) & (eigenvalues[90:] < 60)).all()
    x, y = next(iter(problem.test_loader))
    theta = torch.ones(100, dtype=torch.float64)
    expected = torch.stack([0.5 * (theta - xi) @ hessian @ (theta - xi) for xi in x.double()])
    torch.testing.assert_close(problem.losses(problem.model(x), y).double(), expected,
                               rtol=1e-5, atol=1e-4)
    # DeepOBS: 1,000 points N(0, 0.6² I) with seed 43 for the test set, in order
    np.testing.assert_allclose(x.numpy(), np.random.RandomState(43).normal(0, 0.6, (1000, 100))[:8],
                               rtol=1e-6)


def test_classification_and_lm_losses_match_torch_reference():
    problem = get_problem("tolstoi_char_rnn", batch_size=3)
    x, y = next(iter(problem.train_loader))
    assert x.shape == y.shape == (3, 50)
    logits = problem.model(x)
    per_char = -torch.log_softmax(logits.double(), dim=2).gather(2, y[..., None])[..., 0]
    # (the problem's losses are float32: float32's tolerance, whatever the data drawn)
    torch.testing.assert_close(problem.losses(logits, y).double(), per_char.mean(dim=1),
                               rtol=1e-5, atol=1e-6)
    expected_accuracy = (logits.argmax(2) == y).double().mean()
    assert float(problem.accuracy(logits, y)) == pytest.approx(float(expected_accuracy))


def test_vae_loss_is_reconstruction_plus_kl():
    problem = get_problem("mnist_vae", batch_size=4)
    x, y = next(iter(problem.train_loader))
    assert torch.equal(x, y)  # the target is the image
    torch.manual_seed(0)
    reconstruction, mu, log_sigma = problem.model(x)
    losses = problem.losses((reconstruction, mu, log_sigma), y)
    sigma2 = torch.exp(2 * log_sigma.double())
    kl = 0.5 * (sigma2 + mu.double() ** 2 - 1 - torch.log(sigma2)).sum(dim=1)
    reconstruction_error = ((reconstruction.double() - x.double()) ** 2).sum(dim=(1, 2, 3))
    torch.testing.assert_close(losses.double(), reconstruction_error + kl, rtol=1e-5,
                               atol=1e-4)


def test_seed_controls_initialization_but_not_the_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = get_problem("digits_mlp", seed=1)
    after = torch.rand(1)
    assert torch.equal(before, after)
    b = get_problem("digits_mlp", seed=1)
    c = get_problem("digits_mlp", seed=2)
    wa, wb, wc = (next(p.model.parameters()) for p in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_unknown_problem_and_bad_arguments_say_what_to_do():
    with pytest.raises(KeyError, match="cifar10_3c3d"):
        get_problem("cifar10_3cd3")
    with pytest.raises(ValueError, match="'synthetic' or 'real'"):
        get_problem("digits_cnn", data="imagenet")
    with pytest.raises(ValueError, match="batch_size"):
        get_problem("digits_cnn", batch_size=0)


def test_synthetic_labels_are_learnable():
    """The synthetic stand-in is not pure noise: a few epochs of SGD on digits_logreg
    (synthetic, 8×8) beat chance clearly on the held-out test split."""
    problem = get_problem("digits_logreg", batch_size=16, seed=0)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
    for _ in range(5):
        for x, y in problem.train_loader:
            opt.zero_grad()
            problem.losses(problem.model(x), y).mean().backward()
            opt.step()
    with torch.no_grad():
        correct = sum(int((problem.model(x).argmax(1) == y).sum()) for x, y in problem.test_loader)
    assert correct / problem.test_loader.num_samples > 0.5


@pytest.mark.parametrize("name", ["digits_cnn", "cifar10_3c3d", "two_d_rosenbrock",
                                  "quadratic_deep", "mnist_vae"])
def test_economy_cockpit_runs_on_problem(name):
    problem = get_problem(name, batch_size=4)
    opt = torch.optim.SGD(problem.model.parameters(), lr=1e-3)
    cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt)
    batch_losses = []
    for step, (x, y) in zip(range(2), problem.train_loader, strict=False):
        opt.zero_grad()
        losses = problem.losses(problem.model(x), y)
        with cockpit(step, losses=losses):
            (losses.mean() + problem.regularizer()).backward()
        opt.step()
        batch_losses.append(float(losses.detach().mean()))
    cockpit.close()
    first = cockpit.get_output()[0]
    notes = cockpit.get_notes().get(0, {})
    assert not any("not computed" in note for note in notes.values()), notes
    assert first["Loss"] == pytest.approx(batch_losses[0], rel=1e-6)
    for key in ("GradNorm", "NormTest", "InnerTest", "OrthoTest", "Alpha", "GradHist1d"):
        assert first[key] is not None, key


def test_cockpit_on_char_rnn_gives_exact_per_sample_instruments():
    """The char-RNN's LSTMs (dropout drawn between them, outside the recurrent layers) get
    individual gradients: NormTest against one backward pass per sequence, with the same
    dropout masks (replayed from the same seed) and the same initial state."""
    problem = get_problem("tolstoi_char_rnn", batch_size=3)
    model = problem.model.double()
    x, y = next(iter(problem.train_loader))
    cockpit = Cockpit(model, [quantities.Loss(), quantities.GradNorm(),
                              quantities.NormTest()], strict=True)
    torch.manual_seed(5)
    losses = problem.losses(model(x), y)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    out = cockpit.get_output()[0]
    rows = []
    for n in range(len(x)):  # the same masks: dropout of sample n in the batch call
        model.zero_grad()
        model.reset_state()
        torch.manual_seed(5)
        (problem.losses(model(x), y)[n]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()
                               if p.requires_grad]))
    G = torch.stack(rows)
    expected = gradient_tests(G)["NormTest"]
    assert out["NormTest"] == pytest.approx(expected, rel=1e-8)
    assert out["GradNorm"] == pytest.approx(float(G.mean(0).norm()), rel=1e-8)


def test_char_rnn_is_initialized_as_the_tensorflow_original():
    """Glorot-uniform limits √(6/(fan_in + fan_out)) of TF's variables (values within the
    limit, standard deviation limit/√3), zero biases, bias_hh frozen; and one LSTM step
    equals TensorFlow's LSTMCell written out (gates i, j, f, o of [x, h]·K + b, forget
    gate σ(f + 1), b = 0) with K assembled from the layer's weights."""
    model = get_problem("tolstoi_char_rnn", batch_size=2, seed=3).model

    def uniform(w, limit):
        w = w.detach().double()
        assert float(w.abs().max()) <= limit
        assert float(w.std()) == pytest.approx(limit / math.sqrt(3), rel=0.05)

    uniform(model.embedding.weight, math.sqrt(6 / (83 + 128)))
    uniform(model.dense.weight, math.sqrt(6 / (128 + 83)))
    uniform(model.dense.bias, math.sqrt(6 / (83 + 83)))
    for layer in model.lstm:
        for w in (layer.weight_ih_l0, layer.weight_hh_l0):
            uniform(w, math.sqrt(6 / (256 + 512)))
        expected_bias = torch.zeros(512)
        expected_bias[128:256] = 1.0
        assert torch.equal(layer.bias_ih_l0.detach(), expected_bias)
        assert torch.equal(layer.bias_hh_l0.detach(), torch.zeros(512))
        assert layer.bias_hh_l0.requires_grad is False

    layer = model.lstm[0].double()
    x = torch.randn(2, 1, 128, dtype=torch.float64)
    h0, c0 = torch.randn(2, 128, dtype=torch.float64), torch.randn(2, 128, dtype=torch.float64)
    w_i, w_f, w_g, w_o = torch.cat([layer.weight_ih_l0, layer.weight_hh_l0], 1).detach().chunk(4)
    kernel = torch.cat([w_i, w_g, w_f, w_o]).T  # TF's order i, j, f, o; [x, h] @ K
    i, j, f, o = (torch.cat([x[:, 0], h0], 1) @ kernel).chunk(4, dim=1)
    c1 = torch.sigmoid(f + 1.0) * c0 + torch.sigmoid(i) * torch.tanh(j)
    h1 = torch.sigmoid(o) * torch.tanh(c1)
    out, (h, c) = layer(x, (h0[None], c0[None]))
    torch.testing.assert_close(h[0], h1)
    torch.testing.assert_close(c[0], c1)
    torch.testing.assert_close(out[:, 0], h1)


def test_cross_entropy_reference_on_cifar_batch():
    problem = get_problem("cifar10_3c3d", batch_size=3)
    x, y = next(iter(problem.test_loader))
    logits = problem.model(x)
    expected = F.nll_loss(torch.log_softmax(logits.double(), 1), y, reduction="none")
    torch.testing.assert_close(problem.losses(logits, y).double(), expected)


@pytest.mark.parametrize("stride, size", [(2, 7), (1, 14)])
def test_vae_transposed_convolution_is_the_adjoint_of_tf_same_convolution(stride, size):
    """TensorFlow's conv2d_transpose(padding="same") is the adjoint of conv2d(padding="same")
    (pad ⌊t/2⌋ before and ⌈t/2⌉ after, t = (out − 1)·s + k − in): ⟨conv(x), y⟩ = ⟨x, convᵀ(y)⟩."""
    from cockpit.benchmark.problems.small_nets import _SameConvTranspose

    torch.manual_seed(0)
    layer = _SameConvTranspose(3, 5, 4, stride).double()
    torch.nn.init.zeros_(layer.conv.bias)
    y = torch.randn(2, 3, size, size, dtype=torch.float64)
    out = layer(y)
    assert out.shape == (2, 5, size * stride, size * stride)
    x = torch.randn_like(out)
    total = (size - 1) * stride + 4 - size * stride
    padded = F.pad(x, (total // 2, total - total // 2, total // 2, total - total // 2))
    forward = F.conv2d(padded, layer.conv.weight, stride=stride)  # weight [in, out, k, k]
    assert forward.shape == y.shape
    torch.testing.assert_close((forward * y).sum(), (x * out).sum())


def test_cockpit_watches_batchnorm_problems_without_per_sample_instruments():
    """WRNs use BatchNorm in training mode: individual gradients are undefined. Cockpit says so
    once (with the way out), records the per-sample instruments as None with the reason and
    computes the others (the run is never stopped)."""
    problem = get_problem("svhn_wrn164", batch_size=2)
    opt = torch.optim.SGD(problem.model.parameters(), lr=1e-3)
    with pytest.warns(RuntimeWarning, match="BatchNorm.*(eval mode|GroupNorm)"):
        cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt)
    x, y = next(iter(problem.train_loader))
    opt.zero_grad()
    losses = problem.losses(problem.model(x), y)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    grad_norm = torch.cat([p.grad.reshape(-1).double() for p in problem.model.parameters()]).norm()
    opt.step()
    cockpit.close()
    out, notes = cockpit.get_output()[0], cockpit.get_notes()[0]
    assert out["GradNorm"] == pytest.approx(float(grad_norm), rel=1e-5)
    assert out["NormTest"] is None and "BatchNorm" in notes["NormTest"]


def test_bench_list_shows_data_model_parameters_batch_size_and_epochs(capsys):
    from cockpit.benchmark.cli import main_bench

    assert main_bench(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:] if line.split()
            and line.split()[0] in PUBLISHED}
    assert sorted(rows) == list_problems()
    for name, row in rows.items():
        assert f" {sum(PUBLISHED[name]):,} " in row, row
    assert rows["cifar10_3c3d"].split() == ["cifar10_3c3d", "CIFAR-10", "3c3d", "CNN",
                                            "895,210", "128", "100"]
    assert rows["tolstoi_char_rnn"].split()[-3:] == ["284,499", "50", "200"]
    assert rows["two_d_beale"].split()[-1] == "ours"
