"""deviceop's maintained benchmarks: ``python -m benchmarks`` (see benchmarks/README.md)."""
