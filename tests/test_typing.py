"""What a type checker sees of a user's program: precise types for ops, kernel calls, zip, gemm,
the queues and the lazily loaded names (mypy on a small program, its revealed types checked)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """
    import numpy as np
    import deviceop as do
    from deviceop.executors import WorkQueue

    K = do.kernels
    x = do.from_numpy(np.ones(256, np.float32)).sync()
    z = do.zeros(256, do.float32).map(lambda t: t.partition((128,)))
    reveal_type(x)
    reveal_type(K.add(z, x, x).sync())
    reveal_type(K.scale(z, x, 2.0))
    reveal_type(K.gemm(x, x, x).sync())
    reveal_type(do.zip(do.value(1), do.value("a")).sync())
    reveal_type(do.zeros(4, do.float32).then(lambda t: do.to_numpy(t)).sync())
    reveal_type(do.zeros(4, do.float32).submit())
    reveal_type(WorkQueue)
    reveal_type(do.executors.ThreadedQueue)
    reveal_type(do.graph.GraphCache)
    reveal_type(do.zeros(4, do.float32).graph().launch())
    """
)

EXPECTED = [
    "deviceop._core._tensor.Tensor",
    "tuple[deviceop._core._tensor.Partition, deviceop._core._tensor.Tensor, deviceop._core._tensor.Tensor]",
    "deviceop._core._op.DeviceOp[tuple[deviceop._core._tensor.Partition, deviceop._core._tensor.Tensor, float]]",
    "tuple[deviceop._core._tensor.Tensor | deviceop._core._tensor.Partition, deviceop._core._tensor.Tensor, "
    "deviceop._core._tensor.Tensor]",
    "tuple[int, str]",
    "numpy.ndarray[",
    "deviceop._core._future.DeviceFuture[deviceop._core._tensor.Tensor]",
    "def (streams:",
    "def (streams:",
    "def (build:",
    "deviceop._core._op.DeviceOp[deviceop._core._tensor.Tensor]",
]


def test_revealed_types(tmp_path):
    pytest.importorskip("mypy")
    src = tmp_path / "program.py"
    src.write_text(PROGRAM, encoding="utf-8")
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", os.devnull, str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    revealed = re.findall(r'Revealed type is "(.*)"', r.stdout)
    assert len(revealed) == len(EXPECTED), r.stdout + r.stderr
    for got, want in zip(revealed, EXPECTED):
        got = got.replace("builtins.", "")  # (mypy releases differ in naming builtins)
        assert got.startswith(want), f"revealed {got!r}, expected {want!r}"
    assert "error:" not in r.stdout.replace("Revealed type", ""), r.stdout
