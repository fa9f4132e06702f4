"""Tables from an Nsight Compute report's exported pages, for the profile_*.sh scripts.

    python3 bench/gpu/ncu_stalls.py RAW.csv [SOURCE.csv]

RAW.csv (--page raw --csv): the warp stall reasons per issued instruction and the busiest pipes
(% of peak while active). SOURCE.csv (--page source --csv --print-source sass): the stall
samples by opcode and the 30 SASS instructions with the most samples.
"""

import csv
import re
import sys
from collections import defaultdict


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return None


def stalls_and_pipes(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 5]
    if len(rows) < 3:
        print("no raw rows")
        return
    out = []
    for h, v in zip(rows[0], rows[2]):
        stall = (h.startswith("smsp__average_warp_latency_issue_stalled_")
                 or h.startswith("smsp__average_warps_issue_stalled_")) and h.endswith(
                     "_per_issue_active.ratio")
        pipe = h.startswith("sm__pipe_") and h.endswith("pct_of_peak_sustained_active")
        if (stall or pipe) and num(v) is not None:
            out.append((num(v), h))
    for v, h in sorted(out, reverse=True)[:24]:
        print(f"{v:10.3f}  {h}")


def sass_samples(path):
    try:
        src = list(csv.reader(open(path)))
    except OSError:
        return
    hi = next((i for i, r in enumerate(src) if any(c.strip() == "Source" for c in r)), None)
    if hi is None:
        print("no SASS table")
        return
    col = {h.strip(): i for i, h in enumerate(src[hi])}
    s_col = next((i for h, i in col.items() if h.startswith("Warp Stall Sampling (All")), None)
    if s_col is None:
        print("no stall column")
        return
    ins = [(num(r[s_col]) or 0.0, r[col.get("Address", 0)], r[col["Source"]].strip())
           for r in src[hi + 1:] if len(r) > s_col]
    total = sum(s for s, _, _ in ins) or 1.0
    by_op = defaultdict(float)
    for s, _, text in ins:
        by_op[re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0]] += s
    print(f"-- stall samples by opcode (total {total:.0f})")
    for op, s in sorted(by_op.items(), key=lambda x: -x[1])[:16]:
        print(f"{100 * s / total:6.1f}%  {op}")
    print("-- top instructions")
    for s, a, text in sorted(ins, reverse=True)[:30]:
        print(f"{100 * s / total:6.1f}%  {a}  {text[:90]}")


if __name__ == "__main__":
    stalls_and_pipes(sys.argv[1])
    if len(sys.argv) > 2:
        sass_samples(sys.argv[2])
