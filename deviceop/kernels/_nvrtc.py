"""NVRTC compilation to CUBIN with an on-disk cache.

Entries are keyed by a hash of the source, the options, the target arch, the NVRTC release and
the cache format. The release comes from the NVRTC wheel's metadata where there is one: loading
libnvrtc just to ask its version costs tens of milliseconds of a warm start.

A cubin is code loaded into the process's GPU context, so the cache trusts only what this user
wrote. The folder must be this user's and writable by no one else (it is made so, mode 0700);
otherwise the disk cache is not used (a warning says why) and kernels are compiled in memory.
Each entry must be this user's regular file, writable by no one else, and carries an HMAC-SHA256
of its name and payload under a per-user key kept in the folder (``.key``, mode 0600): a
truncated, corrupted, planted or swapped entry fails the check and is recompiled and replaced,
never loaded. Writes go to a temporary file in the same folder and are renamed into place, so
two processes compiling the same kernel at once both end with a complete entry.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Sequence
from pathlib import Path

from .._errors import CompileError, DeviceOpWarning, warn_user
from .._process import renew_at_fork

__all__ = ["cache_dir", "cache_stats", "compile_cubin", "nvrtc_version"]

_MAGIC = b"DEVICEOP-CUBIN-2\n"
_stats = {"hits": 0, "misses": 0, "corrupt": 0}
_memo: dict[str, bytes] = {}
#: per cache folder: its key, or the reason it is not trusted (a str)
_keys: dict[str, bytes | str] = {}
_KEY_FILE = ".key"
_lock = threading.Lock()
renew_at_fork(globals(), _lock=threading.Lock)  # a thread may hold it at fork()


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$DEVICEOP_CACHE_DIR``, else ``~/.cache/deviceop``."""
    d = os.environ.get("DEVICEOP_CACHE_DIR")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deviceop"


def cache_stats() -> dict[str, int]:
    """Counters since start: disk ``hits``, ``misses`` (compiled), ``corrupt`` entries replaced."""
    return dict(_stats)


def nvrtc_version() -> tuple[int, int]:
    """The NVRTC version as (major, minor)."""
    from cuda.bindings import nvrtc

    _err, major, minor = nvrtc.nvrtcVersion()
    return (major, minor)


_ident: list[str] = []


def nvrtc_ident() -> str:
    """A string that changes when the NVRTC compiler does (wheel version, else nvrtcVersion)."""
    if not _ident:
        from importlib import metadata

        for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"):
            try:
                _ident.append(f"{dist}=={metadata.version(dist)}")
                break
            except metadata.PackageNotFoundError:
                continue
        else:
            _ident.append(f"nvrtc {nvrtc_version()}")
    return _ident[0]


def _include_dirs() -> list[str]:
    import cuda.pathfinder as pf

    d = pf.find_nvidia_header_directory("cudart")
    if d is None:  # pragma: no cover - the runtime headers wheel is a dependency
        raise CompileError(
            "cuda_fp16.h was not found; install the CUDA runtime headers (pip install nvidia-cuda-runtime)"
        )
    return [d]


def _annotate(log: str, source: str, filename: str) -> str:
    lines = source.splitlines()
    out = [log.rstrip()]
    seen = set()
    for m in re.finditer(re.escape(filename) + r"\((\d+)\): (?:error|catastrophic error)", log):
        n = int(m.group(1))
        if n in seen or not 1 <= n <= len(lines):
            continue
        seen.add(n)
        out.append(f"  {n:5d} | {lines[n - 1]}")
    return "\n".join(out)


