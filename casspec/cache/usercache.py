"""Files in the user cache (`cache_root()`): keys, atomic writes, verified reads and a lock per entry.

Everything casspec learns on a machine and keeps for later processes goes through here: the kernel choice
(tune.py), the latency profile made on first use (autoprofile.py), the quantized level weights (levelstore.py),
the acceptance / latency state a generation learns (state.py) and the dequantized GGUF entries (loading.py).
What is read back is trusted only as far as it is what casspec wrote:

- a file or folder is read only if it belongs to this user (a link: the link and what it points to), so that a
  user who can write to the cache folder cannot plant one for another;
- a file is written under a fresh, unpredictable name in its folder (tempfile.mkstemp: created exclusively, a link
  planted there is never followed, mode 0600) and renamed over the old one: a reader never sees half a file;
- a file written with its checksum (write_verified: `<name>.sha256` beside it) is read back only if the bytes
  read match it (read_verified): what is hashed is what is returned;
- an entry folder is built in a private folder (tempfile.mkdtemp, mode 0700) named `<entry>.tmp<pid>-<random>`
  and swapped in; it is used only if it holds exactly the files its manifest lists, each of its size and
  sha256 (entry_problem);
- JSON is read bounded: at most JSON_MAX_BYTES (read no further), nested at most JSON_MAX_DEPTH.

A missing, unreadable, foreign or malformed file reads as absent (it is rebuilt, never a crash); `locked` keeps two
processes from building the same entry at once (filelock, which refuses a link planted at the lock's name).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, TypeVar

from filelock import FileLock, Timeout

from dsia.errors import CasspecError, warn
from dsia.levels import LEVELS_VERSION

T = TypeVar("T")
UNWRITABLE = "unwritable user cache"  # the warning key of a failed write: one line per process, not one per file
LOCK_TIMEOUT_S = 600.0  # longest wait for another process building the same entry before building it anyway
STALE_BUILD_S = 6 * 3600.0  # a build folder `<entry>.tmp<pid>-...` this old is a dead run's even if its pid was reused
SUM_SUFFIX = ".sha256"  # write_verified's checksum file: `<name>.sha256`, JSON {"size", "sha256"}
JSON_MAX_BYTES = 4 << 20  # config.json, generation_config.json, the user cache's JSON (real ones: at most ~100 KB)
JSON_MAX_DEPTH = 64  # nesting of JSON objects and arrays (a config: about 4)


class ChecksumError(CasspecError):
    """A file of the user cache that is not what was written (its sha256 differs from the one written with it)."""


def digest(key: dict) -> str:
    """A short stable name for a key (a JSON-able dict of everything the entry depends on)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_root() -> Path:
    """The user cache's folder: $CASSPEC_CACHE, else $XDG_CACHE_HOME/casspec, else ~/.cache/casspec."""
    if os.environ.get("CASSPEC_CACHE"):
        return Path(os.environ["CASSPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "casspec"


def entry_path(kind: str, key: dict) -> Path:
    """The JSON entry of `key` (which names a "model" and a "dtype") among the user cache's `kind` (profiles,
    planes, state): `<kind>/<model>-<dtype>-<digest>.json`."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", key["model"])[:60]
    return cache_root() / kind / f"{slug}-{key['dtype']}-{digest(key)}.json"


def machine_key(machine: dict) -> dict:
    """What identifies the machine in a cache key (machine: dytc.machine.machine_info): CPU model and ISA flags, GPU,
    torch version, threads."""
    return {k: machine[k] for k in ("cpu", "cpu_flags", "gpu", "torch", "threads")}


def profile_key(machine: dict, model: str, dtype: str, kernels: str = "") -> dict:
    """Everything a forward's timings depend on (machine: dytc.machine.machine_info; kernels: the engine's build,
    `Engine.build`: its dense kernels, loops and on a GPU its graphs, compiled steps and fused projections): the key
    of latency profiles, kept state and, with its own settings, levels planes."""
    return {**machine_key(machine), "model": model, "dtype": dtype, "kernels": kernels, "levels": LEVELS_VERSION}


def owned(path: Path) -> bool:
    """Whether `path` exists and is this user's: the path itself (a link is not followed) and, for a link, what it
    points to."""
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid():
            st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.geteuid()


def open_regular(path: Path, nofollow: bool = False) -> BinaryIO:
    """`path` opened for reading if it is a regular file (a FIFO or a device would block or never end); nofollow:
    a link is refused (OSError ELOOP)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (os.O_NOFOLLOW if nofollow else 0)
    fd = os.open(path, flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(21, "not a regular file", str(path))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_hashed(f: BinaryIO, view: memoryview, path: Path, chunk: int = 16 << 20) -> str:
    """Fill `view` from the file `f` (at `path`) and return the sha256 of those bytes: each chunk is hashed on a
    worker thread while the next one is read (0.30 s for a 538 MB file, where reading then hashing takes 0.50 s)."""
    h, done, pending = hashlib.sha256(), 0, None
    with ThreadPoolExecutor(1) as pool:
        while done < len(view):
            n = f.readinto(view[done:done + chunk])
            if not n:
                raise CasspecError(f"{path} got shorter while it was read: load it again once it is complete")
            if pending is not None:
                pending.result()
            pending, done = pool.submit(h.update, view[done:done + n]), done + n
        if pending is not None:
            pending.result()
    return h.hexdigest()


def json_depth(obj: object, limit: int = JSON_MAX_DEPTH) -> int:
    """How deep lists and dicts nest in `obj` (without recursion; stops counting past `limit`)."""
    deepest, stack = 0, [(obj, 1)]
    while stack and deepest <= limit:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):  # (only containers are pushed, but the first value may be a scalar)
            deepest = max(deepest, d)
            inner = o.values() if isinstance(o, dict) else o
            stack.extend((v, d + 1) for v in inner if isinstance(v, (dict, list)))
    return deepest


def parse_json(data: bytes | str, what: str, max_bytes: int = JSON_MAX_BYTES) -> object:
    """The JSON value in `data` (CasspecError: over max_bytes, nested over JSON_MAX_DEPTH or not JSON; `what` names
    it)."""
    if len(data) > max_bytes:
        raise CasspecError(f"{what} holds over {max_bytes >> 20} MB of JSON: fix or replace it")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:  # (the C decoder stops deep nesting with a RecursionError)
        raise CasspecError(f"{what} is not valid JSON ({type(e).__name__}: {str(e)[:80]}): fix or replace it") from None
    if json_depth(obj) > JSON_MAX_DEPTH:
        raise CasspecError(f"{what} nests JSON more than {JSON_MAX_DEPTH} deep: fix or replace it")
    return obj


def read_json_file(path: Path) -> object:
    """The JSON value in the file `path`, read no further than JSON_MAX_BYTES (OSError: cannot be read)."""
    with open_regular(path) as f:
        data = f.read(min(os.fstat(f.fileno()).st_size, JSON_MAX_BYTES) + 1)  # (more than the cap: refused)
    return parse_json(data, str(path))


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`; None when it is missing, unreadable, another user's, too big or deep, or not a
    JSON object."""
    if not owned(path):
        return None
    try:
        data = read_json_file(path)
    except (OSError, CasspecError):
        return None
    return data if isinstance(data, dict) else None


def write_atomic(path: Path, data: bytes) -> bool:
    """Write `data` to `path` through a fresh temporary file and a rename; False (with a warning) when it cannot."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not owned(path.parent):
            raise PermissionError(1, "the folder belongs to another user")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError as e:
        with suppress(OSError, TypeError):  # (the folder may be a file, or gone)
            os.unlink(tmp)
        warn(f"cannot write {path} ({e.strerror}); it is rebuilt next time", UNWRITABLE)
        return False


def write_json(path: Path, obj: dict) -> bool:
    return write_atomic(path, json.dumps(obj, indent=1).encode())


def file_record(path: Path) -> dict:
    """What a manifest keeps of a file: its size and sha256 (a link is not followed)."""
    with open_regular(path, nofollow=True) as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def write_verified(path: Path, data: bytes) -> bool:
    """Write `data` to `path` and its size and sha256 to `<path>.sha256` (read back by read_verified)."""
    record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return write_atomic(path, data) and write_json(path.with_name(path.name + SUM_SUFFIX), record)


def read_verified(path: Path) -> bytearray:
    """The bytes of a file write_verified wrote, read once and checked against its checksum file: FileNotFoundError
    when either is missing, ChecksumError when they are not this user's or do not match."""
    sums = path.with_name(path.name + SUM_SUFFIX)
    if not (path.exists() and sums.exists()):
        raise FileNotFoundError(2, "not in the cache", str(path))
    record = read_json(sums)
    if record is None or not owned(path):
        raise ChecksumError(f"{path.name} or its checksum file is unreadable or another user's")
    with open_regular(path, nofollow=True) as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size if size == record.get("size") else 0)
        if size != record.get("size") or read_hashed(f, memoryview(data), path) != record.get("sha256"):
            raise ChecksumError(f"{path.name} does not match its checksum")
    return data


def read_manifest(path: Path, expect: dict) -> dict | None:
    """The entry manifest `path` when it holds `expect`'s items and lists files (plain names -> {"size": int,
    "sha256": str}) beside it; else None (absent, stale or malformed)."""
    m = read_json(path)
    files = m.get("files") if m is not None else None
    if m is None or any(m.get(k) != v for k, v in expect.items()) or not isinstance(files, dict) or not files:
        return None
    ok = all(Path(n).name == n and not n.startswith(".") and n != path.name and isinstance(r, dict)
             and type(r.get("size")) is int and isinstance(r.get("sha256"), str) for n, r in files.items())
    return m if ok else None


def entry_problem(entry: Path, files: dict, deferred: frozenset[str] = frozenset(), keep: tuple[str, ...] = ()) -> \
        str | None:
    """Why the entry folder is not what its manifest's `files` (name -> {"size", "sha256"}) list: a file missing,
    a link, another user's, of another size or sha256 (except the `deferred` ones, checked as they are read), or a
    name the manifest does not list (but `keep`: the manifest, the levels folder). None: it is."""
    if not owned(entry):
        return "the folder is another user's"
    try:
        extra = sorted(set(os.listdir(entry)) - set(files) - set(keep))
    except OSError as e:
        return f"the folder cannot be read ({e.strerror})"
    if extra:
        return f"it holds {extra[0]}, which its manifest does not list"
    for name, rec in files.items():
        path = entry / name
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != rec["size"]:
                return f"{name} is not the file that was written"
            if name not in deferred and file_record(path)["sha256"] != rec["sha256"]:
                return f"{name} does not match its checksum"
        except (OSError, KeyError, TypeError):
            return f"{name} is missing or unreadable"
    return None


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold `path`.lock while building the entry at `path` (another process waits, then finds it built)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except (OSError, Timeout):  # a read-only cache, a link planted at the lock's name, a stuck builder: build
        yield  # without the lock
        return
    try:
        yield
    finally:
        lock.release()


def read_or_measure(path: Path, read: Callable[[], T | None], measure: Callable[[], dict],
                    parse: Callable[[dict], T], notice: str) -> T:
    """A JSON entry of the user cache measured once per machine (a latency profile, a levels plane): read() where it
    is there and valid; else measured under the entry's lock (a process that waited finds it measured and reads it),
    with `notice` on stderr, written (where the cache is writable) and parsed."""
    found = read()
    if found is not None:
        return found
    with locked(path):
        found = read()  # another process may have measured it while this one waited
        if found is None:
            print(notice, file=sys.stderr)
            obj = measure()
            write_json(path, obj)
            found = parse(obj)
    return found


# ------------------------------------------------------------------------------------- entry folders (loading.py)
def remove(path: Path) -> None:
    """Remove a file, folder or link (a link, not what it points to); nothing when it is not there."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def new_build_folder(entry: Path) -> Path:
    """A fresh private folder beside `entry` to build it in (OSError when it cannot be made)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=entry.parent, prefix=f"{entry.name}.tmp{os.getpid()}-"))


def swap_in(tmp: Path, entry: Path) -> None:
    """Put the built folder in place of the entry (the old one, a folder or a link, moved into a fresh folder first:
    the entry is missing only between two renames)."""
    aside = new_build_folder(entry)
    try:
        if entry.is_symlink() or entry.exists():
            os.replace(entry, aside / "old")
        os.replace(tmp, entry)
    finally:
        remove(aside)


def _build_pid(entry: Path, path: Path) -> int | None:
    """The process id in the name of a build folder of `entry` (`<entry>.tmp<pid>-<random>`)."""
    m = re.fullmatch(re.escape(entry.name) + r"\.tmp(\d+)-\w+", path.name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    if pid <= 0 or pid > 2**22:  # not a process id (0 would mean this process group)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_builds(entry: Path) -> None:
    """Remove the build folders of `entry` left by runs that crashed or ran out of disk: their process is gone,
    or they are older than STALE_BUILD_S. Called under the entry's lock (no live build of it is under way)."""
    try:
        for path in list(entry.parent.glob(f"{glob.escape(entry.name)}.tmp*")):
            pid = _build_pid(entry, path)
            if pid is not None and (pid == os.getpid() or not _alive(pid)
                                    or time.time() - path.lstat().st_mtime > STALE_BUILD_S):
                remove(path)
    except OSError:  # an unreadable cache folder: nothing to clean
        pass

