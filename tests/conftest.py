"""Shared fixtures: one suite parametrized over the host and cuda backends.

The on-disk NVRTC cache goes to a per-session temporary folder (set before anything compiles),
so the suite never writes to ~/.cache. Host-backend tests run with chaos (random delays on
every queued item) so that a missing cross-stream dependency shows up as a wrong result.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

# deviceop is imported from wherever it is installed (the checkout after the README's editable
# install, or a wheel in site-packages): the checkout is not put on the path here, since its
# sources hold no compiled core unless it was built in place
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# before deviceop is imported (and long before anything compiles)
_CACHE_DIR = tempfile.mkdtemp(prefix="deviceop-test-cache-")
os.environ["DEVICEOP_CACHE_DIR"] = _CACHE_DIR
os.environ.setdefault("DEVICEOP_BACKEND", "host")  # code that runs without the fixture: no warning

import pytest  # noqa: E402

import deviceop as do  # noqa: E402
from deviceop.device import current as _current_backend  # noqa: E402

#: the cuda backend runs on deviceop's stub driver (tests/stub_driver): no GPU, built-ins emulated
STUB_DRIVER = os.environ.get("DEVICEOP_STUB_DRIVER") == "1"
if STUB_DRIVER:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from stub_driver import emulate

    emulate.install()


def needs_gpu(backend: str, why: str) -> None:
    """Skip a cuda test that needs a real GPU (cuBLAS, user kernels, device faults, timing) under the stub."""
    if backend == "cuda" and STUB_DRIVER:
        pytest.skip(f"the stub driver cannot run this: {why}")


HOST_CHAOS_S = 0.0005

_cuda_state: dict[str, object] = {}


def _cuda_skip_reason() -> str | None:
    """Why the cuda backend cannot be used here (None: it can). Probed once per session."""
    if "reason" not in _cuda_state:
        try:
            do.use_backend("cuda")
            _cuda_state["reason"] = None
        except do.BackendError as e:
            _cuda_state["reason"] = f"no usable CUDA device: {e}"
    return _cuda_state["reason"]  # type: ignore[return-value]


@pytest.fixture(scope="session", params=["host", "cuda"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    """Session-scoped so that pytest groups all host tests, then all cuda tests."""
    name = request.param
    if name == "cuda":
        reason = _cuda_skip_reason()
        if reason:
            pytest.skip(reason)
    return name


@pytest.fixture
def backend(backend_kind: str):
    """Select the backend for one test (``do.use_backend``) and yield its name.

    A host device is reused while it is healthy (a fresh one costs five threads); one that
    faulted (a test provoked a CudaError) is replaced by ``do.use_backend("host")``.
    """
    name = backend_kind
    cur = _current_backend()
    if name == "host":
        if cur.name != "host" or cur.error is not None:
            do.use_backend("host")
        do.set_host_chaos(HOST_CHAOS_S)
    else:
        do.use_backend("cuda")  # reuses the existing context when cuda is already selected
        do.set_host_chaos(0)
    assert do.backend_name() == name
    try:
        yield name
    finally:
        do.set_host_chaos(0)
        do.set_borrow_policy("order")


@pytest.fixture
def host_backend():
    """A healthy host backend with chaos, for tests that only make sense on the host."""
    cur = _current_backend()
    if cur.name != "host" or cur.error is not None:
        do.use_backend("host")
    do.set_host_chaos(HOST_CHAOS_S)
    try:
        yield "host"
    finally:
        do.set_host_chaos(0)
        do.set_borrow_policy("order")


@pytest.fixture(scope="session")
def cache_root() -> str:
    """The session's DEVICEOP_CACHE_DIR."""
    return _CACHE_DIR


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """Skipped tests counted by reason, one line each (a machine without a GPU skips every cuda
    case for one reason); ``-rs`` lists each skipped test as pytest does."""
    skipped = terminalreporter.stats.get("skipped", [])
    chars = config.option.reportchars or ""
    if not skipped or any(c in chars for c in "saA"):
        return  # (pytest lists them itself)
    counts: dict[str, int] = {}
    for rep in skipped:
        lr = rep.longrepr
        reason = str(lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr)
        reason = reason.removeprefix("Skipped: ")
        counts[reason] = counts.get(reason, 0) + 1
    terminalreporter.write_sep("=", f"{len(skipped)} skipped, by reason (-rs lists each test)")
    for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{n:6d}  {reason}")
