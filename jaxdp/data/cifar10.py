"""Reader and downloader for the official CIFAR-10 python archive.

Source: https://www.cs.toronto.edu/~kriz/cifar.html. The archive holds
`cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}`; each batch
is a pickled dict with b"data" uint8 (n, 3072) in CHW row-major order and
b"labels" a list of ints.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tarfile
import tempfile
import urllib.request

import numpy as np

from .arrays import ArrayDataset, DatasetError

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
ARCHIVE_NAME = "cifar-10-python.tar.gz"
FOLDER_NAME = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
           "dog", "frog", "horse", "ship", "truck")


def _how_to_get(where: str) -> str:
    """The fix we suggest in every error: fetch the archive by hand."""
    return (
        f"download {CIFAR10_URL} (md5 {CIFAR10_MD5}) by hand and put "
        f"{ARCHIVE_NAME} or its extracted {FOLDER_NAME}/ in {os.path.abspath(where)}"
    )


# --------------------------------------------------------------------------
# Locating the files
# --------------------------------------------------------------------------

def find_cifar10(data_dir: str) -> tuple[str, str] | None:
    """Return ("folder"|"archive", path) or None if nothing is there.

    The extracted folder wins over the archive: reading it skips a 163 MB
    gunzip on every start.
    """
    if os.path.isfile(data_dir):
        return ("archive", data_dir)
    if any(os.path.isfile(os.path.join(data_dir, name))
           for name in TRAIN_BATCHES + (TEST_BATCH,)):
        return ("folder", data_dir)  # the batches folder itself (maybe partial)
    folder = os.path.join(data_dir, FOLDER_NAME)
    if os.path.isdir(folder):
        return ("folder", folder)
    archive = os.path.join(data_dir, ARCHIVE_NAME)
    if os.path.isfile(archive):
        return ("archive", archive)
    return None


def load_cifar10(data_dir: str, download: bool = False,
                 ) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, test) from data_dir, downloading the archive if asked."""
    found = find_cifar10(data_dir)
    if found is None and download:
        found = ("archive", download_cifar10(data_dir))
    if found is None:
        raise DatasetError(
            f"CIFAR-10 not found in {os.path.abspath(data_dir)}: "
            f"{_how_to_get(data_dir)}, or pass --download (download=True) to fetch it"
        )
    return read_cifar10(found[1])


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------

