#!/usr/bin/env python3
"""Tabulates bench/gpu/ab_builds.sh's runs: for every benchmark point, each build's best time
over the rounds and its ratio to the first build's (> 1: slower), then each build's time in
every round, and a summary of the ratios per benchmark.

    ab_table.py RAW_DIR NAME [NAME ...]

RAW_DIR holds <bench>-<name>-<round>.json as the benchmarks write them (any object with a
"label" and a "us" is a point).
"""

import json
import pathlib
import re
import statistics
import sys


def points(node, out):
    if isinstance(node, dict):
        if "label" in node and "us" in node:
            out[str(node["label"])] = float(node["us"])
        for v in node.values():
            points(v, out)
    elif isinstance(node, list):
        for v in node:
            points(v, out)
    return out


def main():
    raw = pathlib.Path(sys.argv[1])
    names = sys.argv[2:]
    runs = {}  # (bench, name) -> [ {label: us} per round ]
    for f in sorted(raw.glob("*.json")):
        m = re.fullmatch(r"(\w+)-(.+)-(\d+)\.json", f.name)
        if not m:
            continue
        bench, name, _ = m.groups()
        try:
            runs.setdefault((bench, name), []).append(points(json.loads(f.read_text()), {}))
        except (OSError, ValueError) as e:
            print(f"unreadable {f.name}: {e}")
    benches = sorted({b for b, _ in runs}, key=["decode", "prefill", "mla"].index)
    base = names[0]
    summary = []
    for bench in benches:
        labels = []
        for rounds in runs.get((bench, base), []):
            labels += [lab for lab in rounds if lab not in labels]
        print(f"== {bench}: best us over the rounds, ratio to {base} (> 1: slower)")
        head = "".join(f"{n:>12}" for n in names) + "".join(f"{n + '/' + base:>14}"
                                                             for n in names[1:])
        print(f"{'point':<58}{head}")
        ratios = {n: [] for n in names[1:]}
        for lab in labels:
            best = {}
            for n in names:
                ts = [r[lab] for r in runs.get((bench, n), []) if lab in r]
                best[n] = min(ts) if ts else None
            cells = "".join(f"{best[n]:>12.1f}" if best[n] else f"{'-':>12}" for n in names)
            for n in names[1:]:
                if best[n] and best[base]:
                    ratios[n].append(best[n] / best[base])
                    cells += f"{best[n] / best[base]:>14.3f}"
                else:
                    cells += f"{'-':>14}"
            print(f"{lab[:57]:<58}{cells}")
        for n in names[1:]:
            r = ratios[n]
            if r:
                summary.append(f"{bench:<8} {n}/{base}: {len(r)} points, median "
                               f"{statistics.median(r):.3f}, min {min(r):.3f}, max {max(r):.3f}")
        print()
        print(f"== {bench}: every round (us)")
        for lab in labels:
            cells = []
            for n in names:
                ts = [r.get(lab) for r in runs.get((bench, n), [])]
                cells.append(n + " " + " ".join(f"{x:.1f}" if x else "-" for x in ts))
            print(f"{lab[:57]:<58}{' | '.join(cells)}")
        print()
    print("== summary")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
