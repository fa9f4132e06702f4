#!/usr/bin/env python3
"""Prefill attention peers for bench_prefill: torch SDPA with the cuDNN and flash backends.

Contiguous bf16 [batch, heads, tokens, head_size] inputs (no paging) of bench_prefill's
shapes, causal; GQA through SDPA's enable_gqa (K/V keep the KV heads, as ours). A chunk of q
tokens over c cached ones uses a bottom-right causal mask (torch's causal_lower_right), which
is what chunked prefill means; a backend that refuses it is recorded with its error. FLOPs as
bench_prefill counts them; CUDA events around CUDA-graph replays, median.

    python3 bench/gpu/peers_prefill.py --out peers.json [--quick]
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def shapes(quick):
    out = []
    lens = [4096] if quick else [1024, 2048, 4096, 8192, 16384]
    for d in (128, 64, 256):
        for n in lens:
            out.append(dict(group=f"causal-d{d}", batch=max(1, 16384 // n), context=0, q_len=n,
                            hq=32, hkv=8, d=d))
    for ctx in [16384] if quick else [8192, 16384, 32768]:
        for chunk in [512] if quick else [256, 512, 1024]:
            out.append(dict(group="chunked-h8/1", batch=1, context=ctx, q_len=chunk, hq=8, hkv=1,
                            d=128))
    for seq in [577] if quick else [577, 1025]:
        for d in [64] if quick else [64, 80]:
            out.append(dict(group="vit-mha", batch=32, context=0, q_len=seq, hq=16, hkv=16, d=d,
                            causal=False))
    return out


def flops(s):
    if not s.get("causal", True):
        return 4.0 * s["d"] * s["q_len"] * s["q_len"] * s["hq"] * s["batch"]
    pairs = s["q_len"] * s["context"] + s["q_len"] * (s["q_len"] + 1) / 2
    return 4.0 * s["d"] * pairs * s["hq"] * s["batch"]


def bench(s, backend, repeats):
    b, n, ctx, hq, hkv, d = s["batch"], s["q_len"], s["context"], s["hq"], s["hkv"], s["d"]
    dev = torch.device("cuda")
    q = torch.randn(b, hq, n, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, ctx + n, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, ctx + n, d, device=dev, dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(d)
    mask = causal_lower_right(n, ctx + n) if ctx > 0 else None

    causal = s.get("causal", True)

    def run():
        if not causal:
            F.scaled_dot_product_attention(q, k, v, scale=scale)
        elif mask is None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    result = {"backend": backend}
    try:
        with sdpa_kernel(BACKENDS[backend]):
            run()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            per_graph = max(1, min(64, math.ceil(2.0 / max(start.elapsed_time(end), 1e-3))))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(per_graph):
                    run()
            t0 = time.time()
            while time.time() - t0 < 0.1:
                graph.replay()
                torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        us = statistics.median(times) * 1e3 / per_graph
        result.update(us=us, tflops=flops(s) / (us * 1e-6) / 1e12)
    except Exception as e:  # a backend that refuses a shape: recorded, not fatal
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    del q, k, v
    torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="peers_prefill.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("peers_prefill: no CUDA device", file=sys.stderr)
        return 2
    doc = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "gpu": torch.cuda.get_device_properties(0).name, "results": []}
    for s in shapes(args.quick):
        for backend in BACKENDS:
            r = {**s, **bench(s, backend, 5 if args.quick else 11)}
            doc["results"].append(r)
            tag = f"{s['group']} b{s['batch']} ctx{s['context']} q{s['q_len']} {backend}"
            if "us" in r:
                print(f"peer {tag:44s} {r['us']:10.1f} us {r['tflops']:6.1f} TFLOP/s", flush=True)
            else:
                print(f"peer {tag:44s} {r['error']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