def file_md5(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def read_cifar10(path: str, expected_md5: str | None = CIFAR10_MD5,
                 ) -> tuple[ArrayDataset, ArrayDataset]:
    """Read (train, test) from the archive or the extracted folder at `path`.

    `expected_md5` checks the archive (None skips it; tests pass the md5 of a
    tiny archive they wrote). The extracted folder has no official checksum,
    so its batches are only checked for shape, dtype and label range.
    """
    if not os.path.exists(path):
        raise DatasetError(f"{path} does not exist: {_how_to_get(os.path.dirname(path) or '.')}")
    if os.path.isdir(path):
        batches = _read_folder(path)
    else:
        batches = _read_archive(path, expected_md5)
    train = _concat([batches[name] for name in TRAIN_BATCHES], "cifar10-train")
    test = _concat([batches[TEST_BATCH]], "cifar10-test")
    return train, test


def _read_folder(folder: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    parent = os.path.dirname(os.path.abspath(folder))
    batches = {}
    for name in TRAIN_BATCHES + (TEST_BATCH,):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise DatasetError(
                f"{path} is missing: re-extract {ARCHIVE_NAME}, or delete {folder} "
                f"and {_how_to_get(parent)}"
            )
        with open(path, "rb") as f:
            batches[name] = _parse_batch(f, path, parent)
    return batches


def _read_archive(path: str, expected_md5: str | None,
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    if expected_md5 is not None:
        got = file_md5(path)
        if got != expected_md5:
            raise DatasetError(
                f"{path} is corrupt or incomplete: md5 {got}, expected {expected_md5}; "
                f"delete it and {_how_to_get(os.path.dirname(os.path.abspath(path)))}"
            )
    where = os.path.dirname(os.path.abspath(path))
    batches = {}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for name in TRAIN_BATCHES + (TEST_BATCH,):
                member = f"{FOLDER_NAME}/{name}"
                try:
                    f = tar.extractfile(member)
                except KeyError:
                    f = None
                if f is None:
                    raise DatasetError(
                        f"{path} has no {member}, so it is not the CIFAR-10 python "
                        f"archive; {_how_to_get(where)}"
                    )
                batches[name] = _parse_batch(f, f"{path}:{member}", where)
    except DatasetError:
        raise
    except Exception as e:  # tarfile, gzip (OSError/EOFError) and zlib errors
        raise DatasetError(
            f"{path} is damaged ({type(e).__name__}: {e}); delete it and "
            f"{_how_to_get(where)}"
        ) from e
    return batches


class _BatchUnpickler(pickle.Unpickler):
    """Unpickler that only builds numpy arrays and plain containers.

    A CIFAR batch needs nothing else, and refusing other globals means a
    tampered file cannot run code (plain pickle.load would).
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes pickled with protocol < 3
    }

    def find_class(self, module, name):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def _parse_batch(f, name: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Unpickle one batch and convert CHW rows to NHWC uint8 images."""
    try:
        # encoding="bytes": the official files are Python 2 pickles.
        d = _BatchUnpickler(f, encoding="bytes").load()
        data, labels = d[b"data"], d[b"labels"]
        data = np.asarray(data)
        labels = np.asarray(labels, dtype=np.int64)
    except DatasetError:
        raise
    except Exception as e:
        raise DatasetError(
            f"{name} is not a valid CIFAR-10 batch ({type(e).__name__}: {e}); "
            f"delete it and {_how_to_get(where)}"
        ) from e
    if not _looks_like_batch(data, labels):
        raise DatasetError(
            f"{name} has unexpected contents (data {data.dtype} {data.shape}, "
            f"labels {labels.shape}); delete it and {_how_to_get(where)}"
        )
    # Each row is 1024 R, then 1024 G, then 1024 B values, row-major: CHW.
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


def _looks_like_batch(data: np.ndarray, labels: np.ndarray) -> bool:
    n = len(labels)
    return (
        data.dtype == np.uint8
        and data.shape == (n, 3072)
        and labels.ndim == 1
        and bool(np.all((labels >= 0) & (labels < len(CLASSES))))
    )


def _concat(parts, name: str) -> ArrayDataset:
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return ArrayDataset(images=images, labels=labels, name=name)


# --------------------------------------------------------------------------
# Downloading
# --------------------------------------------------------------------------

def download_cifar10(
    data_dir: str,
    url: str = CIFAR10_URL,
    expected_md5: str = CIFAR10_MD5,
    timeout: float = 60.0,
) -> str:
    """Download the archive into data_dir and return its path.

    Writes to a temporary file in the same directory and `os.replace`s it
    only after the md5 matches, so an interrupted or corrupt download never
    leaves a file that looks complete.
    """
    os.makedirs(data_dir, exist_ok=True)
    final = os.path.join(data_dir, ARCHIVE_NAME)
    if os.path.isfile(final) and file_md5(final) == expected_md5:
        return final
    fd, tmp = tempfile.mkstemp(prefix=f".{ARCHIVE_NAME}.", suffix=".part", dir=data_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            got = _fetch(url, out, timeout)
        if got != expected_md5:
            raise DatasetError(f"md5 {got}, expected {expected_md5}")
        os.replace(tmp, final)
        return final
    except BaseException as e:
        _remove_quietly(tmp)
        if not isinstance(e, Exception):  # KeyboardInterrupt: clean up, then stop
            raise
        raise DatasetError(
            f"downloading {url} failed ({type(e).__name__}: {e}); "
            f"{_how_to_get(data_dir)}"
        ) from e


def _fetch(url: str, out, timeout: float) -> str:
    """Stream url into the open file `out`; return the md5 of the bytes."""
    h = hashlib.md5()
    with urllib.request.urlopen(url, timeout=timeout) as response:
        for block in iter(lambda: response.read(1 << 20), b""):
            h.update(block)
            out.write(block)
    return h.hexdigest()


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
