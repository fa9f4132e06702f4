#!/usr/bin/env python3
"""The lines of sweep_prefill.sh's sweep.txt as one row per point: each variant's best
of its rounds in TFLOP/s and the ratio of the variant named `new` to each other one."""
import collections
import re
import sys


def main(path):
    best = collections.defaultdict(dict)
    for line in open(path):
        m = re.match(r"(\S+) r\d\s+(.*?)\s+[\d.]+ us\s+([\d.]+) TFLOP/s", line)
        if m:
            best[m.group(2).strip()].setdefault(m.group(1), []).append(float(m.group(3)))
    names = sorted({n for v in best.values() for n in v}, key=lambda n: (n != "new", n))
    print("best of the rounds (TFLOP/s); x = new / other")
    for label, v in best.items():
        top = {n: max(x) for n, x in v.items()}
        cols = "  ".join(f"{n} {top[n]:6.1f}" for n in names if n in top)
        ratios = "  ".join(f"x{n} {top['new'] / top[n]:4.2f}" for n in names
                           if n in top and n != "new" and "new" in top)
        print(f"{label[:60]:60s} {cols}  {ratios}")


if __name__ == "__main__":
    main(sys.argv[1])
