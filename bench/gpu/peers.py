#!/usr/bin/env python3
"""Decode attention peers for bench_decode: torch SDPA with the cuDNN and flash backends.

The peers read contiguous KV [batch, num_kv_heads, seq_len, head_size] (no paging) of the
same shapes bench_decode pages. GQA is folded into the query length (the G query heads of a
KV head become G * q_len query rows of one head: [batch, num_kv_heads, G * q_len, head_size]),
so every backend sees plain MHA and reads each K/V byte once, as ours. Timing matches
bench_decode:
random bf16 data, inputs rotated so one pass reads >= 4x L2, all rotations captured in one
CUDA graph, CUDA events around each replay, the median of the replays. 4-token queries run
without a mask (SDPA's is_causal is top-left aligned, which is wrong for decode): the same
bytes, slightly less arithmetic than ours.

    python3 bench/gpu/peers.py --out peers.json [--quick] [--max-tokens N] [--only S1,S2]

--only keeps the points whose tag ("mha32/32 b64 ctx4096 q1 cudnn") contains one of the
substrings (ncu runs use it).
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

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def shapes(quick, max_tokens):
    batches = [1, 64] if quick else [1, 16, 64, 128, 256]
    contexts = [4096] if quick else [1024, 2048, 4096, 8192, 16384, 32768]
    out = []
    for b in batches:
        for ctx in contexts:
            if b * ctx <= max_tokens:
                out.append(dict(group="gqa32/8-d128", batch=b, context=ctx, q_len=1, hq=32, hkv=8, d=128))
    points = [(16, 8192)] if quick else [(1, 32768), (16, 8192), (64, 4096)]
    for b, ctx in points:
        base = dict(batch=b, context=ctx, q_len=1, hq=32, hkv=8, d=128)
        out.append({**base, "group": "d64", "d": 64})
        out.append({**base, "group": "d256", "d": 256})
        out.append({**base, "group": "mha32/32", "hkv": 32})
        out.append({**base, "group": "q4", "q_len": 4})
    return out


def bench(shape, backend, l2_bytes, repeats):
    b, ctx, q_len = shape["batch"], shape["context"], shape["q_len"]
    hq, hkv, d = shape["hq"], shape["hkv"], shape["d"]
    g = hq // hkv
    seq = ctx + q_len
    kv_bytes = 2.0 * b * seq * hkv * d * 2
    rotations = max(1, min(64, math.ceil(4.0 * l2_bytes / kv_bytes)))
    dev = torch.device("cuda")
    # Query heads kv*G .. kv*G+G-1 of every token, folded into G * q_len rows of KV head kv.
    qs = [torch.randn(b, hkv, g * q_len, d, device=dev, dtype=torch.bfloat16) for _ in range(rotations)]
    ks = [torch.randn(b, hkv, seq, d, device=dev, dtype=torch.bfloat16) for _ in range(rotations)]
    vs = [torch.randn(b, hkv, seq, d, device=dev, dtype=torch.bfloat16) for _ in range(rotations)]
    scale = 1.0 / math.sqrt(d)

    def one_pass():
        for i in range(rotations):
            F.scaled_dot_product_attention(qs[i], ks[i], vs[i], scale=scale)

    def timed(run):
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times

    result = {"backend": backend, "rotations": rotations, "kv_bytes": kv_bytes}
    try:
        with sdpa_kernel(BACKENDS[backend]):
            one_pass()  # warm-up: kernel selection, workspaces, clocks
            t0 = time.time()
            while time.time() - t0 < 0.1:
                one_pass()
            torch.cuda.synchronize()
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    one_pass()
                graph.replay()
                torch.cuda.synchronize()
                times = timed(graph.replay)
                result["timing"] = "cuda graph"
            except Exception as e:  # capture refused: time eager launches instead
                torch.cuda.synchronize()
                times = timed(one_pass)
                result["timing"] = f"eager ({type(e).__name__})"
        us = statistics.median(times) * 1e3 / rotations
        result.update(us=us, gbps=kv_bytes / (us * 1e-6) / 1e9,
                      us_spread=(max(times) - min(times)) * 1e3 / rotations)
    except Exception as e:  # a backend that refuses a shape: recorded, not fatal
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    del qs, ks, vs
    torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_peers.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=8 << 20)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    only = [x for x in args.only.split(",") if x]
    if not torch.cuda.is_available():
        print("peers: no CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    repeats = 5 if args.quick else 15
    doc = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": props.name,
           "results": []}
    for shape in shapes(args.quick, args.max_tokens):
        for backend in BACKENDS:
            tag = f"{shape['group']} b{shape['batch']} ctx{shape['context']} q{shape['q_len']} {backend}"
            if only and not any(x in tag for x in only):
                continue
            r = {**shape, **bench(shape, backend, l2, repeats)}
            doc["results"].append(r)
            if "us" in r:
                print(f"peer {tag:48s} {r['us']:9.1f} us {r['gbps']:7.0f} GB/s", flush=True)
            else:
                print(f"peer {tag:48s} {r['error']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
