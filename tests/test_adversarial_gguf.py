"""Crafted checkpoint files: casspec's bounded readers refuse each one with one CasspecError line, in bounded time
and memory, before any library parser touches it. GGUF (casspec/loading/ggufcheck.py): huge counts and lengths, the
49-byte file with a 2^62-element array that hangs gguf's GGUFReader, nested arrays, unknown types, bad shapes, aliased,
gapped, misaligned and out-of-file offsets, truncation at every byte, random mutations (hypothesis: a file the check
accepts is one GGUFReader reads the same way); config.json (huge, deeply nested); safetensors headers (huge header
length, out-of-file offsets, aliasing, dtype / shape / size mismatches)."""
import copy
import json
import os
import re
import resource
import struct
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from casspec.loading import checkpoints as loading
from casspec.loading.ggufcheck import GGUFFile, check_gguf
from casspec.cache.usercache import JSON_MAX_BYTES, JSON_MAX_DEPTH, read_json_file
from casspec.loading.weights import SAFETENSORS_MAX_HEADER, read_safetensors
from dsia.errors import CasspecError
from tiny import tiny_gguf, tiny_model, tiny_tokenizer

U8, I32, F32, STRING, ARRAY, U32, U64 = 0, 5, 6, 8, 9, 4, 10  # GGUF value types
GF32, GF16, GQ8_0 = 0, 1, 8  # ggml types
CHECK_S, CHECK_BYTES = 1.0, 16 << 20  # what one refusal may take: time, Python memory


# ------------------------------------------------------------------------------------------ crafting GGUF bytes
def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(text: bytes | str) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return u64(len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def tinfo(name: str | bytes, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ggml_type) + u64(offset)


def gguf(kvs=(), tensors=(), data=b"", version=3, n_kv=None, n_tensors=None, align=32) -> bytes:
    head = (b"GGUF" + u32(version) + u64(len(tensors) if n_tensors is None else n_tensors)
            + u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors))
    return head + b"\0" * (-len(head) % align) + data


GOOD_KVS = (kv("general.architecture", STRING, gstr("llama")), kv("x.count", U32, u32(7)),
            kv("x.words", ARRAY, u32(STRING) + u64(3) + gstr("a") + gstr("bc") + gstr("")),
            kv("x.ids", ARRAY, u32(I32) + u64(2) + struct.pack("<ii", 1, -2)))
GOOD_TENSORS = (tinfo("a", (8,), GF32, 0), tinfo("b", (32, 2), GQ8_0, 32), tinfo("c", (4, 2), GF16, 128))
GOOD_DATA = b"\1" * 32 + b"\2" * 68 + b"\0" * 28 + b"\3" * 16  # a (32 bytes), b (2 x 34, padded to 96), c (16)


def good() -> bytes:
    return gguf(GOOD_KVS, GOOD_TENSORS, GOOD_DATA)


