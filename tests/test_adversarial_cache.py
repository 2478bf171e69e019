"""The user cache trusts only what casspec wrote (casspec/cache/usercache.py, loading/checkpoints.py,
loading/levelstore.py, cache/state.py): files planted beside a manifest, files changed with their size and time put
back, links planted at temporary names or as an entry folder, another user's files, and a GGUF swapped or rewritten
between its hash and its parse each end in a safe rebuild or a clear error, within seconds, the victim files
untouched."""
import json
import os
import time
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file

from casspec.loading import checkpoints as loading
from casspec.cache import usercache
from casspec.loading.ggufcheck import GGUFFile
from casspec.loading.levelstore import LevelStore
from casspec.runtime.request import Request
from casspec.cache.state import StateFile
from casspec.cache.usercache import owned, read_verified, write_atomic, write_json, write_verified
from dsia.errors import CasspecError
from dsia.quant import QuantCodec, QuantConfig, quantize_linears
from dytc.machine import machine_info
from tiny import tiny_engine, tiny_gguf

ROOT = os.geteuid() == 0  # only root can plant files that belong to another user
OTHER_UID = 54321  # "another user"
BOUND_S = 30.0  # what any of these may take, rebuild included (a tiny model)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("CASSPEC_CACHE", str(folder))
    return folder


@pytest.fixture
def gguf(tmp_path):
    return tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def victim(tmp_path):
    """A file outside the cache that a planted link points at: it must never be written, truncated or removed."""
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


@contextmanager
def bounded(seconds: float = BOUND_S):
    t0 = time.perf_counter()
    yield
    assert time.perf_counter() - t0 < seconds


def entry_of(gguf):
    return loading.gguf_entry(loading.file_sha256(gguf))


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if "warning" in line]


@contextmanager
def cache_at(folder):
    """CASSPEC_CACHE pointed at `folder` for a while."""
    old = os.environ["CASSPEC_CACHE"]
    os.environ["CASSPEC_CACHE"] = str(folder)
    try:
        yield folder
    finally:
        os.environ["CASSPEC_CACHE"] = old


def reference_embed(gguf, tmp_path) -> torch.Tensor:
    """The embedding the GGUF dequantizes to, through a cache of its own."""
    with cache_at(tmp_path / "reference-cache"):
        return loading.load(str(gguf), hf=False).runtime.embed.clone()


def chown_tree(path, uid: int) -> None:
    os.lchown(path, uid, uid)
    if path.is_dir() and not path.is_symlink():
        for p in path.rglob("*"):
            os.lchown(p, uid, uid)


# ------------------------------------------------------------------------------------- files beside the manifest
@pytest.mark.parametrize("hf", [False, True])
@pytest.mark.parametrize("planted", ["zz-planted.safetensors", "added_tokens.json", "model.safetensors.index.json"])
def test_a_file_the_manifest_does_not_list_makes_the_entry_rebuilt(gguf, cache, tmp_path, capsys, hf, planted):
    """The old read_runtime loaded every *.safetensors of an entry (a planted one later in sorted order replaced the
    embedding); transformers reads any tokenizer or index file it finds. Now the entry is refused and rebuilt."""
    ref = reference_embed(gguf, tmp_path)
    loading.load(str(gguf), hf=hf)
    entry = entry_of(gguf)
    if planted.endswith(".safetensors"):
        save_file({"model.embed_tokens.weight": torch.zeros_like(ref)}, entry / planted)
    else:
        (entry / planted).write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "zz.safetensors"}}))
    capsys.readouterr()
    with bounded():
        got = loading.load(str(gguf), hf=hf)
    (line,) = warnings_in(capsys.readouterr().err)
    assert f"corrupt; rebuilding it (it holds {planted}, which its manifest does not list)" in line
    embed = got.runtime.embed if not hf else got.model.model.embed_tokens.weight
    assert torch.equal(embed, ref) and not (entry / planted).exists()


def test_a_planted_level_file_is_not_read(tmp_path, capsys):
    """levels/: a file without the checksum written with it, or with one that does not match (the same size), is
    rebuilt; a file never asked for is never opened."""
    e = tiny_engine()
    codec = QuantCodec(QuantConfig("int4"))
    store = LevelStore(tmp_path / "levels", e.dtype, e.device)
    built = []
    build = lambda: (built.append(1), quantize_linears(e.model, codec.cfg))[1]  # noqa: E731
    store.fetch(codec, build)
    path = store.path(codec)
    good = path.read_bytes()
    (tmp_path / "levels" / "unrelated.safetensors").write_bytes(b"\xff" * 64)  # never read: nothing names it
    tampered = bytearray(good)
    tampered[-4:] = b"\x00\x00\x80\x7f"
    st = path.stat()
    path.write_bytes(bytes(tampered))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with bounded():
        store.fetch(codec, build)
    assert built == [1, 1] and "ignoring the unreadable level cache" in capsys.readouterr().err
    assert path.read_bytes() == good  # rebuilt as it was
    (tmp_path / "levels" / (path.name + usercache.SUM_SUFFIX)).unlink()  # the checksum file gone: rebuilt
    store.fetch(codec, build)
    assert built == [1, 1, 1]


