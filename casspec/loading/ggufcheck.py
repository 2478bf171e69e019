"""casspec's bounded GGUF reader, run before any other reader (gguf's GGUFReader, transformers) opens a GGUF.

gguf's GGUFReader trusts a file's own counts: it loops 2^62 times over a 49-byte GGUF whose array claims that length,
allocating as it goes, and lets tensors share bytes. check_gguf checks each count, length, type and offset against
the bytes that are there before reading on and allocates nothing in proportion to a claimed count (each step
consumes bytes of the file: time and memory are bounded by its header's size); a refusal is one CasspecError line.
It checks what llama.cpp's gguf.cpp requires: the magic; version 2 or 3 (little-endian); the KV and tensor counts,
every string length and every array length times its element size (arrays nested at most GGUF_MAX_NESTING deep)
within the bytes left; known value types; unique UTF-8 keys of at most GGUF_MAX_KEY bytes; tensors with unique
names under GGML_MAX_NAME bytes, 1 to GGML_MAX_DIMS dimensions each >= 1, a known ggml type whose block size divides
the first dimension, element counts and byte sizes in Python integers (no overflow); general.alignment a UINT32
power of two; each tensor's offset aligned and equal to the running total of the padded sizes of the tensors before
it (no shared or skipped bytes), its bytes inside the file. String values over GGUF_KEEP_STRING bytes are checked,
not copied.

GGUFFile opens a GGUF once: its sha256, its check and the path other readers open (/proc/self/fd/N: this open file,
whatever the file name points to meanwhile) all read the same file, and one written to meanwhile is an error.
"""
from __future__ import annotations

import functools
import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Iterable

import numpy as np

from dsia.errors import CasspecError

from ..cache.usercache import open_regular

GGML_MAX_DIMS = 4  # llama.cpp's (ggml.h): a tensor has 1 to 4 dimensions
GGML_MAX_NAME = 64  # llama.cpp's (ggml.h): a tensor name is shorter
GGUF_MAX_KEY = 65535  # the GGUF spec's longest key, in bytes
GGUF_KEEP_STRING = 1024  # string values longer than this are checked and skipped (None in GGUFHeader.fields)
GGUF_MAX_NESTING = 2  # arrays of arrays at most (llama.cpp reads no nested array; gguf-py writes them)
MIN_KV_BYTES = 8 + 4 + 1  # a KV pair holds at least its key's length, its type and a 1-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFArray:
    """An array value of the header (its elements are skipped, not kept)."""
    item_type: int
    length: int


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGUF's order: dims[0] is the row length
    kind: str  # the ggml type's name (F32, Q4_1, ...)
    offset: int  # of its data, from the data section's start
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, object]  # key -> int, float, bool, bytes (a string; None: a longer one) or GGUFArray
    tensors: tuple[GGUFTensor, ...]
    alignment: int
    data_start: int  # byte offset of the data section in the file


class _Cursor:
    """A position in a GGUF's bytes; each read checks first that the bytes are there."""

    def __init__(self, buf: memoryview, what: str) -> None:
        self.buf, self.pos, self.what = buf, 0, what

    def bad(self, why: str) -> CasspecError:
        why = why if len(why) <= 300 else why[:300] + "..."  # (a crafted name may be megabytes long)
        return CasspecError(f"{self.what} is not a valid GGUF file ({why}): it may be truncated or corrupt; "
                            "re-download it or convert it again")

    def need(self, n: int, what: str) -> None:
        left = len(self.buf) - self.pos
        if n > left:
            raise self.bad(f"{what} needs {n} bytes at offset {self.pos} and {left} are left")

    def skip(self, n: int, what: str) -> int:
        """Step over n bytes; their start."""
        self.need(n, what)
        self.pos += n
        return self.pos - n

    def scalar(self, fmt: struct.Struct, what: str) -> int | float | bool:
        return fmt.unpack_from(self.buf, self.skip(fmt.size, what))[0]

    def string(self, what: str, keep: int | None = None) -> bytes | None:
        """A string's bytes; None where it is longer than `keep` bytes (checked and skipped, not copied)."""
        n = self.scalar(U64, f"{what}'s length")
        start = self.skip(n, what)
        return bytes(self.buf[start:self.pos]) if keep is None or n <= keep else None

    def name(self, what: str, max_bytes: int) -> str:
        """A key or a tensor name: UTF-8, at most max_bytes long."""
        at = self.pos
        raw = self.string(what, max_bytes)
        if raw is None:
            head = bytes(self.buf[at + 8:at + 48])
            raise self.bad(f"{what} {head!r}... is {self.pos - at - 8} bytes long (at most {max_bytes})")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad(f"{what} {raw[:40]!r} is not UTF-8") from None

    def strings(self, n: int, what: str) -> None:
        """Step over n strings (a token list: a tight loop, each step consuming at least 8 bytes)."""
        self.need(8 * n, f"{what}'s {n} strings")
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), U64.unpack_from
        for i in range(n):
            if pos + 8 > end or (k := unpack(buf, pos)[0]) > end - pos - 8:
                raise self.bad(f"{what}'s string {i} at offset {pos} runs past the end of the file")
            pos += 8 + k
        self.pos = pos


