"""Data loaders of the benchmark problems read the published file formats: each test WRITES
small files in the real format (MNIST idx, CIFAR pickles, SVHN .mat, Tolstoi text, an
ImageNet folder) and checks that the loaders return exactly the written values and labels,
split as DeepOBS splits them; augmentation against independent references; missing files
give an error naming each file and where it goes."""

from __future__ import annotations

import colorsys
import gzip
import multiprocessing as mp
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from cockpit.benchmark.problems import MissingDataError, data_root, get_problem
from cockpit.benchmark.problems import augment as aug
from cockpit.benchmark.problems.readers import encode_tolstoi, read_idx

pytestmark = pytest.mark.usefixtures("one_thread")


def _all(loader):
    xs, ys = zip(*loader, strict=True)
    return torch.cat(xs), torch.cat(ys)


def _standardize(images: np.ndarray) -> np.ndarray:
    """TensorFlow's per_image_standardization, written with NumPy (float64)."""
    flat = images.reshape(len(images), -1).astype(np.float64)
    mean = flat.mean(axis=1, keepdims=True)
    std = np.maximum(flat.std(axis=1, keepdims=True), 1 / np.sqrt(flat.shape[1]))
    return ((flat - mean) / std).reshape(images.shape)


# --- MNIST / Fashion-MNIST -------------------------------------------------------------------
def _write_idx(path: Path, array: np.ndarray, compress: bool):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