def refused(raw: bytes, match: str) -> CasspecError:
    """check_gguf's one-line CasspecError for `raw`, taken within CHECK_S and CHECK_BYTES of Python memory."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(CasspecError, match=match) as e:
            check_gguf(raw, "crafted.gguf")
        elapsed, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < CHECK_S and peak < CHECK_BYTES, (elapsed, peak)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("crafted.gguf is not a valid GGUF file") and "re-download" in msg
    return e.value


def test_a_good_file_is_read_as_gguf_reads_it(tmp_path):
    from gguf import GGUFReader

    path = tmp_path / "good.gguf"
    path.write_bytes(good())
    header = check_gguf(good(), "good.gguf")
    reader = GGUFReader(path)
    assert [(t.name, t.n_bytes, t.data_offset) for t in reader.tensors] == [
        (t.name, t.n_bytes, header.data_start + t.offset) for t in header.tensors]
    assert header.fields["x.count"] == 7 and header.fields["general.architecture"] == b"llama"
    assert header.fields["x.words"].length == 3 and header.alignment == 32


# ------------------------------------------------------------------------------------------------ the 49 bytes
def forty_nine_bytes() -> bytes:
    """The finding: one KV, an array of 2^62 UINT8 with no elements; GGUFReader loops 2^62 times without
    advancing, appending an empty array each time (gigabytes in seconds)."""
    raw = gguf([kv("a", ARRAY, u32(U8) + u64(2**62))], align=1)
    assert len(raw) == 49
    return raw


def test_the_49_byte_file_is_refused_at_once():
    refused(forty_nine_bytes(), r"a's 4611686018427387904 elements needs 4611686018427387904 bytes at offset 49 "
                                r"and 0 are left")


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a 3 GB address space: GGUFReader would hit it


def test_the_cli_refuses_the_49_byte_file_in_bounded_time_and_memory(tmp_path):
    """End to end, in a process limited to a 3 GB address space: exit status 2, one error line, seconds."""
    path = tmp_path / "tiny49.gguf"
    path.write_bytes(forty_nine_bytes())
    env = {**os.environ, "CASSPEC_CACHE": str(tmp_path / "cache")}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "casspec", "generate", "hi", "--model", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=_limit_memory)
    out, err = proc.communicate(timeout=120)
    elapsed = time.perf_counter() - t0
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err.decode()
    assert lines[0].startswith("casspec: error:") and "tiny49.gguf is not a valid GGUF file" in lines[0]
    assert elapsed < 60


# --------------------------------------------------------------------------------------- counts and lengths
@pytest.mark.parametrize("raw, match", [
    (gguf(n_kv=2**63), r"9223372036854775808 metadata pairs and 0 tensors needs"),
    (gguf(n_tensors=2**40), r"0 metadata pairs and 1099511627776 tensors needs"),
    (gguf(GOOD_KVS, n_tensors=10**6), r"4 metadata pairs and 1000000 tensors needs 32000052 bytes"),
    (b"GGUF" + u32(3) + u64(0) + u64(1) + u64(2**63) + b"\0" * 16, r"metadata key 0 needs 9223372036854775808 "),
    (gguf([kv("s", STRING, u64(2**60) + b"abc")]), r"s needs 1152921504606846976 bytes"),
    (gguf([kv("w", ARRAY, u32(STRING) + u64(2**40))]), r"w's 1099511627776 strings needs"),
    (gguf([kv("w", ARRAY, u32(STRING) + u64(2) + gstr("a") + u64(2**62))]), r"w's string 1 at offset \d+ runs past"),
    (gguf([kv("w", ARRAY, u32(U64) + u64(2**61))]), r"w's 2305843009213693952 elements needs 18446744073709551616"),
    (gguf([kv("n", ARRAY, u32(ARRAY) + u64(2**62))]), r"n's 4611686018427387904 arrays needs"),
    (gguf([kv("n", ARRAY, u32(ARRAY) + u64(1) + u32(U8) + u64(2**62))]), r"n's 4611686018427387904 elements"),
    (gguf([kv("n", ARRAY, u32(ARRAY) + u64(1) + u32(ARRAY) + u64(1) + u32(U8) + u64(0))]),
     r"n nests arrays more than 2 deep"),
    (gguf([kv("n", ARRAY, u32(ARRAY) + u64(1) + u32(STRING) + u64(1) + u64(2**50))]), r"n's string 0 .* runs past"),
])
def test_huge_counts_and_lengths_are_refused(raw, match):
    refused(raw, match)


def test_a_nested_array_within_bounds_is_read(tmp_path):
    from gguf import GGUFReader

    nested = u32(ARRAY) + u64(2) + u32(I32) + u64(2) + struct.pack("<ii", 1, 2) + u32(STRING) + u64(1) + gstr("z")
    raw = gguf([kv("n", ARRAY, nested)], GOOD_TENSORS, GOOD_DATA)
    assert check_gguf(raw, "nested").fields["n"].length == 2
    (tmp_path / "n.gguf").write_bytes(raw)
    assert len(GGUFReader(tmp_path / "n.gguf").tensors) == 3


# ---------------------------------------------------------------------------------------------- types, shapes
@pytest.mark.parametrize("raw, match", [
    (b"GGML" + good()[4:], "does not start with the GGUF magic"),
    (b"GG", "does not start with the GGUF magic"),
    (b"GGUF" + u32(1) + good()[8:], r"version 1; casspec reads versions \[2, 3\]"),
    (b"GGUF" + u32(4) + good()[8:], "version 4"),
    (b"GGUF" + struct.pack(">I", 3) + good()[8:], "version 50331648 .a big-endian file"),
    (gguf([kv("t", 13, b"\0" * 8)]), "t has the unknown value type 13"),
    (gguf([kv("t", ARRAY, u32(77) + u64(0))]), "t is an array of the unknown value type 77"),
    (gguf([kv("k", U32, u32(1)), kv("k", U32, u32(2))]), "the metadata key 'k' appears twice"),
    (gguf([gstr(b"\xff\xfe") + u32(U32) + u32(1)]), r"metadata key 0 b'\\xff\\xfe' is not UTF-8"),
    (gguf([kv("general.alignment", U32, u32(3))], GOOD_TENSORS, GOOD_DATA), "general.alignment 3 is not a UINT32"),
    (gguf([kv("general.alignment", U32, u32(0))], GOOD_TENSORS, GOOD_DATA), "general.alignment 0 is not a UINT32"),
    (gguf([kv("general.alignment", U64, u64(64))], GOOD_TENSORS, GOOD_DATA), "general.alignment 64 is not a UINT32"),
    (gguf((), [tinfo("z", (), GF32, 0)], b"\0" * 32), "tensor z has 0 dimensions .1 to 4."),
    (gguf((), [tinfo("z", (1, 1, 1, 1, 1), GF32, 0)], b"\0" * 32), "tensor z has 5 dimensions"),
    (gguf((), [gstr("z") + u32(2**31)], b"\0" * 32), "tensor z has 2147483648 dimensions"),
    (gguf((), [tinfo("z", (8, 0), GF32, 0)], b"\0" * 32), r"tensor z has the dimensions \[8, 0\]"),
    (gguf((), [tinfo("z", (8,), 99, 0)], b"\0" * 32), "tensor z has the unknown ggml type 99"),
    (gguf((), [tinfo("z", (8,), 4, 0)], b"\0" * 32), "unknown ggml type 4"),  # Q4_2: removed from ggml
    (gguf((), [tinfo("z", (33, 2), GQ8_0, 0)], b"\0" * 96), "rows of 33 elements, not a multiple of its block size 32"),
    (gguf((), [tinfo("z" * 64, (8,), GF32, 0)], b"\0" * 32),
     r"tensor 0's name b'z+'\.\.\. is 64 bytes long \(at most 63\)"),
    (gguf([kv("k" * 65536, U32, u32(1))]), r"metadata key 0 b'k+'\.\.\. is 65536 bytes long \(at most 65535\)"),
    (gguf((), [tinfo(b"\xc3", (8,), GF32, 0)], b"\0" * 32), "is not UTF-8"),
    (gguf((), [tinfo("z", (8,), GF32, 0), tinfo("z", (8,), GF32, 32)], b"\0" * 64), "tensor name 'z' appears twice"),
    (gguf((), [tinfo("z", (2**32,) * 4, GF32, 0)], b"\0" * 32),
     r"z's 1361129467683753853853498429727072845824 bytes at file offset \d+ run past the end of the file"),
])
def test_unknown_types_and_bad_shapes_are_refused(raw, match):
    refused(raw, match)


# ---------------------------------------------------------------------------------------------------- offsets
def with_offsets(*offsets: int, data: bytes = GOOD_DATA, align: int = 32, kvs=()) -> bytes:
    specs = [("a", (8,), GF32), ("b", (32, 2), GQ8_0), ("c", (4, 2), GF16)]
    return gguf(kvs, [tinfo(n, d, t, o) for (n, d, t), o in zip(specs, offsets)], data, align=align)


@pytest.mark.parametrize("raw, match", [
    (with_offsets(0, 0, 128), r"tensor b's data starts at offset 0 where the tensors before it end at 32 .* no shared"),
    (with_offsets(0, 32, 32), r"tensor c's data starts at offset 32 where the tensors before it end at 128"),
    (with_offsets(0, 64, 160, data=GOOD_DATA + b"\0" * 32), r"tensor b's data starts at offset 64 .* skipped"),
    (with_offsets(0, 36, 128), "tensor b's data offset 36 is not a multiple of the alignment 32"),
    (with_offsets(0, 32, 128, data=GOOD_DATA[:-1]), r"tensor c's 16 bytes at file offset \d+ run past the end"),
    (with_offsets(0, 32, 2**63), "tensor c's data starts at offset 9223372036854775808 where"),
    (with_offsets(0, 32, 128, align=64, kvs=[kv("general.alignment", U32, u32(64))]),
     "tensor b's data offset 32 is not a multiple of the alignment 64"),
])
def test_aliased_gapped_misaligned_and_out_of_file_offsets_are_refused(raw, match):
    refused(raw, match)


def test_the_tensors_of_the_tiny_model_cannot_share_bytes(tmp_path, monkeypatch):
    """A real model file whose second tensor is pointed at the first one's bytes (dequantization memory multiplied
    in a GGUF that aliases one tensor many times): the loader refuses it, one line, before transformers reads it."""
    path = tiny_gguf(tmp_path / "alias.gguf")
    raw = bytearray(path.read_bytes())
    header = check_gguf(bytes(raw), "x")
    second = header.tensors[1]
    name = second.name.encode()
    at = raw.index(gstr(name)) + len(gstr(name)) + 4 + 8 * len(second.dims) + 4
    raw[at:at + 8] = u64(0)
    path.write_bytes(bytes(raw))
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CasspecError, match=f"tensor {second.name}'s data starts at offset 0 where the tensors"):
        loading.load(str(path))
    assert not any((tmp_path / "cache").glob("gguf-*/model.safetensors"))


def test_native_checks_the_file_before_gguf_reads_it(tmp_path, monkeypatch):
    from casspec.loading.checkpoints import load

    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "bad.gguf"
    path.write_bytes(forty_nine_bytes())
    with pytest.raises(CasspecError, match="bad.gguf is not a valid GGUF file"):
        load(str(path), native=True)


def test_native_refuses_tensors_of_the_wrong_shape_with_one_line(tmp_path, monkeypatch):
    """A native target reads the file's tensors itself: a tensor whose shape the model's config does not give (its
    dims swapped) is one CasspecError line, not a kernel's size error later."""
    from casspec.loading.checkpoints import load

    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path / "m.gguf", dim=64, qtype="Q8_0", pad_vocab=13)
    raw = bytearray(path.read_bytes())
    at = raw.index(gstr("blk.0.ffn_down.weight")) + len(gstr("blk.0.ffn_down.weight")) + 4  # (past its dim count)
    struct.pack_into("<QQ", raw, at, *reversed(struct.unpack_from("<QQ", raw, at)))
    edited = tmp_path / "swapped.gguf"
    edited.write_bytes(bytes(raw))
    with pytest.raises(CasspecError, match=r"blk\.0\.ffn_down\.weight has shape \(128, 64\) where the model's "
                                           r"config gives \(64, 128\)") as e:
        load(str(edited), native=True)
    assert "\n" not in str(e.value)


