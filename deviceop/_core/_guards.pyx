# cython: language_level=3
"""Guards the terminals run before they wait: a timeout's value, a graph recording on this thread,
an event loop running on this thread (a blocking wait would stall it)."""

from ._base cimport n_recording

import math
import numbers
import sys
import threading

from .._errors import CaptureError, UsageError
from ._capture import CAPTURE

__all__ = ["blocking_allowed", "check_timeout", "loop_here", "refuse_in_capture", "refuse_on_loop"]


cpdef int refuse_in_capture(str what) except -1:
    """Raise CaptureError if this thread is recording a graph: ``what`` would wait or run now."""
    if n_recording == 0:
        return 0
    sc = CAPTURE.scope
    if sc is not None:
        raise CaptureError(
            f"{what} inside a graph recording: a graph records GPU work, it cannot wait for "
            f"results or run other work now ({sc!r} is recording on this thread). Run it before "
            "or after the scope, and record only the ops themselves"
        )
    return 0


cpdef object check_timeout(object timeout):
    """``timeout`` as a float of seconds (or None); UsageError for anything else: not a real
    number, negative, NaN or infinite (None waits without a limit)."""
    if timeout is None:
        return None
    if type(timeout) is not float and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)):
        raise UsageError(
            f"timeout must be None (no limit) or a finite number of seconds >= 0, got {timeout!r}"
        )
    try:
        t = float(timeout)
    except (OverflowError, ValueError):
        t = math.nan
    if not (t >= 0 and t != math.inf):
        raise UsageError(
            f"timeout must be None (no limit) or a finite number of seconds >= 0, got {timeout!r}"
        )
    return t


#: asyncio's running-loop query, once asyncio is imported (deviceop does not import it)
cdef object _running_loop = None


cpdef str loop_here():
    """The event-loop library running on this thread ("asyncio", also for uvloop, or "trio"),
    or None."""
    global _running_loop
    f = _running_loop
    if f is None:
        aio = sys.modules.get("asyncio")
        if aio is not None:
            f = _running_loop = aio._get_running_loop
    if f is not None and f() is not None:
        return "asyncio"
    sn = sys.modules.get("sniffio")  # (trio names itself there while it runs a task)
    if sn is not None and sn.thread_local.name == "trio":
        return "trio"
    return None


class _Blocking(threading.local):
    depth = 0  # blocking_allowed() scopes open on this thread


cdef object _BLOCKING = _Blocking()


class blocking_allowed:
    """``with blocking_allowed():`` lets the blocking terminals run on an event loop's thread for
    the code inside (this thread only). For documented one-time blocking steps such as a
    GraphCache's recording of a new bucket, whose build function may allocate with ``sync()``."""

    def __enter__(self):
        _BLOCKING.depth += 1
        return self

    def __exit__(self, *exc):
        _BLOCKING.depth -= 1
        return False


cpdef int refuse_on_loop(str what) except -1:
    """Raise UsageError if an event loop (asyncio, uvloop or trio) runs on this thread: ``what``
    would block it until GPU work completes, stalling every other task of the loop."""
    lib = loop_here()
    if lib is not None and not _BLOCKING.depth:
        raise UsageError(
            f"{what} would block the running {lib} event loop until the GPU work completes, "
            "stalling its other tasks. Await instead: 'await op' (or 'await op.wait(timeout=...)'), "
            "'await fut' (fut = op.submit()), 'await do.to_numpy(t)'; or run the blocking call in a thread "
            f"({'trio.to_thread.run_sync' if lib == 'trio' else 'asyncio.to_thread'})"
        )
    return 0