def _write_mnist(folder: Path, n_train=24, n_test=8, seed=0):
    rng = np.random.RandomState(seed)
    folder.mkdir(parents=True)
    arrays = {
        "train-images-idx3-ubyte": rng.randint(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.randint(0, 10, n_train),
        "t10k-images-idx3-ubyte": rng.randint(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.randint(0, 10, n_test),
    }
    for i, (name, array) in enumerate(arrays.items()):
        _write_idx(folder / name, array, compress=i % 2 == 0)  # both .gz and plain
    return arrays


def test_read_idx_round_trip(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "a", array, compress=False)
    _write_idx(tmp_path / "b", array, compress=True)
    np.testing.assert_array_equal(read_idx(tmp_path / "a"), array)
    np.testing.assert_array_equal(read_idx(tmp_path / "b.gz"), array)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "bad")


@pytest.mark.parametrize("dataset", ["mnist", "fmnist"])
def test_mnist_loaders_return_the_written_images_split_as_deepobs(tmp_path, dataset):
    arrays = _write_mnist(tmp_path / dataset)
    problem = get_problem(f"{dataset}_logreg", data="real", data_dir=tmp_path, batch_size=4)
    train_images = torch.tensor(arrays["train-images-idx3-ubyte"], dtype=torch.float32)
    train_labels = torch.tensor(arrays["train-labels-idx1-ubyte"])
    # test: the test file, in order, scaled to [0, 1]
    x, y = _all(problem.test_loader)
    torch.testing.assert_close(x[:, 0], torch.tensor(arrays["t10k-images-idx3-ubyte"],
                                                     dtype=torch.float32) / 255)
    assert torch.equal(y, torch.tensor(arrays["t10k-labels-idx1-ubyte"]))
    # valid: the first N_test = 8 training samples, in order
    x, y = _all(problem.valid_loader)
    torch.testing.assert_close(x[:, 0], train_images[:8] / 255)
    assert torch.equal(y, train_labels[:8])
    # train: the other 16, each exactly once per epoch (shuffled), 4 batches of 4
    assert len(problem.train_loader) == 4
    x, y = _all(problem.train_loader)
    order = torch.tensor([int(torch.nonzero((train_images / 255 == xi[0]).all(-1).all(-1))[0])
                          for xi in x])
    assert sorted(order.tolist()) == list(range(8, 24))
    assert torch.equal(y, train_labels[order])
    # a second epoch is reshuffled
    x2, _ = _all(problem.train_loader)
    assert not torch.equal(x, x2)
    # train_eval: 8 distinct training samples (not valid ones)
    x, y = _all(problem.train_eval_loader)
    idx = [int(torch.nonzero((train_images / 255 == xi[0]).all(-1).all(-1))[0]) for xi in x]
    assert len(set(idx)) == 8 and min(idx) >= 8
    assert torch.equal(y, train_labels[idx])


def test_vae_loader_targets_are_the_images(tmp_path):
    _write_mnist(tmp_path / "mnist")
    problem = get_problem("mnist_vae", data="real", data_dir=tmp_path, batch_size=4)
    for x, y in problem.test_loader:
        assert torch.equal(x, y)


# --- CIFAR-10 / CIFAR-100 --------------------------------------------------------------------
def _write_cifar(root: Path, classes: int, per_file=4, n_test=6, seed=0):
    rng = np.random.RandomState(seed)
    if classes == 10:
        folder, key = root / "cifar10" / "cifar-10-batches-py", b"labels"
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
        test_files = ["test_batch"]
    else:
        folder, key = root / "cifar100" / "cifar-100-python", b"fine_labels"
        train_files, test_files = ["train"], ["test"]
        per_file *= 5
    folder.mkdir(parents=True)
    written = {}
    for name in train_files + test_files:
        n = n_test if name in test_files else per_file
        batch = {b"data": rng.randint(0, 256, (n, 3072)).astype(np.uint8),
                 key: rng.randint(0, classes, n).tolist()}
        if classes == 100:
            batch[b"coarse_labels"] = rng.randint(0, 20, n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
        written[name] = batch
    train = [written[n] for n in train_files]
    train_x = np.concatenate([b[b"data"] for b in train]).reshape(-1, 3, 32, 32)
    train_y = np.concatenate([b[key] for b in train])
    test = written[test_files[0]]
    return train_x, train_y, test[b"data"].reshape(-1, 3, 32, 32), np.array(test[key])


@pytest.mark.parametrize("classes", [10, 100])
def test_cifar_loaders_return_the_written_images(tmp_path, classes):
    train_x, train_y, test_x, test_y = _write_cifar(tmp_path, classes)
    problem = get_problem(f"cifar{classes}_3c3d", data="real", data_dir=tmp_path, batch_size=3)
    x, y = _all(problem.test_loader)
    np.testing.assert_allclose(x.numpy(), _standardize(test_x), rtol=1e-5, atol=1e-5)
    assert y.tolist() == test_y.tolist()
    x, y = _all(problem.valid_loader)  # first 6 training images (N_test = 6)
    np.testing.assert_allclose(x.numpy(), _standardize(train_x[:6]), rtol=1e-5, atol=1e-5)
    assert y.tolist() == train_y[:6].tolist()
    # augmented training batches: 14 remaining images → 4 batches of 3 (remainder dropped),
    # standardized per image, labels among the training labels
    assert len(problem.train_loader) == (len(train_y) - 6) // 3
    x, y = _all(problem.train_loader)
    assert x.shape == (12, 3, 32, 32)
    torch.testing.assert_close(x.flatten(1).mean(1), torch.zeros(12), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.flatten(1).std(1, unbiased=False), torch.ones(12), atol=1e-4,
                               rtol=0)


def test_svhn_loader_reads_mat_and_maps_label_10_to_0(tmp_path):
    from scipy.io import savemat

    rng = np.random.RandomState(0)
    (tmp_path / "svhn").mkdir()
    data = {}
    for name, n in (("train_32x32.mat", 10), ("test_32x32.mat", 4)):
        X = rng.randint(0, 256, (32, 32, 3, n)).astype(np.uint8)
        y = rng.randint(1, 11, (n, 1)).astype(np.uint8)
        y[0, 0] = 10
        savemat(tmp_path / "svhn" / name, {"X": X, "y": y})
        data[name] = (X, y)
    problem = get_problem("svhn_3c3d", data="real", data_dir=tmp_path, batch_size=2)
    X, y = data["test_32x32.mat"]
    x_loaded, y_loaded = _all(problem.test_loader)
    expected = _standardize(X.transpose(3, 2, 0, 1))
    np.testing.assert_allclose(x_loaded.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert y_loaded.tolist() == [0 if v == 10 else int(v) for v in y[:, 0]]
    X, y = data["train_32x32.mat"]
    x_valid, y_valid = _all(problem.valid_loader)
    np.testing.assert_allclose(x_valid.numpy(), _standardize(X.transpose(3, 2, 0, 1)[:4]),
                               rtol=1e-5, atol=1e-5)
    assert y_valid[0] == 0


# --- Tolstoi ---------------------------------------------------------------------------------
def test_tolstoi_vocabulary_split_and_sequence_batches(tmp_path):
    rng = np.random.RandomState(0)
    alphabet = list("abcdefghij .,\n")
    text = "".join(rng.choice(alphabet, size=2503, p=None))
    (tmp_path / "tolstoi").mkdir()
    (tmp_path / "tolstoi" / "input.txt").write_text(text, encoding="utf-8")

    encoded = encode_tolstoi(text)
    vocab = encoded["vocab"]
    counts = [text.count(c) for c in vocab]
    assert counts == sorted(counts, reverse=True)  # by decreasing frequency
    train_size = int(np.ceil(0.8 * len(text)))  # DeepOBS: first ⌈0.8 N⌉ characters
    assert "".join(vocab[i] for i in encoded["train"]) == text[:train_size]
    assert "".join(vocab[i] for i in encoded["test"]) == text[train_size:]

    problem = get_problem("tolstoi_char_rnn", data="real", data_dir=tmp_path, batch_size=2)
    test = text[train_size:]
    n_batches = (len(test) - 1) // (2 * 50)
    assert len(problem.test_loader) == n_batches
    rows = (n_batches * 100) // 2
    for i, (x, y) in enumerate(problem.test_loader):
        assert x.shape == y.shape == (2, 50)
        for b in range(2):
            start = b * rows + i * 50
            assert "".join(vocab[c] for c in x[b]) == test[start:start + 50]
            assert "".join(vocab[c] for c in y[b]) == test[start + 1:start + 51]
    # valid = the first N_test characters of the training part; train = the rest
    valid_x, _ = next(iter(problem.valid_loader))
    assert "".join(vocab[c] for c in valid_x[0]) == text[:50]
    train_x, _ = next(iter(problem.train_loader))
    assert "".join(vocab[c] for c in train_x[0]) == text[len(test):len(test) + 50]


def test_tolstoi_rejects_a_text_with_too_many_characters(tmp_path):
    (tmp_path / "tolstoi").mkdir()
    text = "".join(chr(0x400 + i) for i in range(100)) * 30
    (tmp_path / "tolstoi" / "input.txt").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="83"):
        get_problem("tolstoi_char_rnn", data="real", data_dir=tmp_path, batch_size=2)


def test_char_rnn_state_carries_over_and_resets_each_epoch():
    problem = get_problem("tolstoi_char_rnn", batch_size=2)
    model = problem.model.eval()
    batches = iter(problem.test_loader)
    x0, _ = next(batches)
    with torch.no_grad():
        first = model(x0)
        x1, _ = next(batches)
        carried = model(x1)
        model.reset_state()
        fresh = model(x1)
    assert not torch.allclose(carried, fresh)
    with torch.no_grad():
        x0_again, _ = next(iter(problem.test_loader))  # a new epoch resets the state
        again = model(x0_again)
    torch.testing.assert_close(again, first)


# --- ImageNet --------------------------------------------------------------------------------
def _write_imagenet(root: Path):
    from PIL import Image

    rng = np.random.RandomState(0)
    written = {}
    for split, per_class in (("train", 3), ("val", 1)):
        for wnid in ("n01440764", "n01443537"):
            folder = root / "imagenet" / split / wnid
            folder.mkdir(parents=True)
            for j in range(per_class):
                array = rng.randint(0, 256, (256, 256, 3)).astype(np.uint8)
                path = folder / f"{wnid}_{j}.png"  # lossless: values must come back exactly
                Image.fromarray(array).save(path)
                written[path] = array
    # one JPEG of another size: resized (smaller side 256) and centre-cropped
    odd = rng.randint(0, 256, (300, 400, 3)).astype(np.uint8)
    Image.fromarray(odd).save(root / "imagenet" / "val" / "n01443537" / "z_odd.JPEG")
    return written


def test_imagenet_folder_loader(tmp_path):
    from PIL import Image

    written = _write_imagenet(tmp_path)
    problem = get_problem("imagenet_inception_v3", data="real", data_dir=tmp_path,
                          batch_size=3)  # several images per batch: decoded in threads
    val = sorted(p for p in written if "val" in p.parts)
    x, y = _all(problem.test_loader)
    assert y.tolist() == [1, 2, 2]  # label = 1 + class index (0 is background)
    for i, path in enumerate(val):
        centre = written[path][16:240, 16:240].transpose(2, 0, 1)[None]
        np.testing.assert_allclose(x[i:i + 1].numpy(), _standardize(centre), rtol=1e-5,
                                   atol=1e-5)
    # the 400×300 JPEG: bilinear resize to 341×256, centre crop 256, then centre crop 224
    with Image.open(tmp_path / "imagenet" / "val" / "n01443537" / "z_odd.JPEG") as image:
        resized = np.asarray(image.convert("RGB").resize((341, 256), Image.BILINEAR))
    square = resized[:, 42:298]
    expected = _standardize(square[16:240, 16:240].transpose(2, 0, 1)[None])
    np.testing.assert_allclose(x[2:3].numpy(), expected, rtol=1e-5, atol=1e-5)
    # train: 6 images, the first N_test = 3 (sorted) held out as valid
    assert problem.valid_loader.num_samples == 3 and problem.train_loader.num_samples == 3
    xt, yt = next(iter(problem.train_loader))
    assert xt.shape == (3, 3, 224, 224) and set(yt.tolist()) <= {1, 2}


def _batches_in_child(loader, queue):
    queue.put([x.sum().item() for x, _ in loader])


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="no fork here")
def test_imagenet_loader_in_a_forked_process(tmp_path):
    """A DataLoader worker forked after the parent decoded images in threads starts its own
    decoding threads (the parent's pool, copied without its threads, would hang it)."""
    _write_imagenet(tmp_path)
    problem = get_problem("imagenet_inception_v3", data="real", data_dir=tmp_path, batch_size=3)
    want = [x.sum().item() for x, _ in problem.test_loader]  # the parent's threads run
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_batches_in_child, args=(problem.test_loader, queue))
    child.start()
    try:
        assert queue.get(timeout=60) == want
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()


