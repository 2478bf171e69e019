"""The dequantized-GGUF cache (casspec/loading/checkpoints.py) on a tiny GGUF: an unwritable cache or a full disk runs
uncached with one warning line, stale build folders are removed, two processes build an entry once, same-size
garbage is caught by the manifest's checksums (checked on every load, whatever the file's time says), and an
unreadable GGUF is one clear error. (Planted files and swaps: test_adversarial_cache.py.)"""
import errno
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from casspec.loading import checkpoints as loading
from casspec.loading.ggufcheck import GGUFFile
from casspec.cache.usercache import STALE_BUILD_S, locked
from dsia.errors import CasspecError
from tiny import tiny_gguf


@pytest.fixture
def gguf(tmp_path):
    return tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("CASSPEC_CACHE", str(folder))
    return folder


def entry_of(gguf) -> "os.PathLike":
    return loading.gguf_entry(loading.file_sha256(gguf))


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if "warning" in line]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_cache_that_is_a_file_runs_uncached_with_one_warning(gguf, cache, tmp_path, monkeypatch, capsys):
    cached = loading.load(str(gguf))  # through a writable cache, for reference
    capsys.readouterr()
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("CASSPEC_CACHE", str(not_a_folder))
    got = loading.load(str(gguf), hf=False)
    err = capsys.readouterr().err
    (line,) = warnings_in(err)
    assert "CASSPEC_CACHE to a writable folder" in line and "running uncached" in line
    assert err.index("warning") < err.index("dequantizing")  # seen before the long work
    assert got.store_dir is None and same_weights(got.model, cached.model)
    assert not_a_folder.read_text() == "x"


def test_generate_with_a_cache_that_is_a_file_prints_one_warning_line(gguf, tmp_path, monkeypatch, capsys):
    """Every write to the user cache fails (the model cache, kernels.json, the kept state): one line in all."""
    from casspec.cli import main

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("CASSPEC_CACHE", str(not_a_folder))
    rc = main(["generate", "abc", "--model", str(gguf), "--no-chat", "--max-new-tokens", "3", "--no-autoprofile"])
    err = capsys.readouterr().err
    assert rc == 0 and len(warnings_in(err)) == 1 and "Traceback" not in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_cache_runs_uncached_with_one_warning(gguf, cache, capsys):
    cache.mkdir()
    cache.chmod(0o500)
    got = loading.load(str(gguf), hf=False)
    (line,) = warnings_in(capsys.readouterr().err)
    assert "CASSPEC_CACHE to a writable folder" in line and got.model is not None


def test_a_full_disk_while_saving_runs_uncached_and_leaves_nothing(gguf, cache, monkeypatch, capsys):
    import safetensors.torch

    def disk_full(state, path, metadata=None):
        open(path, "wb").write(b"\0" * 100)  # the part that fitted
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    got = loading.load(str(gguf), hf=False)
    (line,) = warnings_in(capsys.readouterr().err)
    assert "No space left on device" in line and "GB free" in line and str(cache) in line
    assert got.model is not None and got.store_dir is None
    assert [p.name for p in cache.iterdir() if ".tmp" in p.name] == []


def test_too_little_free_space_is_seen_before_dequantizing(gguf, cache, monkeypatch, capsys):
    monkeypatch.setattr(loading.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    got = loading.load(str(gguf), hf=False)
    err = capsys.readouterr().err
    (line,) = warnings_in(err)
    assert "needs 0.00 GB free and has 0.00 GB" in line and err.index("warning") < err.index("dequantizing")
    assert got.model is not None and not any(".tmp" in p.name for p in cache.iterdir())


def test_stale_build_folders_are_removed(gguf, cache):
    entry = entry_of(gguf)
    cache.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()  # a process that is gone
    dead = entry.with_name(f"{entry.name}.tmp{proc.pid}-abc123")
    dead_old = entry.with_name(f"{entry.name}.tmp{proc.pid}-old")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    old = entry.with_name(f"{entry.name}.tmp{alive.pid}-x_9")  # alive, but older than STALE_BUILD_S (a reused pid)
    live = entry.with_name(f"{entry.name}.tmp{os.getppid()}-q1")  # a live process's build under way
    others = [entry.with_name(f"{entry.name}.tmpx"), entry.with_name(f"{entry.name}.tmp{proc.pid}"),
              cache / f"gguf-{'0' * 24}-v{loading.CACHE_VERSION}.tmp{proc.pid}-abc"]
    for d in (dead, dead_old, old, live, *others):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    then = time.time() - STALE_BUILD_S - 60
    os.utime(old, (then, then))
    try:
        loading.load(str(gguf), hf=False)
    finally:
        alive.kill()
        alive.wait()
    assert not dead.exists() and not dead_old.exists() and not old.exists()
    assert live.exists() and all(d.exists() for d in others)  # not stale, or not this entry's


def test_a_process_that_waited_for_the_lock_finds_the_entry_built(gguf, cache, tmp_path, monkeypatch, capsys):
    """Two processes loading one GGUF: the second waits on the entry's lock and then loads what the first built
    (it re-checks the entry after the wait) instead of dequantizing again and replacing it under the first."""
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "other"))
    loading.load(str(gguf), hf=False)
    built = entry_of(gguf)
    capsys.readouterr()
    monkeypatch.setenv("CASSPEC_CACHE", str(cache))
    entry = entry_of(gguf)
    hashed, results = threading.Event(), []
    real_sha = GGUFFile.sha256
    monkeypatch.setattr(GGUFFile, "sha256", lambda self: (real_sha(self), hashed.set())[0])
    with locked(entry):  # "the first process", building
        waiter = threading.Thread(target=lambda: results.append(loading.load(str(gguf), hf=False)))
        waiter.start()
        assert hashed.wait(30)
        time.sleep(0.3)  # past its check of the entry, where it does not wait for the lock
        shutil.copytree(built, entry)  # the first process's build lands
    waiter.join(60)
    assert results and results[0].store_dir == entry
    assert "dequantizing" not in capsys.readouterr().err


