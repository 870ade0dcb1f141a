"""Tests for the numpy data pipeline (jaxdp.data), against independent references.

torch is used only as the reference for DistributedSampler and normalisation.
No test touches the network: downloads go through a monkeypatched urlopen.
"""

import ast
import gc
import hashlib
import io
import math
import os
import pickle
import struct
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler as TorchSampler

from jaxdp.data import (
    CIFAR10_MEAN, CIFAR10_STD, DATASETS, ArrayDataset, Batch, DatasetError,
    DistributedSampler, Prefetcher, augment, augment_params, download_cifar10,
    epoch_batches, epoch_permutation, eval_batches, find_cifar10, load_dataset, make_synthetic,
    normalize, partition, read_cifar10, steps_per_epoch,
)
from jaxdp.data import cifar10 as cifar10_mod


def torch_perm(n, seed, epoch):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).numpy()


def random_images(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)


# --------------------------------------------------------------------------
# Package hygiene
# --------------------------------------------------------------------------

def _imports(path: Path) -> list:
    """The absolute module names ``path`` imports (``from a.b import c``: ``a.b``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append(node.module)
    return found


def test_package_imports_only_numpy_and_stdlib():
    """Both frameworks import this package; it must not pull in either. (The digits source
    reads scikit-learn's bundled data, inside its loader, behind the [digits] extra; the dataset
    names come from jaxdp.names, the name table, which imports the standard library alone.)"""
    root = Path(__file__).resolve().parents[1] / "jaxdp"
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert {m.split(".")[0] for m in _imports(root / "names.py")} <= stdlib
    for path in (root / "data").glob("*.py"):
        allowed = stdlib | {"numpy"} | ({"sklearn"} if path.name == "digits.py" else set())
        for module in _imports(path):
            assert module == "jaxdp.names" or module.split(".")[0] in allowed, f"{path.name} imports {module}"


# --------------------------------------------------------------------------
# Sampler: index-for-index against torch.utils.data.DistributedSampler
# --------------------------------------------------------------------------

SAMPLER_CASES = [
    (n, r, drop_last)
    for n in (0, 1, 2, 3, 5, 7, 8, 10, 16, 17, 50, 101)
    for r in (1, 2, 3, 4, 8)
    for drop_last in (False, True)
]


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_matches_torch(shuffle):
    for n, r, drop_last in SAMPLER_CASES:
        for seed, epoch in ((0, 0), (3, 2)):
            perm = torch_perm(n, seed, epoch) if shuffle else None
            rows = partition(perm if shuffle else np.arange(n), r, drop_last)
            for rank in range(r):
                ref = TorchSampler(range(n), num_replicas=r, rank=rank, shuffle=shuffle,
                                   seed=seed, drop_last=drop_last)
                ref.set_epoch(epoch)
                ours = DistributedSampler(n, r, rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last)
                ours.set_epoch(epoch)
                expected = list(ref)
                case = (n, r, drop_last, shuffle, seed, epoch, rank)
                assert ours.indices(perm).tolist() == expected, case
                assert rows[rank].tolist() == expected, case
                assert len(ours) == len(ref), case
                if not shuffle:
                    assert list(ours) == expected, case


def test_partition_shape_and_padding_repeats_head():
    perm = np.array([4, 2, 0, 1, 3])
    rows = partition(perm, 4, drop_last=False)  # total 8: pad 3 from the head
    assert rows.shape == (4, 2) and rows.dtype == np.int64
    assert rows.T.reshape(-1).tolist() == [4, 2, 0, 1, 3, 4, 2, 0]
    assert partition(perm, 4, drop_last=True).tolist() == [[4], [2], [0], [1]]
    assert partition(np.arange(3), 8, drop_last=True).shape == (8, 0)


def test_sampler_shuffle_uses_epoch_permutation():
    s = DistributedSampler(20, 2, 1, seed=5)
    s.set_epoch(3)
    np.testing.assert_array_equal(epoch_permutation(20, 5, 3),
                                  np.random.default_rng(8).permutation(20))
    assert s.indices().tolist() == partition(epoch_permutation(20, 5, 3), 2, False)[1].tolist()
    assert list(s) == s.indices().tolist()
    assert not np.array_equal(epoch_permutation(20, 5, 3), epoch_permutation(20, 5, 4))


@pytest.mark.parametrize("args", [(10, 0, 0), (10, 2, 2), (10, 2, -1), (-1, 1, 0)])
def test_sampler_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        DistributedSampler(*args)


def test_sampler_rejects_wrong_permutation_length():
    with pytest.raises(ValueError):
        DistributedSampler(10, 2, 0).indices(np.arange(9))


# --------------------------------------------------------------------------
# CIFAR-10 reader on a tiny archive in the official format
# --------------------------------------------------------------------------

TINY_COUNTS = {**{f"data_batch_{i}": i for i in range(1, 6)}, "test_batch": 4}


def chw_pattern(n, offset):
    """Row i of a batch: value at (c, y, x) = (offset + 7i + 50c + 3y + x) % 256."""
    i, c, y, x = np.meshgrid(np.arange(n), np.arange(3), np.arange(32), np.arange(32),
                             indexing="ij")
    return ((offset + 7 * i + 50 * c + 3 * y + x) % 256).astype(np.uint8)


def expected_hwc(n, offset):
    """The same pattern written independently in HWC order, pixel by pixel."""
    out = np.zeros((n, 32, 32, 3), np.uint8)
    for i in range(n):
        for y in range(32):
            for x in range(32):
                for c in range(3):
                    out[i, y, x, c] = (offset + 7 * i + 50 * c + 3 * y + x) % 256
    return out


def tiny_batches():
    batches = {}
    for k, (name, n) in enumerate(TINY_COUNTS.items()):
        data = chw_pattern(n, offset=11 * k).reshape(n, 3072)
        labels = [(k + j) % 10 for j in range(n)]
        batches[name] = {b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [b"img%d.png" % j for j in range(n)]}
    return batches


class _Py2Pickler(pickle._Pickler):
    """Writes bytes and str as Python 2 `str` (BINSTRING), as the official
    files do; unpickled with encoding="bytes" they come back as bytes, e.g.
    the dtype's b"u1" and b"|"."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_bytes(self, obj):
        obj_bytes = obj.encode("ascii") if isinstance(obj, str) else obj
        n = len(obj_bytes)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj_bytes)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", n) + obj_bytes)
        self.memoize(obj)

    dispatch[bytes] = save_bytes
    dispatch[str] = save_bytes