# --- augmentation against references ---------------------------------------------------------
def test_random_crop_windows_of_the_padded_image():
    g = torch.Generator().manual_seed(0)
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) + 1
    out = aug.random_crop(x, 8, g, pad=2)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):
        windows = [(t, l) for t in range(5) for l in range(5)
                   if torch.equal(padded[i, :, t:t + 8, l:l + 8], out[i])]
        assert len(windows) == 1


def test_flip_brightness_contrast():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(64, 3, 4, 5)
    flipped = aug.random_flip(x, g)
    same = [(flipped[i] == x[i]).all().item() for i in range(64)]
    mirrored = [(flipped[i] == x[i].flip(-1)).all().item() for i in range(64)]
    assert all(s or m for s, m in zip(same, mirrored, strict=True))
    assert 10 < sum(mirrored) < 54
    shifted = aug.random_brightness(x, 0.25, g)
    delta = (shifted - x).flatten(1)
    torch.testing.assert_close(delta, delta[:, :1].expand_as(delta), atol=1e-6, rtol=0)
    assert (delta.abs() <= 0.25 + 1e-6).all()
    g2 = torch.Generator().manual_seed(2)
    contrasted = aug.random_contrast(x[:2], 0.2, 1.8, g2)
    f = 0.2 + 1.6 * torch.rand(2, generator=torch.Generator().manual_seed(2))
    mean = x[:2].mean(dim=(2, 3), keepdim=True)
    torch.testing.assert_close(contrasted, (x[:2] - mean) * f[:, None, None, None] + mean)