def test_kept_state_changed_in_place_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    first = tiny_engine(keep_state=True)
    first.generate_ids([5, 6, 7, 5, 6], Request(max_new_tokens=8, method="dytc"))
    state = StateFile.of(machine_info("cpu"), "tiny-llama", "float32", first.build)
    assert state.load(first._state_origin)[1]  # kept
    data = state.path.read_bytes()
    i = data.index(b'"counts"')
    st = state.path.stat()
    state.path.write_bytes(data[:i] + b'"cOunts"' + data[i + 8:])  # same size, still JSON
    os.utime(state.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert state.load(first._state_origin) == (None, {})


# ------------------------------------------------------------------------------------------- temporary names
def test_links_at_the_old_predictable_temp_names_are_never_followed(gguf, cache, victim):
    """`<file>.tmp<pid>`, `<manifest>.tmp<pid>`, `<entry>.tmp<pid>` and `<entry>.lock` were the names to plant a
    link at; writes now go to fresh mkstemp / mkdtemp names, and filelock refuses a link at the lock's name."""
    cache.mkdir()
    entry = entry_of(gguf)
    state = cache / "state"
    state.mkdir()
    links = [state / f"s.json.tmp{os.getpid()}", entry.with_name(f"{entry.name}.tmp{os.getpid()}"),
             entry.with_name(entry.name + ".lock")]
    for link in links:
        link.symlink_to(victim)
    with bounded():
        assert write_json(state / "s.json", {"a": 1}) and json.loads((state / "s.json").read_text()) == {"a": 1}
        got = loading.load(str(gguf), hf=False)  # built without the lock (its name is a link)
        loading.load(str(gguf), hf=False)  # and read back
    assert got.store_dir == entry and victim.read_text() == "precious"
    assert all(link.is_symlink() for link in links[:2])  # left alone (not a build folder of this format)


def test_a_temp_name_taken_by_a_link_is_skipped_not_followed(tmp_path, victim, monkeypatch):
    """Even when the unpredictable name is guessed and a link planted there first, mkstemp creates exclusively
    (O_EXCL, O_NOFOLLOW): it takes another name."""
    import tempfile

    names = iter(["guessed", "fresh"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / ".x.json.guessed.tmp").symlink_to(victim)
    assert write_atomic(folder / "x.json", b"{}")
    assert victim.read_text() == "precious" and (folder / "x.json").read_bytes() == b"{}"


def test_entry_builds_happen_in_private_unpredictable_folders(gguf, cache, monkeypatch):
    seen = []
    real = usercache.new_build_folder
    monkeypatch.setattr(loading, "new_build_folder", lambda entry: seen.append(real(entry)) or seen[-1])
    loading.load(str(gguf), hf=False)
    (tmp,) = seen
    assert tmp.name.startswith(f"{entry_of(gguf).name}.tmp{os.getpid()}-") and len(tmp.name.split("-")[-1]) >= 8
    assert (entry_of(gguf).stat().st_mode & 0o777) == 0o700  # (mkdtemp's mode, kept by the rename)


# ----------------------------------------------------------------------------------------- another user's files
@pytest.mark.skipif(not ROOT, reason="planting another user's files needs root")
def test_a_symlinked_entry_planted_by_another_user_is_not_followed(gguf, cache, tmp_path, capsys):
    """A complete, self-consistent entry (its manifest's checksums match its files) whose weights are zeros, linked
    in as the entry by another user: not used (rebuilt), and the folder it points at is left as it was."""
    ref = reference_embed(gguf, tmp_path)
    with cache_at(tmp_path / "evil-cache"):
        src = loading.load(str(gguf), hf=False).store_dir
    weights = src / "model.safetensors"
    state = load_file(weights)
    state["model.embed_tokens.weight"] = torch.zeros_like(state["model.embed_tokens.weight"])
    save_file(state, weights, metadata={"format": "pt"})
    manifest = json.loads((src / loading.CACHE_MANIFEST).read_text())
    manifest["files"]["model.safetensors"] = usercache.file_record(weights)
    (src / loading.CACHE_MANIFEST).write_text(json.dumps(manifest))
    cache.mkdir()
    entry = entry_of(gguf)
    entry.symlink_to(src, target_is_directory=True)
    chown_tree(src, OTHER_UID)
    os.lchown(entry, OTHER_UID, OTHER_UID)
    assert not owned(entry)
    with bounded():
        got = loading.load(str(gguf), hf=False)
    (line,) = warnings_in(capsys.readouterr().err)
    assert "corrupt; rebuilding it (the folder is another user's)" in line
    assert torch.equal(got.runtime.embed, ref) and not entry.is_symlink()
    assert load_file(weights)["model.embed_tokens.weight"].abs().sum() == 0  # the planted folder untouched


def test_a_symlinked_entry_of_this_user_is_used(gguf, cache, tmp_path, capsys):
    """(What the test suite's own cache does: links to the real cache's entries.)"""
    with cache_at(tmp_path / "real"):
        real = loading.load(str(gguf), hf=False).store_dir
    cache.mkdir()
    entry_of(gguf).symlink_to(real, target_is_directory=True)
    capsys.readouterr()
    got = loading.load(str(gguf), hf=False)
    assert got.store_dir == entry_of(gguf) and "dequantizing" not in capsys.readouterr().err


@pytest.mark.skipif(not ROOT, reason="planting another user's files needs root")
def test_another_users_cache_files_are_not_read(tmp_path, victim, capsys):
    folder = tmp_path / "c"
    assert write_verified(folder / "x.bin", b"abc") and read_verified(folder / "x.bin") == b"abc"
    assert write_json(folder / "k.json", {"a": 1}) and usercache.read_json(folder / "k.json") == {"a": 1}
    os.lchown(folder / "x.bin", OTHER_UID, OTHER_UID)
    os.lchown(folder / "k.json", OTHER_UID, OTHER_UID)
    with pytest.raises(CasspecError, match="another user's"):
        read_verified(folder / "x.bin")
    assert usercache.read_json(folder / "k.json") is None
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.lchown(foreign, OTHER_UID, OTHER_UID)
    assert not write_json(foreign / "k.json", {"a": 1}) and not (foreign / "k.json").exists()
    assert "belongs to another user" in capsys.readouterr().err
    link = tmp_path / "c" / "l.json"
    link.symlink_to(folder / "k.json")
    os.lchown(link, OTHER_UID, OTHER_UID)  # a link planted by another user, to this user's file
    os.lchown(folder / "k.json", 0, 0)
    assert usercache.read_json(link) is None


# ------------------------------------------------------------------------------------------ hash versus parse
def test_a_gguf_swapped_after_its_hash_cannot_give_an_entry_of_other_bytes(gguf, cache, tmp_path, monkeypatch):
    """Another file renamed over the GGUF right after it was hashed: transformers reads the file that was opened
    and hashed (/proc/self/fd/N), so the entry keyed by that hash holds that file's weights."""
    ref = reference_embed(gguf, tmp_path)
    sha = loading.file_sha256(gguf)
    other = tiny_gguf(tmp_path / "other.gguf", seed=1)
    real = GGUFFile.sha256

    def hash_then_swap(self):
        digest = real(self)
        if other.exists():
            os.replace(other, gguf)
        return digest

    monkeypatch.setattr(GGUFFile, "sha256", hash_then_swap)
    with bounded():
        got = loading.load(str(gguf), hf=False)
    monkeypatch.setattr(GGUFFile, "sha256", real)
    assert loading.file_sha256(gguf) != sha  # the path names the other file now
    assert got.store_dir == loading.gguf_entry(sha) and torch.equal(got.runtime.embed, ref)
    assert torch.equal(load_file(loading.gguf_entry(sha) / "model.safetensors")["model.embed_tokens.weight"], ref)


def test_a_gguf_rewritten_in_place_while_it_is_read_is_an_error(gguf, cache, tmp_path, monkeypatch):
    """The same file's bytes rewritten (same size) between the hash and the parse: one clear error, no entry."""
    other = tiny_gguf(tmp_path / "other.gguf", seed=1).read_bytes()
    assert len(other) == gguf.stat().st_size
    real = GGUFFile.sha256
    calls = []

    def hash_then_rewrite(self):
        digest = real(self)
        if not calls:
            calls.append(1)
            with open(gguf, "r+b") as f:
                f.write(other)
        return digest

    monkeypatch.setattr(GGUFFile, "sha256", hash_then_rewrite)
    with bounded(), pytest.raises(CasspecError, match="tiny.gguf changed while it was read: run again"):
        loading.load(str(gguf), hf=False)
    assert not any(cache.glob("gguf-*/model.safetensors"))
