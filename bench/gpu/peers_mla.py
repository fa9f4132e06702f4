"""Torch peers of bench_mla: the absorbed MLA decode (16 or 128 heads x q_len tokens against one
576-wide latent head, V = its first 512 columns) on contiguous (unpaged) latent K, timed with
CUDA events over CUDA-graph replays, rotating among enough K buffers to exceed L2.

    python3 bench/gpu/peers_mla.py --out peers_mla.json [--quick]

Peers: `sdpa` = torch.nn.functional.scaled_dot_product_attention on the absorbed form (K
expanded to every head as a view; torch picks its backend, none of the fused ones takes head
size 576, so this is mostly the math path); `bmm` = two batched matmuls and a softmax in fp32
(what an eager absorbed implementation does); `sdpa_expanded` = SDPA on the non-absorbed form, K
[heads, seq, 192] and V [heads, seq, 128] per head already expanded through kv_b_proj (what a
PyTorch user without weight absorption runs; the expansion itself is not timed). Bytes and FLOPs
are counted as bench_mla counts them (latent bytes once; 2 * rows * seq_len * (576 + 512)), so
the times compare directly.
"""
import argparse
import json
import math

import torch

ENTRY, LATENT = 576, 512
QK_HEAD, V_HEAD = 192, 128  # DeepSeek-V3's expanded head sizes (128 nope + 64 rope, 128)


def time_graph(fn, repeats=15):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def point(batch, ctx, heads, q_len, l2):
    seq = ctx + q_len
    kv_bytes = batch * seq * ENTRY * 2
    flops = 2.0 * batch * heads * q_len * seq * (ENTRY + LATENT)
    rot = max(1, min(16, math.ceil(4 * l2 / kv_bytes)))
    q = torch.randn(batch, heads, q_len, ENTRY, device="cuda", dtype=torch.bfloat16)
    ks = [torch.randn(batch, 1, seq, ENTRY, device="cuda", dtype=torch.bfloat16) for _ in range(rot)]
    scale = 1.0 / math.sqrt(192.0)
    # Causal offset for q_len > 1: token i sees seq - q_len + i + 1 keys.
    mask = None
    if q_len > 1:
        pos = torch.arange(seq, device="cuda")
        mask = pos[None, :] <= (seq - q_len + torch.arange(q_len, device="cuda"))[:, None]

    def sdpa():
        for k in ks:
            kk = k.expand(batch, heads, seq, ENTRY)
            torch.nn.functional.scaled_dot_product_attention(
                q, kk, kk[..., :LATENT], attn_mask=mask, scale=scale)

    # The expanded form: one buffer (it is heads x 320 / 576 times the latent bytes).
    q_x = torch.randn(batch, heads, q_len, QK_HEAD, device="cuda", dtype=torch.bfloat16)
    k_x = torch.randn(batch, heads, seq, QK_HEAD, device="cuda", dtype=torch.bfloat16)
    v_x = torch.randn(batch, heads, seq, V_HEAD, device="cuda", dtype=torch.bfloat16)

    def sdpa_expanded():
        torch.nn.functional.scaled_dot_product_attention(q_x, k_x, v_x, attn_mask=mask, scale=scale)

    def bmm():
        for k in ks:
            s = torch.matmul(q.view(batch, heads * q_len, ENTRY), k[:, 0].transpose(1, 2)).float()
            s = s * scale
            if mask is not None:
                s = s.view(batch, heads, q_len, seq).masked_fill(~mask, float("-inf")).view(
                    batch, heads * q_len, seq)
            p = torch.softmax(s, dim=-1).to(torch.bfloat16)
            torch.matmul(p, k[:, 0, :, :LATENT])

    out = {"batch": batch, "context": ctx, "num_heads": heads, "q_len": q_len}
    for name, fn, per in (("sdpa", sdpa, rot), ("bmm", bmm, rot),
                          ("sdpa_expanded", sdpa_expanded, 1)):
        try:
            ms = time_graph(fn) / per
            out[name] = {"us": ms * 1e3, "gbps": kv_bytes / (ms * 1e-3) / 1e9,
                         "tflops": flops / (ms * 1e-3) / 1e12}
        except RuntimeError as e:  # out of memory or no kernel: say so, keep going
            out[name] = {"error": str(e).splitlines()[0]}
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="peers_mla.json")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    pts = [(64, 8192, 16, 1)] if a.quick else [
        (64, 4096, 16, 1), (64, 8192, 16, 1), (64, 16384, 16, 1), (128, 4096, 16, 1),
        (128, 8192, 16, 1), (64, 4096, 128, 1), (64, 4096, 16, 4)]
    res = []
    for b, c, h, ql in pts:
        r = point(b, c, h, ql, l2)
        res.append(r)
        line = f"b{b} ctx{c} h{h} q{ql}"
        for name in ("sdpa", "bmm", "sdpa_expanded"):
            x = r[name]
            line += (f"  {name} {x['us']:.1f} us {x['gbps']:.0f} GB/s {x['tflops']:.1f} TF/s"
                     if "us" in x else f"  {name} error: {x['error'][:60]}")
        print(line, flush=True)
    with open(a.out, "w") as f:
        json.dump({"gpu": props.name, "torch": torch.__version__, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