def py2_pickle(obj):
    """A pickle shaped like the Python 2 CIFAR files (numpy.core module path)."""
    f = io.BytesIO()
    _Py2Pickler(f, protocol=2).dump(obj)
    blob = f.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
    assert b"_codecs" not in blob
    return blob


def write_archive(path, batches, extra=None):
    with tarfile.open(path, "w:gz") as tar:
        members = {name: py2_pickle(d) for name, d in batches.items()}
        assert all(b"cnumpy.core.multiarray\n_reconstruct" in m for m in members.values())
        members["batches.meta"] = py2_pickle({b"label_names": [b"airplane"]})
        members.update(extra or {})
        for name, blob in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return path


def md5(path):
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def tiny_archive(tmp_path):
    return write_archive(tmp_path / "cifar-10-python.tar.gz", tiny_batches())


def check_tiny(train, test):
    exp_train = np.concatenate([expected_hwc(TINY_COUNTS[f"data_batch_{i}"], 11 * (i - 1))
                                for i in range(1, 6)])
    np.testing.assert_array_equal(train.images, exp_train)
    np.testing.assert_array_equal(test.images, expected_hwc(4, 11 * 5))
    exp_labels = [(k + j) % 10 for k in range(5) for j in range(k + 1)]
    assert train.labels.tolist() == exp_labels and train.labels.dtype == np.int64
    assert test.labels.tolist() == [5, 6, 7, 8]
    assert train.images.dtype == np.uint8 and train.images.flags.c_contiguous


