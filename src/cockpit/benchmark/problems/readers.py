"""Readers for the published file formats of the DeepOBS data sets. Nothing is downloaded:
the files must already be on disk, and a missing file raises :class:`MissingDataError`
naming every file and the folder it belongs in.

Data root: the ``data_dir`` argument, else ``$COCKPIT_DATA``, else ``~/.cockpit/data``.

==============  ===================================================================
data set        files under the data root
==============  ===================================================================
MNIST           ``mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``
Fashion-MNIST   ``fmnist/`` the same four idx files
CIFAR-10        ``cifar10/cifar-10-batches-py/{data_batch_1..5,test_batch}`` (pickles)
CIFAR-100       ``cifar100/cifar-100-python/{train,test}`` (pickles)
SVHN            ``svhn/{train_32x32.mat,test_32x32.mat}`` (format 2, MATLAB)
Tolstoi         ``tolstoi/input.txt`` (War and Peace, plain UTF-8 text), or DeepOBS's
                ``tolstoi/{train,test}.npy``
ImageNet        ``imagenet/{train,val}/<wnid>/*.JPEG`` (one folder per class)
==============  ===================================================================
"""

from __future__ import annotations

import gzip
import os
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}


class MissingDataError(FileNotFoundError):
    """A data file of a test problem is not on disk (nothing is downloaded)."""


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """``data_dir``, else ``$COCKPIT_DATA``, else ``~/.cockpit/data``."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if os.environ.get("COCKPIT_DATA"):
        return Path(os.environ["COCKPIT_DATA"]).expanduser()
    return Path("~/.cockpit/data").expanduser()


def _missing(dataset: str, folder: Path, files: list[str], source: str) -> MissingDataError:
    listing = "\n".join(f"  {folder / f}" for f in files)
    return MissingDataError(
        f"{dataset} is not on disk (Cockpit downloads nothing). Put these files there:\n"
        f"{listing}\n(from {source}), or point data_dir= / $COCKPIT_DATA at the folder that "
        f"contains '{folder.name}/'. For tests and demos without the data use "
        f"data='synthetic'."
    )


# --- MNIST / Fashion-MNIST: idx ---------------------------------------------------------------
IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An idx file (LeCun's format: zero bytes, type code, rank, big-endian int32 sizes,
    data), gzipped (``.gz``) or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPES:
        raise ValueError(f"{path} is not an idx file (bad magic number {raw[:4]!r})")
    rank = raw[3]
    shape = tuple(int(s) for s in np.frombuffer(raw, ">i4", count=rank, offset=4))
    dtype = np.dtype(IDX_DTYPES[raw[2]])
    data = np.frombuffer(raw, dtype, count=int(np.prod(shape)), offset=4 + 4 * rank)
    return data.reshape(shape)


def _find(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.exists():
            return candidate
    return None


# torchvision's layout (what DeepOBS's PyTorch version downloads) is accepted too
TORCHVISION_FOLDERS = {"mnist": "MNIST/raw", "fmnist": "FashionMNIST/raw"}


def _first_complete(candidates: list[Path], files: list[str]) -> Path:
    """The first candidate folder holding all ``files`` (``.gz`` or not), else the first."""
    for folder in candidates:
        if all(_find(folder, f) is not None for f in files):
            return folder
    return candidates[0]


def read_mnist(root: Path, name: str = "mnist") -> dict[str, Tensor]:
    """``{"train_x", "train_y", "test_x", "test_y"}``: images ``uint8 [N, 1, 28, 28]``,
    labels ``int64 [N]``. ``name``: ``"mnist"`` or ``"fmnist"``; files in ``root/name/``
    or torchvision's ``root/MNIST/raw/`` (``FashionMNIST/raw/``)."""
    folder = _first_complete([root / name, root / TORCHVISION_FOLDERS[name]],
                             list(IDX_FILES.values()))
    paths = {key: _find(folder, fname) for key, fname in IDX_FILES.items()}
    if any(p is None for p in paths.values()):
        missing = [f"{IDX_FILES[k]}.gz" for k, p in paths.items() if p is None]
        source = ("http://yann.lecun.com/exdb/mnist/" if name == "mnist"
                  else "https://github.com/zalandoresearch/fashion-mnist")
        raise _missing("MNIST" if name == "mnist" else "Fashion-MNIST", folder, missing, source)
    out = {}
    for split in ("train", "test"):
        images = read_idx(paths[f"{split}_images"])
        labels = read_idx(paths[f"{split}_labels"])
        if images.ndim != 3 or len(images) != len(labels):
            raise ValueError(f"{paths[f'{split}_images']}: expected [N, 28, 28] images "
                             f"matching {len(labels)} labels, got shape {images.shape}")
        out[f"{split}_x"] = torch.from_numpy(images.copy()).unsqueeze(1)
        out[f"{split}_y"] = torch.from_numpy(labels.astype(np.int64))
    return out


