"""Sums a sampling profile's stacks: where one thread's time goes, by function.

Reads py-spy's raw output (``py-spy record --native -f raw``: one line per distinct stack,
frames root first separated by ``;``, then the sample count), keeps the stacks that pass
through ``--within`` (a substring of a frame, e.g. ``queue (queue_split.py``) and through no
``--without`` (e.g. ``importlib``: a first run's imports), and prints the
share of those samples per leaf frame (own time) and, for each ``--frame`` substring, the share
of samples with it anywhere on the stack (inclusive time).

    py-spy record --native -r 4000 -f raw -o q.raw -- python3 experiments/queue_split.py ...
    python experiments/stacks.py q.raw --within "queue (queue_split.py" --frame epoll --frame await_op
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

_LINE = re.compile(r"^(.*) (\d+)$")
#: a frame's line number and address vary within one function: sum by function and file
_WHERE = re.compile(r"(?::\d+\)|\+0x[0-9a-f]+)")


def read(path: str) -> list[tuple[list[str], int]]:
    out = []
    with open(path) as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if m:
                out.append((m.group(1).split(";"), int(m.group(2))))
    return out


def frame_name(frame: str) -> str:
    return _WHERE.sub(")", frame) if "(" in frame else frame


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--within", action="append", default=[], help="keep stacks with a frame containing this")
    ap.add_argument("--without", action="append", default=[], help="drop stacks with a frame containing this")
    ap.add_argument("--frame", action="append", default=[], help="report inclusive share of frames containing this")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    stacks = [
        (s, n)
        for s, n in read(a.raw)
        if all(any(w in f for f in s) for w in a.within) and not any(w in f for f in s for w in a.without)
    ]
    total = sum(n for _, n in stacks)
    if not total:
        print("no samples pass --within", file=sys.stderr)
        return 1
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    for s, n in stacks:
        own[frame_name(s[-1])] += n
        for pat in a.frame:
            if any(pat in f for f in s):
                incl[pat] += n
    doc = {
        "samples": total,
        "own": [{"frame": f, "share": n / total} for f, n in own.most_common(a.top)],
        "inclusive": {p: incl[p] / total for p in a.frame},
    }
    print(f"{total} samples")
    for r in doc["own"]:
        print(f"  {100 * r['share']:5.1f} %  {r['frame']}")
    for p, v in doc["inclusive"].items():
        print(f"  incl {100 * v:5.1f} %  {p}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
