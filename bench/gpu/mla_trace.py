#!/usr/bin/env python3
"""Reads the MLAT lines of a -DPAGEDATTN_MLA_TRACE build (src/cuda/mla/trace.cuh) and prints,
per traced CTA, the median cycles of every step of a seesaw tile and of the producer, and the
timeline of a few tiles on one time axis.

    bench_mla --only "h128q1 b64 ctx4096 " | python3 bench/gpu/mla_trace.py
"""
import statistics
import sys
from collections import defaultdict

# Consumer events (seesaw_warpgroup, own tile j) and producer events (tile j), in order.
CONSUMER = ["top", "pv(j-2) done+release", "other's max", "other's P", "other's half (PV j-1)",
            "own half of j", "other half of j", "PV(j-1) done", "S_j done", "softmax",
            "P written", "RS PV issued"]
PRODUCER = ["top", "table published", "1st half empty", "1st half issued", "2nd half empty",
            "2nd half issued"]


def main():
    rows = defaultdict(dict)  # (cta, role) -> tile -> [t0..t11]
    for line in sys.stdin:
        f = line.split()
        if len(f) == 16 and f[0] == "MLAT":
            cta, role, j = int(f[1]), int(f[2]), int(f[3])
            rows[(cta, role)][j] = [int(x) for x in f[4:]]
    if not rows:
        sys.exit("no MLAT lines")
    for cta in sorted({c for c, _ in rows}):
        t0 = min(v for r in range(3) for t in rows.get((cta, r), {}).values() for v in t if v)
        print(f"== CTA {cta} (cycles; medians over tiles 4..)")
        for role in (1, 2):
            tiles = rows.get((cta, role), {})
            own = sorted(j for j, t in tiles.items() if j >= 4 and t[0] and t[11])
            if len(own) < 2:
                continue
            print(f"consumer warpgroup {role - 1}: {len(own)} own tiles")
            for e in range(1, 12):
                d = [tiles[j][e] - tiles[j][e - 1] for j in own if tiles[j][e] and tiles[j][e - 1]]
                if d:
                    print(f"  {CONSUMER[e - 1]:>24s} -> {CONSUMER[e]:<24s} {statistics.median(d):8.0f}")
            per = [tiles[b][0] - tiles[a][0] for a, b in zip(own, own[1:]) if b == a + 2]
            if per:
                print(f"  {'period of 2 tiles':>51s} {statistics.median(per):8.0f}")
        tiles = rows.get((cta, 0), {})
        js = sorted(j for j, t in tiles.items() if j >= 4 and t[0] and t[5])
        if js:
            print(f"producer: {len(js)} tiles")
            for e in range(1, 6):
                d = [tiles[j][e] - tiles[j][e - 1] for j in js]
                print(f"  {PRODUCER[e - 1]:>24s} -> {PRODUCER[e]:<24s} {statistics.median(d):8.0f}")
        # One axis: every event of tiles 8..11, sorted by time.
        ev = []
        for role in range(3):
            names = PRODUCER if role == 0 else CONSUMER
            for j, t in rows.get((cta, role), {}).items():
                if 8 <= j <= 11:
                    ev += [(v - t0, role, j, names[e]) for e, v in enumerate(t[:len(names)]) if v]
        print("timeline (cycles from the CTA's first event; role 0 producer, 1 / 2 warpgroups)")
        for v, role, j, name in sorted(ev):
            print(f"  {v:9d}  r{role} tile {j:2d}  {name}")


if __name__ == "__main__":
    main()