# --- CIFAR-10 / CIFAR-100: python pickles --------------------------------------------------
def _read_cifar_pickle(path: Path, label_key: bytes) -> tuple[Tensor, Tensor]:
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(labels):
        raise ValueError(f"{path}: expected 'data' of shape [N, 3072] and N labels, got "
                         f"{data.shape} and {labels.shape}")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(labels)


def read_cifar(root: Path, num_classes: int = 10) -> dict[str, Tensor]:
    """CIFAR-10 (``num_classes=10``) or CIFAR-100 (fine labels) from the python pickles:
    images ``uint8 [N, 3, 32, 32]`` (channel-major rows as stored), labels ``int64``."""
    if num_classes == 10:
        folder = root / "cifar10" / "cifar-10-batches-py"
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
        test_files, key = ["test_batch"], b"labels"
        source = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, unpacked"
    else:
        folder = root / "cifar100" / "cifar-100-python"
        train_files, test_files, key = ["train"], ["test"], b"fine_labels"
        source = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz, unpacked"
    # also accepted: the unpacked folder directly under the root (torchvision's layout)
    folder = next((f for f in (folder, root / folder.name)
                   if all((f / n).exists() for n in train_files + test_files)), folder)
    missing = [f for f in train_files + test_files if not (folder / f).exists()]
    if missing:
        raise _missing(f"CIFAR-{num_classes}", folder, missing, source)
    out = {}
    for split, files in (("train", train_files), ("test", test_files)):
        parts = [_read_cifar_pickle(folder / f, key) for f in files]
        out[f"{split}_x"] = torch.cat([p[0] for p in parts])
        out[f"{split}_y"] = torch.cat([p[1] for p in parts])
    return out


# --- SVHN: MATLAB .mat ----------------------------------------------------------------------
def read_svhn(root: Path) -> dict[str, Tensor]:
    """SVHN format 2 (cropped digits): ``X`` is ``[32, 32, 3, N]``, ``y`` is ``[N, 1]`` with
    digit 0 stored as label 10; we return images ``uint8 [N, 3, 32, 32]`` and labels 0–9."""
    folder = root / "svhn"
    files = {"train": "train_32x32.mat", "test": "test_32x32.mat"}
    missing = [f for f in files.values() if not (folder / f).exists()]
    if missing:
        raise _missing("SVHN", folder, missing, "http://ufldl.stanford.edu/housenumbers/")
    from scipy.io import loadmat

    out = {}
    for split, fname in files.items():
        mat = loadmat(folder / fname)
        x = np.asarray(mat["X"], dtype=np.uint8)
        y = np.asarray(mat["y"], dtype=np.int64).reshape(-1)
        if x.ndim != 4 or x.shape[:3] != (32, 32, 3) or x.shape[3] != len(y):
            raise ValueError(f"{folder / fname}: expected X [32, 32, 3, N] and y [N, 1], got "
                             f"{x.shape} and {mat['y'].shape}")
        out[f"{split}_x"] = torch.from_numpy(np.ascontiguousarray(x.transpose(3, 2, 0, 1)))
        out[f"{split}_y"] = torch.from_numpy(np.where(y == 10, 0, y))
    return out


# --- Tolstoi: War and Peace as character ids ------------------------------------------------
def tolstoi_vocabulary(text: str) -> list[str]:
    """Characters by decreasing frequency (ties by first occurrence), as DeepOBS's
    preprocessing orders them; the id of a character is its index."""
    counts = Counter(text)
    return [c for c, _ in sorted(counts.items(), key=lambda item: -item[1])]


