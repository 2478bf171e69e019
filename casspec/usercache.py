"""Files in the user cache (`cache_root()`): keys, atomic writes, tolerant reads and a lock per entry.

Everything casspec learns on a machine and keeps for later processes goes through here: the kernel choice
(tune.py), the latency profile made on first use (autoprofile.py), the quantized level weights (levelstore.py)
and the acceptance / latency state a generation learns (state.py). A file is written to a temporary name and
renamed over the old one, so a reader never sees half a file; a missing, unreadable or malformed file reads
as absent (it is rebuilt, never a crash); `locked` keeps two processes from building the same entry at once.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from dsia.errors import warn

UNWRITABLE = "unwritable user cache"  # the warning key of a failed write: one line per process, not one per file
LOCK_TIMEOUT_S = 600.0  # longest wait for another process building the same entry before building it anyway


def digest(key: dict) -> str:
    """A short stable name for a key (a JSON-able dict of everything the entry depends on)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`; None when it is missing, unreadable or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_atomic(path: Path, data: bytes) -> bool:
    """Write `data` to `path` through a temporary file and a rename; False (with a warning) when it cannot."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return True
    except OSError as e:
        with suppress(OSError):  # (the folder may be a file, or gone)
            tmp.unlink(missing_ok=True)
        warn(f"cannot write {path} ({e.strerror}); it is rebuilt next time", UNWRITABLE)
        return False


def write_json(path: Path, obj: dict) -> bool:
    return write_atomic(path, json.dumps(obj, indent=1).encode())


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold `path`.lock while building the entry at `path` (another process waits, then finds it built)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except (OSError, Timeout):  # a read-only cache, or a stuck builder: build without the lock
        yield
        return
    try:
        yield
    finally:
        lock.release()