def test_native_refuses_a_file_without_a_layer_norm_with_one_line(tmp_path, monkeypatch):
    """A layer norm missing from a native target's file (its name changed) is one CasspecError line, not a forward
    that fails later on an absent weight."""
    from casspec.loading.checkpoints import load

    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path / "m.gguf", dim=64, qtype="Q8_0", pad_vocab=13)
    raw = path.read_bytes().replace(gstr("blk.0.attn_norm.weight"), gstr("blk.0.attn_nXrm.weight"))
    edited = tmp_path / "no-norm.gguf"
    edited.write_bytes(raw)
    with pytest.raises(CasspecError, match=r"has no tensor blk\.0\.attn_norm\.weight") as e:
        load(str(edited), native=True)
    assert "\n" not in str(e.value)


def tiny_engine_model():
    from dsia.model import Transformer

    return Transformer.from_hf(tiny_model())


def test_model_level_mismatches_are_one_clear_error(tmp_path, monkeypatch):
    """A well-formed GGUF whose ffn_gate has its two dims swapped (same bytes, wrong shape for the model) or whose
    norm is typed I32 (read by transformers, not by casspec's own reader): one CasspecError line each."""
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    for name, edit, match in (("blk.0.ffn_gate.weight", "swap", "shape"), ("blk.0.attn_norm.weight", 26, "I32")):
        path = tiny_gguf(tmp_path / f"m{name}.gguf")
        raw = bytearray(path.read_bytes())
        at = raw.index(gstr(name)) + len(gstr(name))
        n_dims = struct.unpack_from("<I", raw, at)[0]
        if edit == "swap":
            d0, d1 = struct.unpack_from("<QQ", raw, at + 4)
            struct.pack_into("<QQ", raw, at + 4, d1, d0)
        else:
            struct.pack_into("<I", raw, at + 4 + 8 * n_dims, edit)
        path.write_bytes(bytes(raw))
        check_gguf(bytes(raw), "well-formed")
        with pytest.raises(CasspecError, match=f"cannot read GGUF file .*{match}") as e:
            loading.load(str(path))
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------- truncation, mutation
@pytest.fixture(scope="module")
def small(tmp_path_factory) -> bytes:
    """A small valid GGUF written by gguf's GGUFWriter: strings, arrays, a nested array, F32 / F16 / Q8_0."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    path = tmp_path_factory.mktemp("small") / "small.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list(["a", "bb", "ccc", ""])
    w.add_array("x.nested", [[1, 2], [3]])
    w.add_float32("x.f", 0.5)
    w.add_bool("x.b", True)
    w.add_tensor("blk.0.w", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("blk.0.h", np.ones((3, 4), dtype=np.float16))
    q = quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.q", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_truncation_at_every_byte_is_refused(small):
    header = check_gguf(small, "small")
    last = header.tensors[-1]
    end = header.data_start + last.offset + last.n_bytes  # the last tensor's last byte (padding may follow)
    for cut in range(end):
        with pytest.raises(CasspecError, match="is not a valid GGUF file"):
            check_gguf(small[:cut], "cut")
    for cut in range(end, len(small) + 1):
        assert check_gguf(small[:cut], "cut").tensors == header.tensors


def reader_view(path) -> list[tuple]:
    from gguf import GGUFReader

    return [(t.name, t.tensor_type.name, t.n_bytes, t.data_offset) for t in GGUFReader(path).tensors]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 2000), st.sampled_from([0, 1, 2, 7, 8, 9, 13, 31, 32, 64, 127, 128,
                                                                          255]), st.integers(1, 8)),
                      min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 2000)))
def test_random_mutations_load_or_are_refused_never_hang(small, tmp_path, edits, cut):
    """Overwrite a few runs of bytes of the header (lengths, counts, types, offsets) with small or all-ones values,
    maybe truncate: the check refuses within its bounds, or accepts a file that gguf's GGUFReader reads as it does."""
    raw = bytearray(small)
    for at, value, width in edits:
        at = min(at, len(raw) - 1)
        raw[at:at + width] = (b"\xff" * width) if value == 255 else value.to_bytes(width, "little")
    raw = bytes(raw[:cut] if cut is not None else raw)
    t0 = time.perf_counter()
    try:
        header = check_gguf(raw, "mutated.gguf")
    except CasspecError as e:
        assert time.perf_counter() - t0 < CHECK_S and "\n" not in str(e)
        event("refused")
        return
    event("accepted")
    path = tmp_path / "mutated.gguf"
    path.write_bytes(raw)
    assert reader_view(path) == [(t.name, t.kind, t.n_bytes, header.data_start + t.offset) for t in header.tensors]


