"""The on-disk NVRTC cache: hits, misses, corrupt entries, concurrent writers, compile errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import deviceop as do
from deviceop import CompileError, DeviceOpError
from deviceop.kernels import _nvrtc

ROOT = Path(__file__).resolve().parents[1]
ARCH = "sm_90"


def _source(tag: str) -> str:
    # a unique comment makes a new cache key: every test compiles something never seen before
    return textwrap.dedent(
        f"""
        // {tag}
        extern "C" __global__ void k(float* y, const float* x, int n) {{
          int i = blockIdx.x * blockDim.x + threadIdx.x;
          if (i < n) y[i] = x[i] * 3.0f;
        }}
        """
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("DEVICEOP_CACHE_DIR", str(d))
    _nvrtc.forget_memory_cache()
    yield d
    _nvrtc.forget_memory_cache()


def _entries(d: Path) -> list[Path]:
    return sorted(d.glob("*.cubin")) if d.exists() else []


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def test_cache_dir_follows_env(cache):
    assert _nvrtc.cache_dir() == cache


def test_miss_then_hit(cache):
    src = _source(uuid.uuid4().hex)
    s0 = _nvrtc.cache_stats()
    a = _nvrtc.compile_cubin(src, "t_miss", ARCH)
    assert _delta(s0, _nvrtc.cache_stats()) == {"hits": 0, "misses": 1, "corrupt": 0}
    assert a[:4] == b"\x7fELF"
    files = _entries(cache)
    assert len(files) == 1 and files[0].name.startswith("t_miss-")
    assert not list(cache.glob("*.tmp"))

    # the in-process memo answers without touching the disk
    s1 = _nvrtc.cache_stats()
    assert _nvrtc.compile_cubin(src, "t_miss", ARCH) == a
    assert _delta(s1, _nvrtc.cache_stats()) == {"hits": 0, "misses": 0, "corrupt": 0}

    # a new process (simulated: memo dropped) reads the disk entry
    _nvrtc.forget_memory_cache()
    s2 = _nvrtc.cache_stats()
    assert _nvrtc.compile_cubin(src, "t_miss", ARCH) == a
    assert _delta(s2, _nvrtc.cache_stats()) == {"hits": 1, "misses": 0, "corrupt": 0}


def test_key_depends_on_source_arch_and_options(cache):
    src = _source(uuid.uuid4().hex)
    _nvrtc.compile_cubin(src, "t_key", ARCH)
    _nvrtc.compile_cubin(src, "t_key", "sm_80")
    _nvrtc.compile_cubin(src, "t_key", ARCH, ["-DFOO=1"])
    _nvrtc.compile_cubin(src + "\n// changed\n", "t_key", ARCH)
    assert len(_entries(cache)) == 4


def _corrupt_truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _corrupt_garble(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _corrupt_empty(p: Path) -> None:
    p.write_bytes(b"")


def _corrupt_header_only(p: Path) -> None:
    p.write_bytes(_nvrtc._MAGIC)


@pytest.mark.parametrize(
    "damage",
    [_corrupt_truncate, _corrupt_garble, _corrupt_empty, _corrupt_header_only],
    ids=["truncated", "garbled", "empty", "header-only"],
)
def test_corrupt_entry_is_recompiled_and_replaced(cache, damage):
    src = _source(uuid.uuid4().hex)
    good = _nvrtc.compile_cubin(src, "t_corrupt", ARCH)
    (path,) = _entries(cache)
    damage(path)
    assert _nvrtc._read(path) is None  # the damage is detectable
    _nvrtc.forget_memory_cache()
    s0 = _nvrtc.cache_stats()
    again = _nvrtc.compile_cubin(src, "t_corrupt", ARCH)
    assert _delta(s0, _nvrtc.cache_stats()) == {"hits": 0, "misses": 1, "corrupt": 1}
    assert again[:4] == b"\x7fELF"
    assert len(again) == len(good)
    # the entry on disk was replaced by a valid one: the next process gets a hit
    assert _nvrtc._read(path) == again
    _nvrtc.forget_memory_cache()
    s1 = _nvrtc.cache_stats()
    assert _nvrtc.compile_cubin(src, "t_corrupt", ARCH) == again
    assert _delta(s1, _nvrtc.cache_stats()) == {"hits": 1, "misses": 0, "corrupt": 0}


def test_unwritable_cache_still_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("DEVICEOP_CACHE_DIR", str(blocker / "cache"))
    _nvrtc.forget_memory_cache()
    try:
        cubin = _nvrtc.compile_cubin(_source(uuid.uuid4().hex), "t_ro", ARCH)
    finally:
        _nvrtc.forget_memory_cache()
    assert cubin[:4] == b"\x7fELF"


_CHILD = r"""
import hashlib, json, sys, time
from deviceop.kernels import _nvrtc
src, start_at = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, start_at - time.time()))
cubin = _nvrtc.compile_cubin(src, "t_race", "sm_90")
print(json.dumps({"sha": hashlib.sha256(cubin).hexdigest(), "stats": _nvrtc.cache_stats()}))
"""


def test_two_processes_compile_the_same_new_kernel_at_once(tmp_path):
    import json

    d = tmp_path / "shared-cache"
    env = dict(os.environ, DEVICEOP_CACHE_DIR=str(d), PYTHONPATH=os.pathsep.join(sys.path))
    src = _source(uuid.uuid4().hex)
    start_at = time.time() + 2.0  # both start compiling at the same moment, after their imports
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, src, str(start_at)],
            env=env,
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(r["stats"]["corrupt"] == 0 for r in results)
    files = _entries(d)
    assert len(files) == 1, files
    assert not list(d.glob("*.tmp")), "temporary files were left behind"
    payload = _nvrtc._read(files[0])
    assert payload is not None, "the entry left on disk is not valid"
    import hashlib

    # both processes compiled identical code; the surviving entry is one of them
    assert payload[:4] == b"\x7fELF"
    assert hashlib.sha256(payload).hexdigest() in {r["sha"] for r in results}


BAD_SRC = """extern "C" __global__ void broken(float* y) {
  int i = threadIdx.x;
  y[i] = undefined_symbol_xyz + 1.0f;
}
"""


def test_compile_error_carries_log_and_quotes_the_line(cache):
    s0 = _nvrtc.cache_stats()
    with pytest.raises(CompileError) as ei:
        _nvrtc.compile_cubin(BAD_SRC, "broken", ARCH)
    e = ei.value
    assert isinstance(e, DeviceOpError)
    assert "undefined_symbol_xyz" in e.log and "error" in e.log
    msg = str(e)
    assert "broken" in msg and ARCH in msg
    assert e.log.strip() in msg
    # the failing line (line 3) is quoted under the log, with its number
    quoted = [ln for ln in msg.splitlines() if "|" in ln and "undefined_symbol_xyz" in ln]
    assert quoted, msg
    assert quoted[0].split("|")[0].strip() == "3"
    assert "y[i] = undefined_symbol_xyz + 1.0f;" in quoted[0]
    assert not _entries(cache), "a failed compile must not leave a cache entry"
    assert _delta(s0, _nvrtc.cache_stats())["hits"] == 0


def test_compile_error_through_a_user_kernel(cache):
    import deviceop as do

    k = do.kernels.Kernel(BAD_SRC, "broken", params=(do.kernels.Out(do.float32),), host=lambda y: None)
    with pytest.raises(CompileError, match="undefined_symbol_xyz"):
        k.compile(ARCH)


# ---- authenticity: only this user's own entries are loaded ------------------------------------


def _plant(path: Path, payload: bytes) -> None:
    """An entry as another user could write it: the right format, any payload, no valid HMAC."""
    import hashlib

    path.write_bytes(_nvrtc._MAGIC + hashlib.sha256(payload).digest() + payload)


def test_planted_entry_is_recompiled_never_loaded(cache):
    src = _source(uuid.uuid4().hex)
    good = _nvrtc.compile_cubin(src, "t_plant", ARCH)
    (path,) = _entries(cache)
    evil = b"\x7fELF" + b"\0" * (len(good) - 4)
    _plant(path, evil)
    _nvrtc.forget_memory_cache()
    s0 = _nvrtc.cache_stats()
    assert _nvrtc.compile_cubin(src, "t_plant", ARCH) == good
    assert _delta(s0, _nvrtc.cache_stats()) == {"hits": 0, "misses": 1, "corrupt": 1}


def test_swapped_entry_is_refused(cache):
    a = _nvrtc.compile_cubin(_source("a" + uuid.uuid4().hex), "t_swap_a", ARCH)
    src_b = _source("b" + uuid.uuid4().hex)
    _nvrtc.compile_cubin(src_b, "t_swap_b", ARCH)
    pa, pb = sorted(_entries(cache), key=lambda p: p.name)
    pb.write_bytes(pa.read_bytes())  # a valid entry of this user's, under another kernel's name
    assert _nvrtc._read(pa) == a and _nvrtc._read(pb) is None


def test_entry_writable_by_others_or_a_link_is_refused(cache, tmp_path):
    src = _source(uuid.uuid4().hex)
    good = _nvrtc.compile_cubin(src, "t_mode", ARCH)
    (path,) = _entries(cache)
    os.chmod(path, 0o666)
    assert _nvrtc._read(path) is None
    os.chmod(path, 0o600)
    assert _nvrtc._read(path) == good
    elsewhere = tmp_path / "elsewhere.cubin"
    elsewhere.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(elsewhere)
    assert _nvrtc._read(path) is None


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o722])
def test_shared_cache_folder_is_not_used(tmp_path, monkeypatch, mode):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    monkeypatch.setenv("DEVICEOP_CACHE_DIR", str(d))
    _nvrtc.forget_memory_cache()
    src = _source(uuid.uuid4().hex)
    try:
        with pytest.warns(do.DeviceOpWarning, match="not private"):
            cubin = _nvrtc.compile_cubin(src, "t_shared", ARCH)
        assert cubin[:4] == b"\x7fELF" and _entries(d) == []  # nothing written there
        _plant(_nvrtc.entry_path(src, "t_shared", ARCH), b"\x7fELF planted")
        _nvrtc.forget_memory_cache()
        with pytest.warns(do.DeviceOpWarning):
            assert _nvrtc.compile_cubin(src, "t_shared", ARCH) == cubin  # the planted entry is not read
    finally:
        _nvrtc.forget_memory_cache()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_folder_of_another_user_is_not_used(tmp_path, monkeypatch):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    monkeypatch.setenv("DEVICEOP_CACHE_DIR", str(d))
    _nvrtc.forget_memory_cache()
    try:
        with pytest.warns(do.DeviceOpWarning, match="owner uid 12345"):
            _nvrtc.compile_cubin(_source(uuid.uuid4().hex), "t_theirs", ARCH)
    finally:
        _nvrtc.forget_memory_cache()


def test_cache_folder_and_key_are_made_private(cache):
    _nvrtc.compile_cubin(_source(uuid.uuid4().hex), "t_private", ARCH)
    assert os.stat(cache).st_mode & 0o777 == 0o700
    key = cache / _nvrtc._KEY_FILE
    assert os.stat(key).st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 32
    (entry,) = _entries(cache)
    assert os.stat(entry).st_mode & 0o077 == 0
    os.chmod(key, 0o644)  # a key others can read is no longer a secret
    _nvrtc.forget_memory_cache()
    with pytest.warns(do.DeviceOpWarning, match="key"):
        assert _nvrtc._read(entry) is None
