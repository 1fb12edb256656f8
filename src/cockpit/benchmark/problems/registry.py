"""The catalogue of test problems: one :class:`ProblemSpec` per name.

Batch sizes and epochs are DeepOBS's defaults (``deepobs/config.py`` and ``deepobs/info.py``,
``DEFAULT_TEST_PROBLEMS_SETTINGS``) where DeepOBS defines them; the others (marked
"ours" in ``source``) follow the closest DeepOBS problem. L2 factors λ are those of the
DeepOBS test-problem classes (weight decay 0.002 for 3C3D, 5·10⁻⁴ for VGG, All-CNN-C, Wide
ResNets and Inception-v3; none for the rest).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from cockpit.benchmark.problems import data as datasets
from cockpit.benchmark.problems import functions, large_nets, small_nets
from cockpit.benchmark.problems.base import (
    BatchLoader,
    Splits,
    TestProblem,
    train_eval_stream,
)
from cockpit.benchmark.problems.digits import (
    digits_cnn,
    digits_logreg,
    digits_mlp,
    digits_splits,
)

SplitBuilder = Callable[..., Splits]


@dataclass(frozen=True)
class ProblemSpec:
    name: str
    task: str
    batch_size: int
    num_epochs: int
    l2: float | None
    build_model: Callable[[], nn.Module]
    # (data, data_dir, batch_size, seed, device, on_start) -> Splits; on_start() is called
    # when a loader begins an epoch (resets a stateful model)
    build_splits: SplitBuilder
    num_classes: int | None = None
    source: str = "DeepOBS"
    label_smoothing: float = 0.0
    aux_weight: float = 0.0


REGISTRY: dict[str, ProblemSpec] = {}


def register(spec: ProblemSpec) -> ProblemSpec:
    if spec.name in REGISTRY:
        raise ValueError(f"test problem {spec.name!r} is already registered")
    REGISTRY[spec.name] = spec
    return spec


# --- split builders ----------------------------------------------------------------------
def _function_splits(train, valid, test):
    """Noise splits of the analytic problems; train_eval is N_train // B batches of the
    reshuffled training stream (DeepOBS)."""
    def build(data, data_dir, batch_size, seed, device, on_start=None) -> Splits:
        def loader(x, train_mode=False):
            return BatchLoader(x, torch.zeros(len(x)), batch_size, shuffle=train_mode,
                               drop_last=True, seed=seed, device=device)
        train_loader = loader(train, True)
        return Splits(train=train_loader,
                      train_eval=train_eval_stream(train_loader, len(train), seed),
                      valid=loader(valid), test=loader(test))
    return build


def _two_d_splits(data, data_dir, batch_size, seed, device, on_start=None) -> Splits:
    return _function_splits(*functions.two_d_data())(data, data_dir, batch_size, seed, device)


def _quadratic_splits(data, data_dir, batch_size, seed, device, on_start=None) -> Splits:
    return _function_splits(*functions.quadratic_data())(data, data_dir, batch_size, seed,
                                                         device)


def _mnist(name: str, autoencoder: bool = False) -> SplitBuilder:
    def build(data, data_dir, batch_size, seed, device, on_start=None) -> Splits:
        return datasets.mnist_like(name, data, data_dir, batch_size, seed, device,
                                   autoencoder=autoencoder)
    return build


def _cifar(num_classes: int) -> SplitBuilder:
    def build(data, data_dir, batch_size, seed, device, on_start=None) -> Splits:
        return datasets.cifar(num_classes, data, data_dir, batch_size, seed, device)
    return build


def _svhn(data, data_dir, batch_size, seed, device, on_start=None) -> Splits:
    return datasets.svhn(data, data_dir, batch_size, seed, device)


def _imagenet(data, data_dir, batch_size, seed, device, on_start=None) -> Splits:
    return datasets.imagenet(data, data_dir, batch_size, seed, device)


def _tolstoi(data, data_dir, batch_size, seed, device, on_start=None) -> Splits:
    return datasets.tolstoi(data, data_dir, batch_size, seed, device, on_start=on_start)


def _digits(data, data_dir, batch_size, seed, device, on_start=None) -> Splits:
    return digits_splits(data, data_dir, batch_size, seed, device)


# --- the problems ------------------------------------------------------------------------
for _kind in ("beale", "branin", "rosenbrock"):
    register(ProblemSpec(
        f"two_d_{_kind}", "function", 128, 100, None,
        (lambda kind=_kind: functions.NoisyFunction2D(kind)), _two_d_splits,
        source="DeepOBS two_d_*; batch size and epochs ours (DeepOBS sets none)"))

register(ProblemSpec(
    "quadratic_deep", "function", 128, 100, None,
    lambda: functions.NoisyQuadratic(functions.deep_learning_hessian()), _quadratic_splits))

for _data in ("mnist", "fmnist"):
    register(ProblemSpec(f"{_data}_logreg", "classification", 128, 50, None,
                         small_nets.mnist_logreg, _mnist(_data), 10,
                         source="DeepOBS"))
    register(ProblemSpec(f"{_data}_mlp", "classification", 128, 100, None,
                         small_nets.mnist_mlp, _mnist(_data), 10))
    register(ProblemSpec(f"{_data}_2c2d", "classification", 128, 100, None,
                         small_nets.fmnist_2c2d, _mnist(_data), 10))
    register(ProblemSpec(f"{_data}_vae", "vae", 64, 50 if _data == "mnist" else 100, None,
                         small_nets.mnist_vae, _mnist(_data, autoencoder=True)))

register(ProblemSpec("cifar10_3c3d", "classification", 128, 100, 0.002,
                     small_nets.cifar10_3c3d, _cifar(10), 10))
register(ProblemSpec("cifar100_3c3d", "classification", 128, 350, 0.002,
                     small_nets.cifar100_3c3d, _cifar(100), 100,
                     source="DeepOBS; epochs ours (as cifar100_allcnnc)"))
register(ProblemSpec("svhn_3c3d", "classification", 128, 100, 0.002,
                     small_nets.svhn_3c3d, _svhn, 10))

for _depth in (16, 19):
    for _classes in (10, 100):
        register(ProblemSpec(
            f"cifar{_classes}_vgg{_depth}", "classification", 128, 350, 5e-4,
            (lambda d=_depth, c=_classes: large_nets.VGG(d, c)), _cifar(_classes), _classes,
            source="DeepOBS; batch size and epochs ours"))
    register(ProblemSpec(
        f"imagenet_vgg{_depth}", "classification", 128, 100, 5e-4,
        (lambda d=_depth: large_nets.VGG(d, 1001)), _imagenet, 1001,
        source="DeepOBS; batch size and epochs ours"))
register(ProblemSpec("cifar100_allcnnc", "classification", 256, 350, 5e-4,
                     large_nets.all_cnn_c, _cifar(100), 100))
register(ProblemSpec("cifar100_wrn404", "classification", 128, 160, 5e-4,
                     lambda: large_nets.wide_resnet(40, 4, 100), _cifar(100), 100))
register(ProblemSpec("svhn_wrn164", "classification", 128, 160, 5e-4,
                     lambda: large_nets.wide_resnet(16, 4, 10), _svhn, 10))
register(ProblemSpec("imagenet_inception_v3", "classification", 128, 100, 5e-4,
                     large_nets.InceptionV3, _imagenet, 1001,
                     source="DeepOBS (label smoothing 0.1, auxiliary loss 0.4); batch size and "
                            "epochs ours", label_smoothing=0.1, aux_weight=0.4))
register(ProblemSpec("tolstoi_char_rnn", "lm", 50, 200, None, large_nets.CharRNN, _tolstoi,
                     83, source="DeepOBS, initialized as its TensorFlow original (Glorot-uniform "
                                "embedding, kernels and softmax; zero LSTM biases, forget-gate "
                                "bias +1; one trainable bias per gate)"))

register(ProblemSpec("digits_logreg", "classification", 64, 20, None, digits_logreg,
                     _digits, 10, source="ours (scikit-learn digits)"))
register(ProblemSpec("digits_mlp", "classification", 64, 20, None, digits_mlp,
                     _digits, 10, source="ours (scikit-learn digits)"))
register(ProblemSpec("digits_cnn", "classification", 64, 20, None, digits_cnn,
                     _digits, 10, source="ours (scikit-learn digits)"))


# --- public API --------------------------------------------------------------------------
DATA_SETS = {"two_d": "noise (2-D function)", "quadratic": "noise (100-D Gaussian)",
             "mnist": "MNIST", "fmnist": "Fashion-MNIST", "cifar10": "CIFAR-10",
             "cifar100": "CIFAR-100", "svhn": "SVHN", "imagenet": "ImageNet",
             "tolstoi": "War and Peace (chars)", "digits": "digits (scikit-learn)"}
MODELS = {"beale": "Beale function", "branin": "Branin function",
          "rosenbrock": "Rosenbrock function", "deep": "quadratic, deep-learning spectrum",
          "logreg": "logistic regression", "mlp": "MLP", "2c2d": "2c2d CNN", "3c3d": "3c3d CNN",
          "vae": "VAE", "vgg16": "VGG-16", "vgg19": "VGG-19", "allcnnc": "All-CNN-C",
          "wrn404": "Wide ResNet 40-4", "wrn164": "Wide ResNet 16-4",
          "inception_v3": "Inception-v3", "char_rnn": "2-layer LSTM", "cnn": "small CNN"}


def describe(name: str) -> dict[str, object]:
    """Data set, model, number of trainable parameters, default batch size and epochs and
    source of problem ``name`` (the model is built on the meta device: no memory, no data)."""
    spec = REGISTRY[name]
    prefix, _, suffix = name.partition("_")
    if prefix == "two":
        prefix, suffix = "two_d", name.removeprefix("two_d_")
    with torch.device("meta"):
        model = spec.build_model()
    return {"problem": name, "data": DATA_SETS[prefix], "model": MODELS[suffix],
            "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "batch_size": spec.batch_size, "epochs": spec.num_epochs, "source": spec.source}


def list_problems() -> list[str]:
    """Names of all test problems, sorted."""
    return sorted(REGISTRY)


def get_problem(name: str, *, data: str = "synthetic", data_dir: str | None = None,
                batch_size: int | None = None, seed: int = 0, device="cpu") -> TestProblem:
    """Build test problem ``name``: model initialized from ``seed`` (the global RNG is left
    untouched), loss, regularizer and the four data loaders.

    ``data="synthetic"``: a seeded stand-in of the same shapes and classes (tests, demos);
    ``data="real"``: the published files under ``data_dir`` / ``$COCKPIT_DATA`` /
    ``~/.cockpit/data`` (see :mod:`cockpit.benchmark.problems.readers`); a missing file
    raises :class:`~cockpit.benchmark.problems.readers.MissingDataError` saying where to
    put which file. The 2-D functions and the quadratic define their own data: both modes
    give the same problem. ``batch_size`` overrides DeepOBS's default.
    """
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, REGISTRY, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"unknown test problem {name!r}.{hint} Available: "
                       f"{', '.join(list_problems())}")
    if data not in ("synthetic", "real"):
        raise ValueError(f"data must be 'synthetic' or 'real', got {data!r}")
    spec = REGISTRY[name]
    batch_size = spec.batch_size if batch_size is None else int(batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    device = torch.device(device)
    built: dict[str, nn.Module] = {}

    def on_start() -> None:
        reset = getattr(built.get("model"), "reset_state", None)
        if reset is not None:
            reset()

    # data first: a missing file is reported before an expensive model is built
    splits = spec.build_splits(data, data_dir, batch_size, seed, device, on_start=on_start)
    for split in ("train", "train_eval", "valid", "test"):
        loader = getattr(splits, split)
        if len(loader) == 0:
            raise ValueError(
                f"{name}: batch_size {batch_size} leaves no complete batch in the {split} split "
                f"({loader.num_samples} samples; the incomplete last batch is dropped, as "
                "DeepOBS does); choose a smaller batch size")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.build_model()
    built["model"] = model.to(device)
    return TestProblem(name=name, batch_size=batch_size, num_epochs=spec.num_epochs,
                       l2=spec.l2, task=spec.task, model=model, splits=splits,
                       num_classes=spec.num_classes, data=data,
                       label_smoothing=spec.label_smoothing, aux_weight=spec.aux_weight,
                       source=spec.source)
