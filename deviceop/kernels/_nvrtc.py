"""NVRTC compilation to CUBIN with an on-disk cache.

Entries are keyed by a hash of the source, the options, the target arch, the NVRTC release and
the cache format. The release comes from the NVRTC wheel's metadata where there is one: loading
libnvrtc just to ask its version costs tens of milliseconds of a warm start. Each file holds a magic, the SHA-256 of its payload and the payload; a file
that fails the check (truncated, corrupted) is recompiled and replaced, never trusted. Writes
go to a temporary file in the same folder and are renamed into place, so two processes
compiling the same kernel at once both end with a complete entry.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Sequence

from .._errors import CompileError
from .._process import renew_at_fork

__all__ = ["compile_cubin", "cache_dir", "cache_stats", "nvrtc_version"]

_MAGIC = b"DEVICEOP-CUBIN-1\n"
_stats = {"hits": 0, "misses": 0, "corrupt": 0}
_memo: dict[str, bytes] = {}
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

    err, major, minor = nvrtc.nvrtcVersion()
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


def _read(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(_MAGIC)
    if data[:head] != _MAGIC or len(data) < head + 32:
        return None
    digest, payload = data[head : head + 32], data[head + 32 :]
    import hashlib  # (here: the cache's modules cost start-up time to programs that never compile)

    if hashlib.sha256(payload).digest() != digest or not payload:
        return None
    return payload


def _write(path: Path, payload: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        import hashlib
        import tempfile

        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # an unwritable cache only costs a recompilation next time


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str] = ()) -> bytes:
    """Compile ``source`` to a CUBIN for ``arch`` (e.g. ``"sm_90"``), through the disk cache."""
    key_text = "\0".join([source, arch, *options, nvrtc_ident(), _MAGIC.decode()])
    import hashlib

    key = hashlib.sha256(key_text.encode()).hexdigest()
    with _lock:
        hit = _memo.get(key)
    if hit is not None:
        return hit
    path = cache_dir() / f"{name}-{key[:32]}.cubin"
    cubin = _read(path)
    if cubin is not None:
        _stats["hits"] += 1
    else:
        if path.exists():
            _stats["corrupt"] += 1
        _stats["misses"] += 1
        cubin = _compile(source, name, options, arch)
        _write(path, cubin)
    with _lock:
        _memo[key] = cubin
    return cubin


def forget_memory_cache() -> None:
    """Drop the in-process memo so the next compile reads the disk cache (used by tests)."""
    with _lock:
        _memo.clear()