def test_same_size_garbage_in_the_cache_is_caught_and_rebuilt(gguf, cache, capsys):
    loading.load(str(gguf), hf=False)
    entry = entry_of(gguf)
    weights = entry / "model.safetensors"
    reference = {k: v.clone() for k, v in load_file(weights).items()}  # (not a view of the file's mapping)
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(b ^ 0x55 for b in data[-64:])  # tensor data: the file still loads
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    got = loading.load(str(gguf), hf=False)
    (line,) = warnings_in(capsys.readouterr().err)
    assert "corrupt; rebuilding" in line and "model.safetensors does not match its checksum" in line
    rebuilt = load_file(weights)
    assert all(torch.equal(rebuilt[k], reference[k]) for k in reference)
    assert torch.equal(got.runtime.embed, reference["model.embed_tokens.weight"])


def edit_in_place(path, old: bytes, new: bytes, at: int | None = None) -> None:
    """Replace `old` (at byte `at`, else its first occurrence) by `new` of the same length, then put the file's
    modification time back: the size and time are what they were."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    i = data.index(old) if at is None else at
    assert data[i:i + len(old)] == old and len(new) == len(old)
    data[i:i + len(old)] = new
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


@pytest.mark.parametrize("hf", [False, True])
@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_change_with_size_and_time_restored_is_caught(gguf, cache, hf, name, capsys):
    """Every load checks every listed file against its sha256: an edit that keeps the size and puts the time back
    (what a size + mtime shortcut misses) is caught, in the weights (hashed from the bytes loaded, or before
    transformers reads them) and in a small file read by transformers (config.json)."""
    reference = {k: v.clone() for k, v in loading.load(str(gguf), hf=True).model.state_dict().items()}  # (not
    # views of the mapped file, which the edit below changes in place)
    path = entry_of(gguf) / name
    if name == "config.json":
        edit_in_place(path, b'"llama"', b'"llamb"')
    else:
        edit_in_place(path, path.read_bytes()[-4:], b"\x00\x00\x80\x7f", at=path.stat().st_size - 4)  # -> +inf
    capsys.readouterr()
    got = loading.load(str(gguf), hf=hf)
    err = capsys.readouterr().err
    (line,) = warnings_in(err)
    assert "corrupt; rebuilding" in line and f"{name} does not match its checksum" in line, line
    assert "dequantizing" in err
    if hf:
        assert all(torch.equal(got.model.state_dict()[k], v) for k, v in reference.items())
    else:
        assert torch.equal(got.runtime.embed, reference["model.embed_tokens.weight"])
    loading.load(str(gguf), hf=hf)
    assert capsys.readouterr().err.count("casspec:") == 0  # rebuilt whole: the next load neither warns nor rebuilds


def test_an_unreadable_gguf_is_one_clear_error(tmp_path):
    for path in (tmp_path, tmp_path / "gone.gguf"):  # a folder, a file that vanished
        with pytest.raises(CasspecError, match="cannot read .*: check that the file exists and is readable"):
            loading._load_gguf(path, torch.float32, torch.device("cpu"), "x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads anything")
def test_a_gguf_without_read_permission_is_one_clear_error(gguf):
    gguf.chmod(0)
    with pytest.raises(CasspecError, match="Permission denied"):
        loading.load(str(gguf))