def encode_tolstoi(text: str, test_fraction: float = 0.2) -> dict[str, object]:
    """Character ids of ``text`` split as DeepOBS: the first ⌈0.8·N⌉ characters are train,
    the rest test. Returns ``{"train", "test"}`` (``int64`` tensors) and ``"vocab"``."""
    vocab = tolstoi_vocabulary(text)
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    train_size = int(np.ceil((1.0 - test_fraction) * len(ids)))
    return {"train": ids[:train_size], "test": ids[train_size:], "vocab": vocab}


def read_tolstoi(root: Path) -> dict[str, object]:
    """``tolstoi/input.txt`` (encoded and split here), or DeepOBS's own preprocessed
    ``tolstoi/train.npy`` and ``test.npy`` (character ids) if there is no text file."""
    folder = root / "tolstoi"
    path = folder / "input.txt"
    if not path.exists() and (folder / "train.npy").exists() and (folder / "test.npy").exists():
        train = np.load(folder / "train.npy")
        test = np.load(folder / "test.npy")
        vocab_size = int(max(train.max(initial=0), test.max(initial=0))) + 1
        return {"train": torch.from_numpy(train.astype(np.int64)),
                "test": torch.from_numpy(test.astype(np.int64)),
                "vocab": [None] * vocab_size}
    if not path.exists():
        raise _missing("Tolstoi (War and Peace)", folder, ["input.txt"],
                       "War and Peace as plain UTF-8 text, e.g. Project Gutenberg eBook #2600; "
                       "DeepOBS's preprocessed train.npy and test.npy work too")
    return encode_tolstoi(path.read_text(encoding="utf-8"))


# --- ImageNet: a folder of class folders -----------------------------------------------------
def list_image_folder(folder: Path) -> tuple[list[Path], Tensor, list[str]]:
    """Files of ``folder/<class>/*`` (sorted), labels and class names. Label ``k + 1`` for
    the k-th class in sorted order: label 0 is the background class of DeepOBS's 1,001
    outputs."""
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    files, labels = [], []
    for k, name in enumerate(classes):
        for path in sorted((folder / name).iterdir()):
            if path.suffix.lower() in IMAGE_SUFFIXES:
                files.append(path)
                labels.append(k + 1)
    return files, torch.tensor(labels, dtype=torch.int64), classes


def read_imagenet(root: Path) -> dict[str, object]:
    folder = root / "imagenet"
    missing = [f"{s}/<wnid>/*.JPEG" for s in ("train", "val") if not (folder / s).is_dir()]
    if missing:
        raise _missing("ImageNet", folder, missing,
                       "https://image-net.org (ILSVRC2012; validation images sorted into "
                       "class folders)")
    out: dict[str, object] = {}
    for split, sub in (("train", "train"), ("test", "val")):
        files, labels, classes = list_image_folder(folder / sub)
        if not files:
            raise _missing("ImageNet", folder, [f"{sub}/<wnid>/*.JPEG"], "https://image-net.org")
        out[f"{split}_files"], out[f"{split}_y"], out[f"{split}_classes"] = files, labels, classes
    if out["train_classes"] != out["test_classes"]:
        raise ValueError(f"{folder}: train/ and val/ must hold the same class folders")
    return out


def load_image(path: Path, smaller_side: int = 256) -> Tensor:
    """An image file as ``uint8 [3, smaller_side, smaller_side]``: resized (bilinear, aspect
    kept) so its smaller side is ``smaller_side``, then centre-cropped to ``smaller_side`` square
    (DeepOBS's ``resize_image_with_crop_or_pad``); the random or centre 224×224 crop is
    taken by the loader."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        w, h = image.size
        scale = smaller_side / min(w, h)
        size = (max(smaller_side, round(w * scale)), max(smaller_side, round(h * scale)))
        image = image.resize(size, Image.BILINEAR)
        left, top = (size[0] - smaller_side) // 2, (size[1] - smaller_side) // 2
        image = image.crop((left, top, left + smaller_side, top + smaller_side))
        array = np.asarray(image, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1)