def _compile(source: str, name: str, options: Sequence[str], arch: str) -> bytes:
    from cuda.bindings import nvrtc

    filename = f"{name}.cu"
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], [])
    if err:
        raise CompileError(f"nvrtcCreateProgram failed for kernel {name!r}: {err!r}")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", *options]
        opts += [f"-I{d}" for d in _include_dirs()]
        bopts = [o.encode() for o in opts]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        # writable buffers only: `b" " * 1` is CPython's interned one-byte object, and writing
        # into it would corrupt every b" " in the process
        log_b = bytearray(max(size, 1))
        nvrtc.nvrtcGetProgramLog(prog, log_b)
        log = bytes(log_b).rstrip(b"\0 ").decode(errors="replace")
        if err:
            raise CompileError(
                f"NVRTC could not compile kernel {name!r} for {arch}:\n{_annotate(log, source, filename)}\n"
                "Fix the source above; the failing lines are quoted under the log.",
                log=log,
            )
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err:
            raise CompileError(f"nvrtcGetCUBIN failed for kernel {name!r}: {err!r}")
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _private(st: os.stat_result) -> bool:
    """Owned by this user and writable by no one else."""
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _folder_key(d: Path) -> bytes | str:
    """The per-user key of cache folder ``d``, made on first use; a str says why ``d`` is not used."""
    k = str(d)
    with _lock:
        got = _keys.get(k)
    if got is not None:
        return got
    untrusted = True  # a folder or key someone else could have written: say so
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(d)
        if not stat.S_ISDIR(st.st_mode) or not _private(st):
            got = (
                f"the kernel cache folder {d} is not private to this user (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o}), so a cubin another user put there could be loaded; "
                f"make it yours with mode 700 (chmod 700 {d}) or set DEVICEOP_CACHE_DIR to a folder of yours"
            )
        else:
            got = _read_key(d / _KEY_FILE)
    except OSError as e:  # an unwritable cache only costs a compilation per process
        got, untrusted = f"the kernel cache folder {d} cannot be used ({e})", False
    with _lock:
        first = k not in _keys
        got = _keys.setdefault(k, got)
    if first and untrusted and isinstance(got, str):
        warn_user(f"deviceop: {got}; compiling in memory instead", DeviceOpWarning)
    return got


def _read_key(path: Path) -> bytes | str:
    """The key in ``path``, made (32 random bytes, mode 0600) if there is none."""
    import secrets

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        key = f.read(64)
    if not stat.S_ISREG(st.st_mode) or not _private(st) or st.st_mode & 0o077 or len(key) != 32:
        return f"the kernel cache key {path} is not this user's private 32-byte file; delete it to make a new one"
    return key


def _mac(key: bytes, name: str, payload: bytes) -> bytes:
    import hashlib  # (here: the cache's modules cost start-up time to programs that never compile)
    import hmac

    return hmac.new(key, name.encode() + b"\0" + payload, hashlib.sha256).digest()


def _read(path: Path) -> bytes | None:
    """The payload of the entry at ``path``, or None unless it is this user's, intact and authentic."""
    key = _folder_key(path.parent)
    if isinstance(key, str):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or not _private(st):
            return None
        data = f.read()
    head = len(_MAGIC)
    if data[:head] != _MAGIC or len(data) < head + 32:
        return None
    mac, payload = data[head : head + 32], data[head + 32 :]
    import hmac

    if not payload or not hmac.compare_digest(_mac(key, path.name, payload), mac):
        return None
    return payload


def _write(path: Path, payload: bytes) -> None:
    key = _folder_key(path.parent)
    if isinstance(key, str):
        return
    try:
        import tempfile

        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + _mac(key, path.name, payload) + payload)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # an unwritable cache only costs a recompilation next time


def _key(source: str, arch: str, options: Sequence[str]) -> str:
    import hashlib

    return hashlib.sha256("\0".join([source, arch, *options, nvrtc_ident(), _MAGIC.decode()]).encode()).hexdigest()


def entry_path(source: str, name: str, arch: str, options: Sequence[str] = ()) -> Path:
    """Where the cache keeps the CUBIN of ``source`` (for ``name``, ``arch``, ``options``)."""
    return cache_dir() / f"{name}-{_key(source, arch, options)[:32]}.cubin"


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str] = ()) -> bytes:
    """Compile ``source`` to a CUBIN for ``arch`` (e.g. ``"sm_90"``), through the disk cache."""
    key = _key(source, arch, options)
    with _lock:
        hit = _memo.get(key)
    if hit is not None:
        return hit
    path = cache_dir() / f"{name}-{key[:32]}.cubin"
    cubin = _read(path)
    if cubin is not None:
        _stats["hits"] += 1
    else:
        if path.exists() and not isinstance(_folder_key(path.parent), str):
            _stats["corrupt"] += 1  # (refused: damaged, planted or swapped)
        _stats["misses"] += 1
        cubin = _compile(source, name, options, arch)
        _write(path, cubin)
    with _lock:
        _memo[key] = cubin
    return cubin


def forget_memory_cache() -> None:
    """Drop the in-process memo (and what is known of cache folders) so the next compile reads
    the disk cache again (used by tests)."""
    with _lock:
        _memo.clear()
        _keys.clear()
