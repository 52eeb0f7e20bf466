"""deviceop's private compiled core (Cython).

Bottom to top: ``_base`` (the ledger lock, device buffers, wake-up channels, the driver
entry-point table a backend fills), ``_ledger`` (execution contexts, the access ledger and its
one enqueue entry point), ``_op`` (DeviceOp, the run protocol, the synchronous terminals),
``_launch`` (launch plans keyed by value, the kernel launch path, the chain step loop, graph
replays), ``_gemm`` (GEMM's per-call path: its op, the cuBLASLt call, replays of repeated calls),
``_external`` (the op of ``do.external``: another library's work under the ledger). Backends
sit between ``_base`` and ``_ledger``. Nothing outside deviceop imports it.
"""
