"""then / map / inspect: a chain of steps after a source op, run in order on one stream.

The chain and its step loop are compiled (``deviceop._core._op``: ``Chain``, ``chain``); this
module is their face among the combinators.
"""

from .._core._op import Chain, chain

__all__ = ["Chain", "chain"]
