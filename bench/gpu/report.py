#!/usr/bin/env python3
"""Merges bench_decode's and peers.py's JSON into one results file (bench/results style), draws
bytes/s against context per batch size, and prints a short table (run.sh keeps it as
decode-<card>.txt).

    python3 bench/gpu/report.py --ours ours.json [--peers peers.json] --json results.json \
        --png decode.png [--clocks "..."]
"""

import argparse
import datetime
import json
import sys


def key(r):
    return (r["group"], r["batch"], r["context"], r["q_len"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", required=True)
    ap.add_argument("--peers")
    ap.add_argument("--json", required=True)
    ap.add_argument("--png")
    ap.add_argument("--clocks", default="")
    args = ap.parse_args()
    ours = json.load(open(args.ours))
    peers = json.load(open(args.peers)) if args.peers else {"results": []}
    copy = ours.get("copy_gbps", 0.0)
    peer_by = {}
    for p in peers["results"]:
        peer_by.setdefault(key(p), {})[p["backend"]] = p
    # Paged-only variants compare with the contiguous bf16 peer of the same shape.
    alias = {"bs1": "gqa32/8-d128", "bs128": "gqa32/8-d128", "step-32-layers": "gqa32/8-d128",
             "hnd": "gqa32/8-d128"}
    rows = []
    for r in ours["results"]:
        row = dict(r)
        k = (alias.get(r["group"], r["group"]), r["batch"], r["context"], r["q_len"])
        for name, p in peer_by.get(k, {}).items():
            if "gbps" in p:
                row[f"{name}_us"] = p["us"]
                row[f"{name}_gbps"] = p["gbps"]
            else:
                row[f"{name}_error"] = p.get("error", "")
        if "gbps" in r:
            if row.get("cudnn_gbps"):
                row["ratio_cudnn"] = r["gbps"] / row["cudnn_gbps"]
            if copy:
                row["ratio_copy"] = r["gbps"] / copy
        rows.append(row)
    doc = {
        "commit": "COMMIT_PLACEHOLDER",
        "date": datetime.date.today().isoformat(),
        "gpu": ours.get("gpu"),
        "sms": ours.get("sms"),
        "l2_bytes": ours.get("l2_bytes"),
        "clocks": args.clocks,
        "torch": peers.get("torch"),
        "cudnn": peers.get("cudnn"),
        "copy_gbps": copy,
        "method": "KV bytes read once (sum of seq_len * Hkv * D * elem * 2) / median CUDA-graph "
                  "replay time per call; inputs rotated so a pass reads >= 4x L2; ours paged "
                  "(block size 16 unless noted, shuffled block table), peers contiguous",
        "decode": rows,
    }
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)

    if args.png:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            main_rows = [r for r in rows if r["group"] == "gqa32/8-d128" and "gbps" in r]
            batches = sorted({r["batch"] for r in main_rows})
            fig, axes = plt.subplots(1, max(1, len(batches)), figsize=(4 * max(1, len(batches)), 3.6),
                                     sharey=True, squeeze=False)
            for ax, b in zip(axes[0], batches):
                pts = sorted((r for r in main_rows if r["batch"] == b), key=lambda r: r["context"])
                ctx = [r["context"] for r in pts]
                ax.plot(ctx, [r["gbps"] for r in pts], "o-", label="pagedattn (paged)")
                for name in ("cudnn", "flash"):
                    ys = [r.get(f"{name}_gbps") for r in pts]
                    if any(ys):
                        ax.plot([c for c, y in zip(ctx, ys) if y], [y for y in ys if y], "s--",
                                label=f"sdpa {name} (contiguous)")
                if copy:
                    ax.axhline(copy, color="gray", lw=0.8, ls=":", label="D2D copy (r+w)")
                ax.set_xscale("log", base=2)
                ax.set_ylim(bottom=0)
                ax.set_title(f"batch {b}")
                ax.set_xlabel("context")
                ax.grid(alpha=0.3)
            axes[0][0].set_ylabel("KV GB/s")
            axes[0][0].legend(fontsize=7)
            fig.suptitle(f"decode GQA 32/8 d128 bf16, {ours.get('gpu')}")
            fig.tight_layout()
            fig.savefig(args.png, dpi=110)
        except Exception as e:  # the table matters more than the plot
            print(f"report: no plot ({e})", file=sys.stderr)

    print(f"\nD2D copy {copy:.0f} GB/s (read+write); GB/s = KV bytes once / graph-replay time")
    print(f"{'point':44s} {'us':>8s} {'GB/s':>6s} {'cudnn':>6s} {'flash':>6s} {'/cudnn':>6s} {'/copy':>6s}")
    for r in rows:
        name = f"{r['group']} b{r['batch']} c{r['context']}" + (f" q{r['q_len']}" if r["q_len"] > 1 else "")
        if r.get("layers"):
            name += f" x{r['layers']}L (per layer)"
        if "gbps" not in r:
            print(f"{name:44s} skipped: {r.get('skipped', '')[:60]}")
            continue
        def f(k, fmt="{:6.0f}"):
            return fmt.format(r[k]) if r.get(k) is not None else "     -"
        print(f"{name:44s} {r['us']:8.1f} {r['gbps']:6.0f} {f('cudnn_gbps')} {f('flash_gbps')} "
              f"{f('ratio_cudnn', '{:6.2f}')} {f('ratio_copy', '{:6.2f}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