def test_cifar_reads_archive_and_folder(tiny_archive, tmp_path):
    check_tiny(*read_cifar10(str(tiny_archive), expected_md5=md5(tiny_archive)))
    with tarfile.open(tiny_archive) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    folder = tmp_path / "x" / "cifar-10-batches-py"
    check_tiny(*read_cifar10(str(folder)))
    # load_dataset accepts the folder itself or its parent (no md5 for folders).
    check_tiny(*load_dataset("cifar10", str(folder)))
    check_tiny(*load_dataset("cifar10", str(tmp_path / "x")))
    assert find_cifar10(str(tiny_archive)) == ("archive", str(tiny_archive))
    assert find_cifar10(str(tmp_path)) == ("archive", str(tiny_archive))
    assert find_cifar10(str(tmp_path / "x")) == ("folder", str(folder))
    assert find_cifar10(str(folder)) == ("folder", str(folder))
    assert find_cifar10(str(tmp_path / "x" / "nothing")) is None


def test_cifar_dir_with_archive_checks_official_md5(tiny_archive, tmp_path):
    with pytest.raises(DatasetError, match="md5") as e:
        load_dataset("cifar10", str(tmp_path))
    assert "cifar-10-python.tar.gz" in str(e.value)
    assert cifar10_mod.CIFAR10_MD5 in str(e.value) and md5(tiny_archive) in str(e.value)


def test_cifar_truncated_archive(tiny_archive, tmp_path):
    blob = Path(tiny_archive).read_bytes()
    bad = tmp_path / "truncated.tar.gz"
    bad.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DatasetError, match="truncated.tar.gz"):
        read_cifar10(str(bad), expected_md5=None)
    with pytest.raises(DatasetError, match="truncated.tar.gz.*md5"):
        read_cifar10(str(bad), expected_md5=md5(tiny_archive))


def test_cifar_bad_pickle_in_archive_and_folder(tmp_path):
    batches = tiny_batches()
    del batches["data_batch_3"]
    bad = write_archive(tmp_path / "bad.tar.gz", batches, {"data_batch_3": b"not a pickle"})
    with pytest.raises(DatasetError, match="bad.tar.gz:cifar-10-batches-py/data_batch_3"):
        read_cifar10(str(bad), expected_md5=md5(bad))
    with tarfile.open(bad) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    with pytest.raises(DatasetError, match="data_batch_3"):
        read_cifar10(str(tmp_path / "x" / "cifar-10-batches-py"))


