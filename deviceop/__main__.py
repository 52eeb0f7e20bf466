"""``python -m deviceop demo | info | compile``, ``python -m deviceop --version``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np


def _backend() -> Any:
    """The default backend. Where it falls back to the host backend (no GPU), the warning that
    says why is printed as a note: run as a program, the first caller outside deviceop, to which
    the library attributes its warnings, is the interpreter's start-up code."""
    import warnings

    from deviceop._core._select import _pool_size, current
    from deviceop._errors import BackendError, DeviceOpWarning

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", DeviceOpWarning)
        try:
            be = current()
        except BackendError as e:  # a setting's error, or the cuda backend asked for and unusable
            hint = ""
            if os.environ.get("DEVICEOP_BACKEND", "").strip().lower() == "cuda":
                try:
                    _pool_size()  # (DEVICEOP_STREAMS's own error needs no word on the backend)
                except BackendError:
                    pass
                else:
                    hint = (
                        "; DEVICEOP_BACKEND=cuda asked for it: unset DEVICEOP_BACKEND (deviceop then "
                        "falls back to the host backend where there is no GPU) or set it to host"
                    )
            raise SystemExit(f"python -m deviceop: {e}{hint}") from None
    for w in got:
        if issubclass(w.category, DeviceOpWarning):
            print(f"note: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return be


def _info() -> int:
    import deviceop as do

    be = _backend()
    print(f"backend:            {be.name}")
    print(f"devices:            {', '.join(do.devices())} (default {be.device_label})")
    print(f"device:             {be.device_name}")
    cc = be.compute_capability
    print(f"compute capability: {f'{cc[0]}.{cc[1]}' if be.name == 'cuda' else 'none (an emulated device)'}")
    print(f"driver:             {be.driver_version if be.name == 'cuda' else 'none (the host backend needs none)'}")
    print(f"stream pool:        {len(be.streams)} streams")
    print(f"kernel cache:       {do.kernels.cache_dir()}")
    print(f"await poll budget:  {do.poll_budget() * 1e6:.0f} us")
    print(f"await wait policy:  {do.wait_policy()}")
    return 0


def _demo() -> int:
    import deviceop as do

    K = do.kernels
    t0 = time.perf_counter()
    be = _backend()
    print(
        f"deviceop demo on the {be.name} backend"
        + (f" ({be.device_name})" if be.name == "cuda" else ", an emulated device")
    )
    print("  (Listing 1 is the first listing of 'Fearless Concurrency on the GPU', arXiv:2606.15991)")

    # Listing 1 of "Fearless Concurrency on the GPU" (Elibol et al., arXiv:2606.15991): z = x + y,
    # the output partitioned into 128-element tiles
    x_np = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    y_np = np.random.default_rng(1).standard_normal(1024).astype(np.float32)
    x = do.from_numpy(x_np)
    y = do.from_numpy(y_np)
    z = do.zeros([1024], do.float32).map(lambda t: t.partition([128]))
    t1 = time.perf_counter()
    (zp, _x, _y) = K.add(z, x, y).sync()
    t_add = time.perf_counter() - t1
    ok_add = np.array_equal(zp.tensor.numpy(), x_np + y_np)
    print(
        f"  listing 1 (add, 1024 f32, 8 tiles):   {'ok' if ok_add else 'WRONG'}   {t_add * 1e3:8.3f} ms (first run compiles or loads kernels)"
    )

    # a then-chain: 100 dependent scale launches on one stream, one sync
    a = np.full(2048, 1.0, dtype=np.float16)
    n = 100
    op = do.from_numpy(a).map(lambda t: (t.partition((128,)), t, 1.01))
    for _ in range(n):
        op = op.then(lambda o: K.scale(*o))
    t2 = time.perf_counter()
    out: Any = op.map(lambda o: o[1]).sync()  # the scaled tensor
    t_chain = time.perf_counter() - t2
    ref = a.astype(np.float32)
    for _ in range(n):
        ref = (ref * np.float32(1.01)).astype(np.float16).astype(np.float32)
    ok_chain = np.array_equal(out.numpy().astype(np.float32), ref)
    print(
        f"  then-chain (100 x scale, 2048 f16):   {'ok' if ok_chain else 'WRONG'}   {t_chain * 1e3:8.3f} ms ({t_chain / n * 1e6:.1f} µs/op)"
    )
    print(f"    1.0 scaled by 1.01 a hundred times, in order: {float(out.numpy()[0]):.4f} (numpy in f16: {ref[0]:.4f})")

    # the same chain again, now that everything is warm
    op = do.from_numpy(a).map(lambda t: (t.partition((128,)), t, 1.01))
    for _ in range(n):
        op = op.then(lambda o: K.scale(*o))
    t3 = time.perf_counter()
    op.sync()
    t_warm = time.perf_counter() - t3
    print(f"  then-chain again (warm):              {'':5}{t_warm * 1e3:8.3f} ms ({t_warm / n * 1e6:.1f} µs/op)")
    print(f"  total {time.perf_counter() - t0:.2f} s")
    return 0 if ok_add and ok_chain else 1


def _compile(arch: str) -> int:
    from deviceop import kernels

    t = time.perf_counter()
    cubin = kernels.compile_builtins(arch)
    print(
        f"compiled {len(kernels.builtin_names())} built-in kernels for {arch}: {len(cubin)} bytes "
        f"in {time.perf_counter() - t:.2f} s (cache: {kernels.cache_dir()})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    ap = argparse.ArgumentParser(prog="python -m deviceop", description="deviceop command line")
    ap.add_argument("--version", action="version", version=f"deviceop {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{demo,info,compile}")
    sub.add_parser(
        "demo",
        help="run Listing 1 of 'Fearless Concurrency on the GPU' (arXiv:2606.15991) and a then-chain, checked against numpy",
    )
    sub.add_parser("info", help="backend, devices, compute capability, driver, stream pool")
    c = sub.add_parser("compile", help="compile every built-in kernel with NVRTC (no GPU needed)")
    c.add_argument("--arch", default="sm_90")
    a = ap.parse_args(argv)
    if a.cmd == "demo":
        return _demo()
    if a.cmd == "info":
        return _info()
    return _compile(a.arch)


if __name__ == "__main__":
    sys.exit(main())
