#!/usr/bin/env python3
"""Tables of bench_decode's and bench_prefill's head-size sweeps (groups heads-*): each size's
rate and its ratio to the nearest compiled head size (the bucket it runs on when it is not
compiled itself; ties go to the bucket). Decode rates are bytes/s of the problem's K/V, prefill
rates FLOP/s at the problem's head size.

    head_sizes_table.py decode.json prefill.json
"""
import json
import sys

COMPILED = (64, 80, 96, 128, 192, 256)  # PAGEDATTN_CUDA_HEAD_SIZES' default


def nearest(d):
    bucket = min((c for c in COMPILED if c >= d), default=None)
    below = max((c for c in COMPILED if c < d), default=None)
    if below is None or (bucket is not None and bucket - d <= d - below):
        return bucket
    return below


def table(path, key, unit, scale, split):
    rows = [r for r in json.load(open(path))["results"] if r["group"].startswith("heads-")]
    out = []
    for group in sorted({split(r) for r in rows}):
        by_d = {r["head_size"]: r for r in rows if split(r) == group}
        out.append(f"\n{group}: {unit}, ratio to the nearest compiled size")
        out.append(f"{'d':>5} {'runs on':>8} {unit:>10} {'nearest':>8} {'ratio':>6}")
        for d in sorted(by_d):
            r = by_d[d]
            if key not in r:
                out.append(f"{d:>5} {'-':>8} skipped: {r.get('skipped', '?')}")
                continue
            n = nearest(d)
            runs = min((c for c in COMPILED if c >= d), default=None)
            base = by_d.get(n, {}).get(key)
            ratio = f"{r[key] / base:.2f}" if base and d not in COMPILED else "-"
            mark = "" if d in COMPILED or ratio == "-" or float(ratio) >= 0.8 else "  < 0.8"
            out.append(f"{d:>5} {runs:>8} {r[key] * scale:>10.0f} {n:>8} {ratio:>6}{mark}")
    return out


def main():
    decode, prefill = sys.argv[1], sys.argv[2]
    lines = table(decode, "gbps", "GB/s", 1.0, lambda r: f"decode {r['kv_cache_dtype']} cache, "
                  f"b{r['batch']} ctx{r['context']} h{r['num_heads']}/{r['num_kv_heads']}")
    lines += table(prefill, "tflops", "TFLOP/s", 1.0, lambda r: f"prefill causal "
                   f"b{r['batch']} q{r['q_len']} h{r['num_heads']}/{r['num_kv_heads']}")
    vit = [r for r in json.load(open(prefill))["results"] if r["label"].startswith("vit-mha")]
    if vit:
        lines.append("\nViT MultiHeadAttention (no cache), TFLOP/s at the problem's head size")
        for r in vit:
            lines.append(f"  {r['label']:<32} {r['tflops']:7.1f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