def test_cifar_refuses_pickled_code_and_wrong_shapes(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name, d in tiny_batches().items():
        (folder / name).write_bytes(pickle.dumps(d))
    marker = tmp_path / "pwned"
    (folder / "test_batch").write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(DatasetError, match="test_batch"):
        read_cifar10(str(folder))
    assert not marker.exists()
    wrong = {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}
    (folder / "test_batch").write_bytes(pickle.dumps(wrong))
    with pytest.raises(DatasetError, match="test_batch"):
        read_cifar10(str(folder))
    (folder / "test_batch").unlink()
    with pytest.raises(DatasetError, match="test_batch is missing"):
        read_cifar10(str(folder))


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_cifar_missing_says_where_to_download(tmp_path):
    with pytest.raises(DatasetError) as e:
        load_dataset("cifar10", str(tmp_path / "nowhere"))
    msg = str(e.value)
    assert cifar10_mod.CIFAR10_URL in msg and "nowhere" in msg and "\n" not in msg


# --------------------------------------------------------------------------
# Download (network never touched)
# --------------------------------------------------------------------------

def test_download_failure_leaves_no_temp_file(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    with pytest.raises(DatasetError, match="by hand") as e:
        download_cifar10(str(tmp_path))
    assert str(tmp_path) in str(e.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DatasetError):
        load_dataset("cifar10", str(tmp_path), download=True)
    assert list(tmp_path.iterdir()) == []


def test_download_md5_mismatch_and_success(tiny_archive, tmp_path, monkeypatch):
    blob = Path(tiny_archive).read_bytes()
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: io.BytesIO(blob))
    dest = tmp_path / "dl"
    with pytest.raises(DatasetError, match="md5"):
        download_cifar10(str(dest))  # official md5 != tiny archive's
    assert list(dest.iterdir()) == []
    path = download_cifar10(str(dest), expected_md5=md5(tiny_archive))
    assert os.listdir(dest) == ["cifar-10-python.tar.gz"]
    check_tiny(*read_cifar10(path, expected_md5=md5(tiny_archive)))


def test_download_interrupted_mid_stream(tmp_path, monkeypatch):
    class Broken(io.BytesIO):
        def read(self, size=-1):
            if self.tell() > 0:
                raise ConnectionResetError("reset by peer")
            return super().read(10)

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: Broken(b"x" * 100))
    with pytest.raises(DatasetError, match="ConnectionResetError"):
        download_cifar10(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------
# load_dataset / ArrayDataset
# --------------------------------------------------------------------------

def test_load_dataset_names():
    assert DATASETS == ("synthetic", "cifar10", "digits")
    with pytest.raises(DatasetError, match="synthetic, cifar10, digits"):
        load_dataset("imagenet")
    train, test = load_dataset("synthetic", synthetic_size=(30, 20), seed=1)
    assert (len(train), len(test)) == (30, 20)


def test_array_dataset_validates():
    with pytest.raises(ValueError):
        ArrayDataset(np.zeros((2, 32, 32, 3), np.float32), np.zeros(2, np.int64), "x")
    with pytest.raises(ValueError):
        ArrayDataset(np.zeros((2, 32, 32, 3), np.uint8), np.zeros(3, np.int64), "x")


# --------------------------------------------------------------------------
# Augmentation and normalisation
# --------------------------------------------------------------------------

def reference_augment(image, dy, dx, flip):
    padded = np.zeros((40, 40, 3), np.uint8)
    padded[4:36, 4:36] = image
    crop = padded[dy:dy + 32, dx:dx + 32]
    return crop[:, ::-1] if flip else crop


def test_augment_is_a_real_crop_and_flip():
    images = random_images(64, seed=1)
    idx = np.arange(1000, 1064)
    out = augment(images, idx, seed=0, epoch=0)
    dy, dx, flip = augment_params(idx, 0, 0)
    assert out.dtype == np.uint8 and out.shape == images.shape
    for i in range(64):
        np.testing.assert_array_equal(out[i], reference_augment(images[i], dy[i], dx[i], flip[i]))
    # Independent of augment_params: each output is one of the 162 candidates.
    for i in range(4):
        candidates = [reference_augment(images[i], y, x, f)
                      for y in range(9) for x in range(9) for f in (False, True)]
        assert any(np.array_equal(out[i], c) for c in candidates)


def test_augment_depends_only_on_seed_epoch_index():
    images = random_images(48, seed=2)
    idx = np.random.default_rng(0).permutation(10_000)[:48]
    whole = augment(images, idx, seed=7, epoch=3)
    order = np.random.default_rng(1).permutation(48)
    shuffled = augment(images[order], idx[order], seed=7, epoch=3)
    np.testing.assert_array_equal(shuffled, whole[order])
    grouped = augment(images.reshape(4, 12, 32, 32, 3), idx.reshape(4, 12), seed=7, epoch=3)
    np.testing.assert_array_equal(grouped.reshape(whole.shape), whole)
    single = np.stack([augment(images[i:i + 1], idx[i:i + 1], 7, 3)[0] for i in range(48)])
    np.testing.assert_array_equal(single, whole)
    assert not np.array_equal(augment(images, idx, seed=7, epoch=4), whole)
    assert not np.array_equal(augment(images, idx, seed=8, epoch=3), whole)


def test_augment_statistics():
    dy, dx, flip = augment_params(np.arange(20_000), seed=0, epoch=0)
    assert abs(flip.mean() - 0.5) < 0.02
    for offs in (dy, dx):
        counts = np.bincount(offs, minlength=9)
        assert counts.shape == (9,) and counts.min() > 0.9 * 20_000 / 9
    assert abs(np.corrcoef(dy, dx)[0, 1]) < 0.03
    dy2, _, flip2 = augment_params(np.arange(20_000), seed=0, epoch=1)
    assert (flip != flip2).mean() > 0.4 and (dy != dy2).mean() > 0.8


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normalize_matches_torch(dtype):
    x = random_images(16, seed=3)
    x[0] = 0
    x[1] = 255
    ref = (torch.tensor(x).float() / 255 - torch.tensor(CIFAR10_MEAN)) / torch.tensor(CIFAR10_STD)
    out = normalize(x, dtype=dtype)
    assert out.dtype == dtype and out.shape == x.shape
    np.testing.assert_array_equal(out.astype(np.float32), ref.numpy())


# --------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_dataset():
    n = 103
    labels = np.random.default_rng(4).integers(0, 10, n)
    return ArrayDataset(random_images(n, seed=4), labels.astype(np.int64), "small")


def test_steps_per_epoch():
    assert steps_per_epoch(103, 4, 8) == 3        # 26 per rank
    assert steps_per_epoch(103, 4, 8, drop_last=True) == 3  # 25 per rank
    assert steps_per_epoch(50_000, 8, 128) == 48
    with pytest.raises(ValueError, match="too small"):
        steps_per_epoch(10, 4, 8)


@pytest.mark.parametrize("drop_last", [False, True])
def test_epoch_batches_follow_sampler(small_dataset, drop_last):
    r, b, seed, epoch = 4, 8, 5, 2
    batches = list(epoch_batches(small_dataset, num_replicas=r, batch_per_replica=b,
                                 epoch=epoch, seed=seed, drop_last=drop_last))
    steps = steps_per_epoch(len(small_dataset), r, b, drop_last)
    assert len(batches) == steps
    for rank in range(r):
        s = DistributedSampler(len(small_dataset), r, rank, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        got = np.concatenate([batch.indices[rank] for batch in batches])
        np.testing.assert_array_equal(got, s.indices()[:steps * b])
    first = batches[0]
    assert first.images.shape == (r, b, 32, 32, 3) and first.images.dtype == np.float32
    assert first.labels.shape == (r, b) and first.labels.dtype == np.int32
    assert isinstance(first, Batch) and first.indices.dtype == np.int64 and first.mask is None
    np.testing.assert_array_equal(first.labels, small_dataset.labels[first.indices])
    raw = small_dataset.images[first.indices]
    np.testing.assert_array_equal(first.images, normalize(augment(raw, first.indices, seed, epoch)))


def test_epoch_batches_torch_permutation_eval_mode_ranks_and_resume(small_dataset):
    n, r, b = len(small_dataset), 3, 5
    kw = dict(num_replicas=r, batch_per_replica=b, epoch=1, seed=2)
    perm = torch_perm(n, 2, 1)
    batches = list(epoch_batches(small_dataset, permutation=perm, **kw))
    for rank in range(r):
        torch_s = TorchSampler(range(n), num_replicas=r, rank=rank, seed=2)
        torch_s.set_epoch(1)
        expected = list(torch_s)[: len(batches) * b]
        assert np.concatenate([x.indices[rank] for x in batches]).tolist() == expected
    # Eval mode: sequential order, no augmentation.
    ev = list(epoch_batches(small_dataset, train=False, **kw))
    np.testing.assert_array_equal(ev[0].indices, partition(np.arange(n), r, False)[:, :b])
    np.testing.assert_array_equal(ev[0].images, normalize(small_dataset.images[ev[0].indices]))
    # ranks picks rows; start_step skips steps, both without changing content.
    full = list(epoch_batches(small_dataset, **kw))
    part = list(epoch_batches(small_dataset, ranks=[2, 0], start_step=2, **kw))
    assert len(part) == len(full) - 2
    for a, f in zip(part, full[2:]):
        np.testing.assert_array_equal(a.indices, f.indices[[2, 0]])
        np.testing.assert_array_equal(a.images, f.images[[2, 0]])
    assert list(epoch_batches(small_dataset, start_step=len(full), **kw)) == []
    with pytest.raises(ValueError):
        epoch_batches(small_dataset, start_step=len(full) + 1, **kw)
    with pytest.raises(ValueError):
        epoch_batches(small_dataset, ranks=[3], **kw)


@pytest.mark.parametrize("r,b", [(4, 8), (3, 5), (1, 103), (2, 60)])
def test_eval_batches_cover_every_sample_once(small_dataset, r, b):
    batches = list(eval_batches(small_dataset, num_replicas=r, batch_per_replica=b))
    assert len(batches) == math.ceil(103 / (r * b))
    seen = np.concatenate([x.indices[x.mask] for x in batches])
    assert sorted(seen.tolist()) == list(range(103))
    for x in batches:
        assert x.images.shape == (r, b, 32, 32, 3) and x.mask.shape == (r, b)
        assert x.mask.dtype == bool
        np.testing.assert_array_equal(x.images, normalize(small_dataset.images[x.indices]))
        np.testing.assert_array_equal(x.labels, small_dataset.labels[x.indices])


# --------------------------------------------------------------------------
# Prefetcher
# --------------------------------------------------------------------------

def test_prefetcher_preserves_order_and_transforms():
    assert list(Prefetcher(range(50))) == list(range(50))
    seen_threads = set()

    def square(x):
        seen_threads.add(threading.current_thread().name)
        return x * x

    assert list(Prefetcher(iter(range(10)), size=3, transform=square)) == [i * i for i in range(10)]
    assert seen_threads == {"jaxdp-prefetch"}


def test_prefetcher_reraises_producer_exception():
    def gen():
        yield 1
        yield 2
        raise KeyError("boom")

    p = Prefetcher(gen())
    assert next(p) == 1 and next(p) == 2
    with pytest.raises(KeyError, match="boom"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)
    assert not p.alive


def wait_dead(thread_check, timeout=3.0):
    deadline = time.monotonic() + timeout
    while thread_check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not thread_check()


def test_prefetcher_close_and_garbage_stop_the_thread():
    def forever():
        i = 0
        while True:
            yield i
            i += 1

    p = Prefetcher(forever(), size=2)
    assert [next(p) for _ in range(5)] == list(range(5))
    p.close()
    assert not p.alive
    with pytest.raises(StopIteration):
        next(p)

    with Prefetcher(forever()) as p2:
        next(p2)
    assert not p2.alive

    p3 = Prefetcher(forever())
    next(p3)
    thread = p3._thread
    del p3
    gc.collect()
    assert wait_dead(thread.is_alive)


# --------------------------------------------------------------------------
# Synthetic dataset
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synthetic():
    return make_synthetic(2000, 1000, seed=0)


def test_synthetic_deterministic_shapes_balanced(synthetic):
    train, test = synthetic
    assert train.images.shape == (2000, 32, 32, 3) and train.images.dtype == np.uint8
    assert train.labels.dtype == np.int64 and len(test) == 1000
    assert np.bincount(train.labels).tolist() == [200] * 10
    again_train, again_test = make_synthetic(2000, 1000, seed=0)
    np.testing.assert_array_equal(again_train.images, train.images)
    np.testing.assert_array_equal(again_train.labels, train.labels)
    _, other_test = make_synthetic(500, 1000, seed=0)  # test set ignores num_train
    np.testing.assert_array_equal(other_test.images, test.images)
    different, _ = make_synthetic(2000, 10, seed=1)
    assert not np.array_equal(different.images, train.images)
    assert 0 < train.images.std() and train.images.min() == 0 and train.images.max() == 255


def nearest_class_mean_accuracy(train_x, train_y, test_x, test_y):
    means = np.stack([train_x[train_y == k].mean(0) for k in range(10)])
    dist = ((test_x[:, None, :] - means[None]) ** 2).sum(-1)
    return (dist.argmin(1) == test_y).mean()


def test_synthetic_is_learnable_but_not_by_mean_colour(synthetic):
    train, test = synthetic
    flat = lambda d: d.images.reshape(len(d), -1).astype(np.float32)  # noqa: E731
    colour = lambda d: d.images.mean(axis=(1, 2))  # noqa: E731
    pixels = nearest_class_mean_accuracy(flat(train), train.labels, flat(test), test.labels)
    mean_colour = nearest_class_mean_accuracy(colour(train), train.labels, colour(test),
                                              test.labels)
    assert pixels > 0.5, pixels
    assert mean_colour < 0.2, mean_colour