@functools.cache
def _types() -> tuple[dict[int, struct.Struct], int, int, int]:
    """(fixed-size value type -> its format, STRING, ARRAY, UINT32): GGUF's value types (gguf.constants their home)."""
    from gguf.constants import GGUFValueType as T

    fmt = {T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
           T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d"}
    return {int(t): struct.Struct(f) for t, f in fmt.items()}, int(T.STRING), int(T.ARRAY), int(T.UINT32)


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> object:
    """A KV value: a scalar, a string's bytes, or an array's element type and length (its elements checked and
    skipped)."""
    sizes, string, array, _ = _types()
    if vtype in sizes:
        return cur.scalar(sizes[vtype], key)
    if vtype == string:
        return cur.string(key, GGUF_KEEP_STRING)
    if vtype != array:
        raise cur.bad(f"{key} has the unknown value type {vtype}")
    if depth == GGUF_MAX_NESTING:
        raise cur.bad(f"{key} nests arrays more than {GGUF_MAX_NESTING} deep")
    item = cur.scalar(U32, f"{key}'s element type")
    n = cur.scalar(U64, f"{key}'s length")
    if item in sizes:
        cur.skip(n * sizes[item].size, f"{key}'s {n} elements")
    elif item == string:
        cur.strings(n, key)
    elif item == array:
        cur.need(12 * n, f"{key}'s {n} arrays")  # each at least its element type and length: n is bounded
        for _ in range(n):
            _value(cur, array, key, depth + 1)
    else:
        raise cur.bad(f"{key} is an array of the unknown value type {item}")
    return GGUFArray(item, n)


def _fields(cur: _Cursor, n_kv: int) -> tuple[dict[str, object], dict[str, int]]:
    """(key -> value, key -> value type) of the header's KV pairs."""
    fields: dict[str, object] = {}
    kinds: dict[str, int] = {}
    for i in range(n_kv):
        key = cur.name(f"metadata key {i}", GGUF_MAX_KEY)
        if key in fields:
            raise cur.bad(f"the metadata key {key!r} appears twice")
        kinds[key] = cur.scalar(U32, f"{key}'s type")
        fields[key] = _value(cur, kinds[key], key)
    return fields, kinds


def _alignment(cur: _Cursor, fields: dict[str, object], kinds: dict[str, int]) -> int:
    from gguf.constants import GGUF_DEFAULT_ALIGNMENT

    if "general.alignment" not in fields:
        return GGUF_DEFAULT_ALIGNMENT
    a = fields["general.alignment"]
    if kinds["general.alignment"] != _types()[3] or a == 0 or a & (a - 1):
        raise cur.bad(f"general.alignment {str(a)[:20]} is not a UINT32 power of two")
    return a


def _tensor_info(cur: _Cursor, i: int) -> GGUFTensor:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = cur.name(f"tensor {i}'s name", GGML_MAX_NAME - 1)
    n_dims = cur.scalar(U32, f"{name}'s dimension count")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise cur.bad(f"tensor {name} has {n_dims} dimensions (1 to {GGML_MAX_DIMS})")
    dims = tuple(cur.scalar(U64, f"{name}'s dimensions") for _ in range(n_dims))
    code = cur.scalar(U32, f"{name}'s type")
    offset = cur.scalar(U64, f"{name}'s offset")
    if min(dims) < 1:
        raise cur.bad(f"tensor {name} has the dimensions {list(dims)} (each must be at least 1)")
    try:
        kind = GGMLQuantizationType(code)
    except ValueError:
        raise cur.bad(f"tensor {name} has the unknown ggml type {code}") from None
    block, type_size = GGML_QUANT_SIZES[kind]
    if dims[0] % block:
        raise cur.bad(f"tensor {name} of type {kind.name} has rows of {dims[0]} elements, not a multiple of its "
                      f"block size {block}")
    n = prod(dims)  # (Python integers: no overflow; the byte size is checked against the file)
    return GGUFTensor(name, dims, kind.name, offset, n, n // block * type_size)


def _check_layout(cur: _Cursor, tensors: list[GGUFTensor], alignment: int, data_start: int) -> None:
    """Each tensor's data where llama.cpp requires it: aligned, right after the previous tensor's (padded), and
    inside the file."""
    names: set[str] = set()
    expected = 0
    for t in tensors:
        if t.name in names:
            raise cur.bad(f"the tensor name {t.name!r} appears twice")
        names.add(t.name)
        if t.offset % alignment:
            raise cur.bad(f"tensor {t.name}'s data offset {t.offset} is not a multiple of the alignment {alignment}")
        if t.offset != expected:
            raise cur.bad(f"tensor {t.name}'s data starts at offset {t.offset} where the tensors before it end at "
                          f"{expected} (llama.cpp requires each to follow the one before: no shared or skipped bytes)")
        if data_start + t.offset + t.n_bytes > len(cur.buf):
            raise cur.bad(f"tensor {t.name}'s {t.n_bytes} bytes at file offset {data_start + t.offset} run past the "
                          f"end of the file ({len(cur.buf)} bytes)")
        expected += -(-t.n_bytes // alignment) * alignment


def check_gguf(buf: memoryview | bytes, what: str) -> GGUFHeader:
    """The checked header of the GGUF bytes `buf` (CasspecError where anything is wrong; module docstring)."""
    cur = _Cursor(memoryview(buf), what)
    try:
        return _check_gguf(cur)
    finally:
        cur.buf.release()  # (a mapped file can be closed, whatever references an error keeps)


def _check_gguf(cur: _Cursor) -> GGUFHeader:
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    if bytes(cur.buf[:4]) != b"GGUF":
        raise cur.bad("it does not start with the GGUF magic")
    cur.pos = 4
    version = cur.scalar(U32, "the version")
    if version not in READER_SUPPORTED_VERSIONS:
        endian = " (a big-endian file: casspec reads little-endian ones)" if version and not version & 0xFFFF else ""
        raise cur.bad(f"version {version}{endian}; casspec reads versions {READER_SUPPORTED_VERSIONS}")
    n_tensors, n_kv = cur.scalar(U64, "the tensor count"), cur.scalar(U64, "the metadata count")
    cur.need(n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES, f"{n_kv} metadata pairs and {n_tensors} tensors")
    fields, kinds = _fields(cur, n_kv)
    alignment = _alignment(cur, fields, kinds)
    cur.need(n_tensors * MIN_TENSOR_INFO_BYTES, f"{n_tensors} tensor infos")
    tensors = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    _check_layout(cur, tensors, alignment, data_start)
    return GGUFHeader(fields, tuple(tensors), alignment, data_start)


class GGUFFile:
    """A GGUF opened once (a context manager). Its sha256, its checked header and `reader_path` (the path other
    readers open, /proc/self/fd/N: this open file, whatever `path` names meanwhile) all read the same file, and
    `check_unchanged` refuses one written to since it was opened: what is hashed is what is parsed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.file = open_regular(path)
        except OSError as e:  # gone, a folder, permission denied
            raise CasspecError(f"cannot read {path} ({e.strerror or e}): check that the file exists and is "
                               "readable") from None
        self.stat = os.fstat(self.file.fileno())
        fds = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
        self.reader_path = Path(fds) / str(self.file.fileno())

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def sha256(self) -> str:
        self.file.seek(0)
        return hashlib.file_digest(self.file, "sha256").hexdigest()

    def header(self) -> GGUFHeader:
        if self.stat.st_size == 0:
            raise CasspecError(f"{self.path} is empty, not a GGUF file: re-download it")
        with mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return check_gguf(m, str(self.path))

    def tensor_bytes(self, header: GGUFHeader, names: Iterable[str]) -> dict[str, np.ndarray]:
        """The stored bytes [rows, row bytes] of the named tensors of `header` (this file's, checked: each lies
        inside the file), as copies."""
        wanted, out = set(names), {}
        with mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for t in header.tensors:
                if t.name in wanted:
                    view = np.frombuffer(m, np.uint8, t.n_bytes, header.data_start + t.offset)
                    out[t.name] = view.reshape(t.n_elements // t.dims[0], -1).copy()
                    del view  # (the map cannot close while a view of it is alive)
        return out

    def check_unchanged(self, sha256: str) -> None:
        """A CasspecError if the open file was written to since it was opened: its size or time, or its bytes (hashed
        again; the file's name pointed elsewhere meanwhile changes nothing of what was read)."""
        now = os.fstat(self.file.fileno())
        if (now.st_size, now.st_mtime_ns) != (self.stat.st_size, self.stat.st_mtime_ns) or self.sha256() != sha256:
            raise CasspecError(f"{self.path} changed while it was read: run again once it is complete")