def test_gguffile_reads_a_fifo_as_an_error_not_a_hang(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(CasspecError, match="cannot read .*pipe.gguf .*not a regular file"):
        GGUFFile(fifo)


# --------------------------------------------------------------------------------------------------- config.json
@pytest.fixture
def hf_dir(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("text, match", [
    (" " * (JSON_MAX_BYTES + 1), "holds over 4 MB of JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON .RecursionError"),
    ("[" * (JSON_MAX_DEPTH + 1) + "]" * (JSON_MAX_DEPTH + 1), f"nests JSON more than {JSON_MAX_DEPTH} deep"),
    ('{"model_type": "llama", "x": ' + "[" * 500 + "]" * 500 + "}", "nests JSON more than"),
    ('{"a": 1' + "1" * 5000 + "}", "is not valid JSON .ValueError"),
])
def test_a_crafted_config_json_is_one_clear_error(hf_dir, capsys, text, match):
    from casspec.cli import main

    (hf_dir / "config.json").write_text(text)
    tracemalloc.start()
    t0 = time.perf_counter()
    rc = main(["generate", "w5", "--model", str(hf_dir), "--no-chat", "--max-new-tokens", "2", "--no-autoprofile"])
    elapsed, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "config.json" in err[0] and re.search(match, err[0]), err
    assert elapsed < 10 and peak < 64 << 20, (elapsed, peak)


def test_a_json_file_that_is_a_device_is_not_read(tmp_path):
    """A config.json linked to /dev/zero (never ending) is refused before a byte is read."""
    (tmp_path / "big.json").symlink_to("/dev/zero")
    with pytest.raises(OSError, match="not a regular file"):
        read_json_file(tmp_path / "big.json")


# ----------------------------------------------------------------------------------------- safetensors headers
def safetensors_bytes(header: dict | bytes, data: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return u64(len(raw) if length is None else length) + raw + data


ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize("raw, match", [
    (safetensors_bytes({}, b"", length=2**62),
     rf"header length 4611686018427387904 does not fit its 10 bytes \(at most {SAFETENSORS_MAX_HEADER}\)"),
    (safetensors_bytes({"a": ENTRY}, b"\0" * 16, length=10**6), r"header length 1000000 does not fit"),
    (b"\x01\x00", r"header length -1"),
    (safetensors_bytes(b"[" * 100_000, b""), "is not valid JSON"),
    (safetensors_bytes([1], b""), "its header is not a JSON object"),
    (safetensors_bytes({"a": {**ENTRY, "data_offsets": [0, 1 << 40], "shape": [1 << 38]}}, b"\0" * 16),
     r"tensor a ends at byte 1099511627776 of the data and the file holds 16"),
    (safetensors_bytes({"a": ENTRY, "b": ENTRY}, b"\0" * 16), r"tensor [ab] starts at byte 0 .*shared or skipped"),
    (safetensors_bytes({"a": {**ENTRY, "data_offsets": [8, 24]}}, b"\0" * 24), "starts at byte 8"),
    (safetensors_bytes({"a": ENTRY}, b"\0" * 20), "its tensors end at byte 16 of the data and the file holds 20"),
    (safetensors_bytes({"a": {**ENTRY, "shape": [3, 2]}}, b"\0" * 16), "holds 24 bytes, and its offsets give 16"),
    (safetensors_bytes({"a": {**ENTRY, "shape": [2**62] * 10**5}}, b"\0" * 16), "its offsets give 16"),
    (safetensors_bytes({"a": {**ENTRY, "shape": [-4]}}, b"\0" * 16), r"shape \[-4\] .* are not valid"),
    (safetensors_bytes({"a": {**ENTRY, "dtype": "Q9"}}, b"\0" * 16), "has the dtype 'Q9'"),
    (safetensors_bytes({"a": {**ENTRY, "data_offsets": [16, 0]}}, b"\0" * 16), "are not valid"),
    (safetensors_bytes({"__metadata__": {"k": 1}}, b""), "__metadata__ is not an object of strings"),
])
def test_crafted_safetensors_headers_are_refused(tmp_path, raw, match):
    """Each is refused by casspec's reader (which the runtime and the level store load through) in bounded time and
    memory; safetensors' own loader refuses each too (checked: it is what transformers loads with)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = tmp_path / "crafted.safetensors"
    path.write_bytes(raw)
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(CasspecError, match=match) as e:
        read_safetensors(path)
    elapsed, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < CHECK_S and peak < 64 << 20 and "\n" not in str(e.value), (elapsed, peak)
    with pytest.raises((SafetensorError, ValueError)):
        load_file(path)


@pytest.fixture(scope="module")
def small_safetensors(tmp_path_factory) -> bytes:
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("st") / "s.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "i": torch.arange(4, dtype=torch.int16),
               "b": torch.zeros(0, 2, dtype=torch.bfloat16)}, path, metadata={"k": "v"})
    return path.read_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 200), st.sampled_from(b'0123456789[]{}",:-.eE \xff'), st.booleans()),
                      min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 250)))
def test_random_safetensors_mutations_load_as_safetensors_loads_them_or_are_refused(small_safetensors, tmp_path,
                                                                                   edits, cut):
    """Overwrite or insert a few characters of the header (digits, brackets, quotes), maybe truncate: casspec's
    reader never crashes or hangs: it refuses in one line, or (rarely, the bytes still consistent) reads the tensors
    safetensors' own loader reads."""

    raw = bytearray(small_safetensors)
    for at, char, insert in edits:
        raw[at:at if insert else at + 1] = bytes([char])
    path = tmp_path / "m.safetensors"
    path.write_bytes(bytes(raw[:cut] if cut is not None else raw))
    read_as_safetensors_reads(path)


FIELDS = ("dtype", "shape", "dim0", "begin", "end", "drop", "copy")
VALUES = st.one_of(st.integers(-1, 30), st.sampled_from([2**62, 2**64, 2**63 - 1, "F32", "I16", "BF16", "U8", "Q4",
                                                        None, [1, 2], [6], [3, 2], [2, 3], [], [0]]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.lists(st.tuples(st.sampled_from(["w", "i", "b"]), st.sampled_from(FIELDS), VALUES), min_size=1,
                        max_size=3))
def test_random_safetensors_header_edits_load_as_safetensors_loads_them_or_are_refused(small_safetensors, tmp_path,
                                                                                      changes):
    """Edit the header's entries (dtypes, shapes, offsets, dropped or copied entries) and write it back with its
    length: casspec's reader refuses in one line, or reads what safetensors' own loader reads."""

    n = struct.unpack("<Q", small_safetensors[:8])[0]
    header, data = json.loads(small_safetensors[8:8 + n]), small_safetensors[8 + n:]
    for name, field, value in changes:
        value = copy.deepcopy(value)  # (sampled_from hands out the same list objects: an edit must not alias one)
        entry = header.setdefault(name, {})
        if field == "drop":
            header.pop(name)
        elif field == "copy":
            header[f"{name}2"] = dict(entry)
        elif field in ("dim0", "begin", "end"):
            target, i = ("shape", 0) if field == "dim0" else ("data_offsets", field == "end")
            if isinstance(entry.get(target), list) and len(entry[target]) > i:
                entry[target][i] = value
        else:
            entry[field] = value
    path = tmp_path / "h.safetensors"
    path.write_bytes(safetensors_bytes(header, data))
    read_as_safetensors_reads(path)


def read_as_safetensors_reads(path) -> None:
    """casspec's reader refuses `path` in one line, or reads the tensors (values and dtypes) safetensors' own
    loader reads."""
    from safetensors.torch import load_file

    try:
        got, _ = read_safetensors(path)
    except CasspecError as e:
        assert "\n" not in str(e)
        event("refused")
        return
    event("accepted")
    ref = load_file(path)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)


def test_a_valid_safetensors_file_reads_as_safetensors_reads_it(tmp_path):
    from safetensors.torch import load_file, save_file

    state = {"w": torch.randn(3, 5), "h": torch.arange(7, dtype=torch.int16), "b": torch.tensor([True, False]),
             "e": torch.zeros(0, 4, dtype=torch.bfloat16), "s": torch.tensor(2.5, dtype=torch.float64)}
    save_file(state, tmp_path / "ok.safetensors", metadata={"k": "v"})
    got, meta = read_safetensors(tmp_path / "ok.safetensors")
    ref = load_file(tmp_path / "ok.safetensors")
    assert meta == {"k": "v"} and got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref)


def test_a_truncated_safetensors_in_a_checkpoint_is_one_clear_error(hf_dir, capsys):
    from casspec.cli import main

    weights = hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-5])
    rc = main(["generate", "w5", "--model", str(hf_dir), "--no-chat", "--max-new-tokens", "2", "--no-autoprofile"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "is not a valid safetensors file" in line and "truncated or corrupt" in line, line


def test_only_the_files_the_checkpoint_lists_are_read(hf_dir):
    """An extra *.safetensors beside a checkpoint's model.safetensors (which transformers would not read) is not
    read; an index names the shards, and one outside the folder is refused."""
    from casspec.loading.weights import read_runtime
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(97, 64)}, hf_dir / "zz-planted.safetensors")
    rt = read_runtime(hf_dir, torch.float32, torch.device("cpu"))
    assert rt is not None and rt.embed.abs().sum() > 0
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../model.safetensors"}}))
    with pytest.raises(CasspecError, match="names the shard '../model.safetensors', not a .safetensors file of"):
        read_runtime(hf_dir, torch.float32, torch.device("cpu"))
