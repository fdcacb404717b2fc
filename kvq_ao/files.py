"""Writing files so that no reader ever sees half of one.

Every file kvq_ao writes (calibrations, configs, layer profiles, tuned configs, exported programs)
goes through `atomic_write` or `replacing`: the bytes go to a temporary file in the same folder,
are flushed to disk, and the temporary file is renamed over the target (`os.replace`, atomic on
POSIX and Windows). A killed process leaves the old file or the new one, never a prefix; two
writers racing on one path leave one of their two files whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | Path):
    """Yields a temporary path beside `path`; when the block ends without an error, that file
    (which the block must have written) replaces `path`. On an error it is removed and `path` is
    left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def sha256_of(path: str | Path) -> str:
    """The hex sha256 of a file, read in 4 MiB blocks (model weights are hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write `data` (text as UTF-8) to `path` atomically; returns `path`."""
    path = Path(path)
    with replacing(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def checksum_path(path: str | Path) -> Path:
    """Where `record_checksum` keeps a file's checksum: `<file>.sha256`, beside it."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def record_checksum(path: str | Path) -> Path:
    """Write `<file>.sha256` for a file kvq_ao produced, in sha256sum's format (so `sha256sum -c
    <file>.sha256` checks it too); `verify_checksum` checks it before the file is trusted."""
    path = Path(path)
    return atomic_write(checksum_path(path), f"{sha256_of(path)}  {path.name}\n")


def verify_checksum(path: str | Path) -> None:
    """Raise ValueError naming the file unless it matches the checksum `record_checksum` wrote."""
    path = Path(path)
    record = checksum_path(path)
    if not record.is_file():
        raise ValueError(f"{path}: no recorded checksum ({record.name} is missing: exported by an older kvq_ao, or copied "
                         "without it); export it again, or pass verify=False to load it unchecked")  # fmt: skip
    want = record.read_text(errors="replace").split()[:1]
    if want != [sha256_of(path)]:
        raise ValueError(f"{path}: differs from the sha256 recorded in {record.name} at export (damaged or edited since)")


__all__ = ["atomic_write", "checksum_path", "record_checksum", "replacing", "sha256_of", "verify_checksum"]
