"""Untyped third-party package: its modules are declared so type checkers resolve deviceop's imports."""