@pytest.mark.parametrize("factor", [0.5, 1.3, 3.0])
def test_saturation_matches_hsv_reference(factor):
    """Against Python's colorsys: scale S (clipped to 1), keep H and V."""
    rng = np.random.RandomState(0)
    pixels = rng.uniform(0, 255, (1, 3, 4, 4))
    out = aug.adjust_saturation(torch.tensor(pixels), torch.tensor([factor],
                                                                   dtype=torch.float64))
    for i in range(4):
        for j in range(4):
            r, g, b = pixels[0, :, i, j] / 255
            h, s, v = colorsys.rgb_to_hsv(r, g, b)
            expected = np.array(colorsys.hsv_to_rgb(h, min(s * factor, 1.0), v)) * 255
            np.testing.assert_allclose(out[0, :, i, j].numpy(), expected, rtol=1e-9,
                                       atol=1e-7)


def test_per_image_standardization_reference():
    x = torch.tensor(np.random.RandomState(3).uniform(0, 255, (3, 3, 5, 5)))
    np.testing.assert_allclose(aug.per_image_standardization(x).numpy(),
                               _standardize(x.numpy()), rtol=1e-12, atol=1e-12)
    constant = torch.full((1, 3, 4, 4), 7.0)  # std 0: divided by 1/√N, not by zero
    assert torch.equal(aug.per_image_standardization(constant), torch.zeros(1, 3, 4, 4))


