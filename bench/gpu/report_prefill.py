#!/usr/bin/env python3
"""Merges bench_prefill's and peers_prefill.py's JSON into one results file, draws TFLOP/s
against sequence length per group, and prints a table with the ratios to each peer.

    python3 bench/gpu/report_prefill.py --ours ours.json [--peers peers.json] --json out.json \
        [--png prefill.png] [--meta "commit ..."]
"""

import argparse
import datetime
import json
import re


def key(r):
    d = r.get("head_size", r.get("d"))
    # fp8 points (fp8 KV, and fp8 products with a quantised query) pair with the peers' bf16 run
    return (re.sub(r"-fp8(-qquant)?$", "", r["group"]), r["batch"], r["context"], r["q_len"], d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", required=True)
    ap.add_argument("--peers")
    ap.add_argument("--json", required=True)
    ap.add_argument("--png")
    ap.add_argument("--meta", default="")
    args = ap.parse_args()
    ours = json.load(open(args.ours))
    peers = json.load(open(args.peers)) if args.peers else {"results": []}
    peer_by = {}
    for p in peers["results"]:
        peer_by.setdefault(key(p), {})[p["backend"]] = p
    rows = []
    print(f"{'shape':52s} {'ours':>7s} {'cudnn':>7s} {'flash':>7s} {'x cudnn':>8s} {'x flash':>8s}")
    for r in ours["results"]:
        row = dict(r)
        for name, p in peer_by.get(key(r), {}).items():
            if "tflops" in p:
                row[f"{name}_tflops"] = p["tflops"]
                if "tflops" in r:
                    row[f"x_{name}"] = r["tflops"] / p["tflops"]
            else:
                row[f"{name}_error"] = p.get("error", "")
        rows.append(row)
        f = lambda k: f"{row[k]:7.1f}" if k in row else "      -"
        g = lambda k: f"{row[k]:8.2f}" if k in row else "       -"
        print(f"{r['label']:52s} {f('tflops')} {f('cudnn_tflops')} {f('flash_tflops')} "
              f"{g('x_cudnn')} {g('x_flash')}")
    doc = {"date": datetime.date.today().isoformat(), "meta": args.meta, "gpu": ours.get("gpu"),
           "torch": peers.get("torch"), "cudnn": peers.get("cudnn"),
           "flops": "4 * head_size per visible (query, key) pair per query head",
           "results": rows}
    with open(args.json, "w") as fh:
        json.dump(doc, fh, indent=1)
    if args.png:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("no matplotlib: no plot")
            return 0
        groups = sorted({r["group"] for r in rows})
        fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.5), squeeze=False)
        for ax, grp in zip(axes[0], groups):
            pts = [r for r in rows if r["group"] == grp and "tflops" in r]
            xs = [r["q_len"] + r["context"] for r in pts]
            for name, fld in (("pagedattn", "tflops"), ("cuDNN", "cudnn_tflops"),
                              ("flash", "flash_tflops")):
                sel = [(x, r[fld]) for x, r in zip(xs, pts) if fld in r]
                if sel:
                    ax.plot([a for a, _ in sel], [b for _, b in sel], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(grp, fontsize=9)
            ax.set_xlabel("keys per request (context + chunk)")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