# --- digits (real) ---------------------------------------------------------------------------
def test_digits_real_split():
    from sklearn.datasets import load_digits

    digits = load_digits()
    problem = get_problem("digits_cnn", data="real", batch_size=32)
    sizes = [loader.num_samples for loader in (problem.train_loader, problem.valid_loader,
                                               problem.test_loader)]
    assert sizes == [1077, 360, 360]
    # every split drops its incomplete last batch: 360 // 32 = 11 batches of 32
    assert [len(problem.train_loader), len(problem.train_eval_loader), len(problem.valid_loader),
            len(problem.test_loader)] == [1077 // 32, 11, 11, 11]
    train = set(problem.train_loader.indices.tolist())
    valid = set(problem.valid_loader.indices.tolist())
    test = set(problem.test_loader.indices.tolist())
    assert not (train & valid or train & test or valid & test)
    assert len(train | valid | test) == 1797
    assert set(problem.train_eval_loader.indices.tolist()) <= train
    x, y = _all(problem.test_loader)
    assert len(y) == 352
    idx = problem.test_loader.indices[:352]
    assert y.tolist() == digits.target[idx.numpy()].tolist()
    raw = torch.tensor(digits.images[idx.numpy()], dtype=torch.float32)
    train_raw = torch.tensor(digits.images[sorted(train)], dtype=torch.float32)
    torch.testing.assert_close(x[:, 0], (raw - train_raw.mean()) / train_raw.std())


# --- missing files ---------------------------------------------------------------------------
@pytest.mark.parametrize("problem, expected", [
    ("mnist_mlp", ["mnist/train-images-idx3-ubyte.gz", "mnist/t10k-labels-idx1-ubyte.gz"]),
    ("fmnist_2c2d", ["fmnist/train-labels-idx1-ubyte.gz"]),
    ("cifar10_3c3d", ["cifar10/cifar-10-batches-py/data_batch_5",
                      "cifar10/cifar-10-batches-py/test_batch"]),
    ("cifar100_allcnnc", ["cifar100/cifar-100-python/train"]),
    ("svhn_wrn164", ["svhn/train_32x32.mat", "svhn/test_32x32.mat"]),
    ("tolstoi_char_rnn", ["tolstoi/input.txt"]),
    ("imagenet_vgg19", ["imagenet/train/<wnid>/*.JPEG", "imagenet/val/<wnid>/*.JPEG"]),
])
def test_missing_files_name_each_file_and_where_it_goes(tmp_path, problem, expected):
    with pytest.raises(MissingDataError) as info:
        get_problem(problem, data="real", data_dir=tmp_path, batch_size=1)
    message = str(info.value)
    for path in expected:
        assert str(tmp_path / path) in message
    assert "COCKPIT_DATA" in message and "data='synthetic'" in message


def test_partially_present_mnist_lists_only_the_missing_file(tmp_path):
    _write_mnist(tmp_path / "mnist")
    (tmp_path / "mnist" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(MissingDataError) as info:
        get_problem("mnist_logreg", data="real", data_dir=tmp_path)
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte" in message and "train-images" not in message


def test_data_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("COCKPIT_DATA", str(tmp_path / "env"))
    assert data_root(tmp_path / "arg") == tmp_path / "arg"
    assert data_root() == tmp_path / "env"
    monkeypatch.delenv("COCKPIT_DATA")
    assert data_root() == Path("~/.cockpit/data").expanduser()
    _write_mnist(tmp_path / "env" / "mnist")
    monkeypatch.setenv("COCKPIT_DATA", str(tmp_path / "env"))
    assert get_problem("mnist_logreg", data="real", batch_size=4).test_loader.num_samples == 8


def test_tolstoi_reads_deepobs_preprocessed_arrays(tmp_path):
    """DeepOBS's own tolstoi/train.npy and test.npy (character ids) are read as they are."""
    rng = np.random.RandomState(1)
    (tmp_path / "tolstoi").mkdir()
    train, test = rng.randint(0, 83, 900), rng.randint(0, 83, 301)
    np.save(tmp_path / "tolstoi" / "train.npy", train)
    np.save(tmp_path / "tolstoi" / "test.npy", test)
    problem = get_problem("tolstoi_char_rnn", data="real", data_dir=tmp_path, batch_size=3)
    x, y = next(iter(problem.test_loader))
    rows = len(problem.test_loader) * 50
    assert x[1].tolist() == test[rows:rows + 50].tolist()
    assert y[1].tolist() == test[rows + 1:rows + 51].tolist()
    x, _ = next(iter(problem.valid_loader))
    assert x[0].tolist() == train[:50].tolist()


def test_batch_loader_lengths_and_seeded_epochs():
    from cockpit.benchmark.problems import BatchLoader

    x, y = torch.arange(10.0)[:, None], torch.arange(10)
    train = BatchLoader(x, y, 4, shuffle=True, drop_last=True, seed=3)
    assert len(train) == 2 and sum(len(b[1]) for b in train) == 8
    full = BatchLoader(x, y, 4)
    assert len(full) == 3 and torch.equal(_all(full)[1], y)
    again = BatchLoader(x, y, 4, shuffle=True, drop_last=True, seed=3)
    epoch_a = [b[1].tolist() for b in again]
    epoch_b = [b[1].tolist() for b in BatchLoader(x, y, 4, shuffle=True, drop_last=True,
                                                  seed=3)]
    assert epoch_a == epoch_b  # same seed, same order
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(x, y, 0)


def test_sequence_loader_too_short_text_is_refused():
    from cockpit.benchmark.problems import SequenceLoader

    with pytest.raises(ValueError, match="too few"):
        SequenceLoader(torch.arange(100), batch_size=2, seq_length=50)
    loader = SequenceLoader(torch.arange(101), batch_size=2, seq_length=50)
    (x, y), = list(loader)
    assert x.tolist() == [list(range(50)), list(range(50, 100))]
    assert y.tolist() == [list(range(1, 51)), list(range(51, 101))]


def test_tf_same_max_pool_against_brute_force():
    """3C3D's pooling: 3×3 windows, stride 2, TensorFlow "same" (⌈n/2⌉ outputs, padding at
    the end only for even n), checked window by window."""
    from cockpit.benchmark.problems.small_nets import TFSamePool

    x = torch.randn(1, 2, 8, 7)
    out = TFSamePool(3, 2)(x)
    assert out.shape == (1, 2, 4, 4)
    for i in range(4):
        for j in range(4):
            # total padding: rows (4−1)·2+3−8 = 1 → 0 before; cols (4−1)·2+3−7 = 2 → 1 before
            rows = range(max(2 * i, 0), min(2 * i + 3, 8))
            cols = range(max(2 * j - 1, 0), min(2 * j - 1 + 3, 7))
            window = x[0, :, rows.start:rows.stop, cols.start:cols.stop]
            torch.testing.assert_close(out[0, :, i, j], window.amax(dim=(1, 2)))


def test_torchvision_layouts_are_accepted(tmp_path):
    """Files where torchvision (and so DeepOBS's PyTorch version) puts them are read too."""
    arrays = _write_mnist(tmp_path / "MNIST" / "raw")
    problem = get_problem("mnist_logreg", data="real", data_dir=tmp_path, batch_size=4)
    assert _all(problem.test_loader)[1].tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    _, _, _, test_y = _write_cifar(tmp_path / "tv", 10)
    (tmp_path / "tv" / "cifar10" / "cifar-10-batches-py").rename(tmp_path / "cifar-10-batches-py")
    problem = get_problem("cifar10_3c3d", data="real", data_dir=tmp_path, batch_size=3)
    assert _all(problem.test_loader)[1].tolist() == test_y.tolist()


# --- train_eval and partial batches as DeepOBS ------------------------------------------------
def _train_index(images: torch.Tensor, x: torch.Tensor) -> list[int]:
    return [int(torch.nonzero((images == xi[0]).all(-1).all(-1))[0]) for xi in x]


def test_train_eval_is_a_fresh_draw_from_the_training_stream(tmp_path):
    """DeepOBS: train_dataset.take(N_test // B) — each evaluation takes new batches of the
    reshuffled training stream; evaluating does not move the training order."""
    arrays = _write_mnist(tmp_path / "mnist", n_train=40, n_test=12)
    images = torch.tensor(arrays["train-images-idx3-ubyte"], dtype=torch.float32) / 255
    problem = get_problem("mnist_logreg", data="real", data_dir=tmp_path, batch_size=5)
    assert len(problem.train_eval_loader) == 12 // 5
    passes = [_train_index(images, _all(problem.train_eval_loader)[0]) for _ in range(3)]
    for idx in passes:
        assert len(idx) == 10 and len(set(idx)) == 10 and min(idx) >= 12  # train part only
    assert len({tuple(sorted(idx)) for idx in passes}) == 3  # a fresh subset each time
    # the training order with and without evaluations in between
    other = get_problem("mnist_logreg", data="real", data_dir=tmp_path, batch_size=5)
    for _ in range(2):
        _all(problem.train_eval_loader)
        assert torch.equal(_all(problem.train_loader)[0], _all(other.train_loader)[0])


def test_train_eval_of_cifar_is_augmented_as_training():
    """CIFAR's train_eval images are augmented (random crop, flip, colour) training images:
    none equals the plain standardized version of any stored training image."""
    problem = get_problem("cifar10_3c3d", batch_size=4)
    loader = problem.train_loader
    stored = aug.per_image_standardization(loader._x[loader.indices].float())
    x, _y = _all(problem.train_eval_loader)
    assert x.shape == (8, 3, 32, 32)  # N_test // B = 8 // 4 batches of 4
    distance = torch.cdist(x.flatten(1), stored.flatten(1))
    assert distance.min() > 1.0
    # the same images evaluated without augmentation would be exact copies
    assert torch.cdist(stored[:3].flatten(1), stored.flatten(1)).min() == 0


def test_every_split_drops_its_last_incomplete_batch():
    """quadratic_deep with B = 128: 1,000 points per split give 7 batches (896 points) in
    each; the evaluated test loss is the mean of ½(1 − x)ᵀQ(1 − x) over those 896."""
    from cockpit.benchmark.runner import evaluate

    problem = get_problem("quadratic_deep")
    loaders = (problem.train_loader, problem.train_eval_loader, problem.valid_loader,
               problem.test_loader)
    assert [len(loader) for loader in loaders] == [7, 7, 7, 7]
    assert all(len(y) == 128 for loader in loaders for _, y in loader)
    x = torch.tensor(np.random.RandomState(43).normal(0, 0.6, (1000, 100)))[:896]
    hessian = problem.model.hessian.double()
    expected = (0.5 * ((1 - x) @ hessian * (1 - x)).sum(1)).mean()
    loss, accuracy = evaluate(problem, problem.test_loader)
    assert loss == pytest.approx(float(expected), rel=1e-5) and accuracy is None


def test_a_batch_larger_than_a_split_is_refused():
    with pytest.raises(ValueError, match="no complete batch in the train_eval split"):
        get_problem("digits_logreg", data="real", batch_size=400)
