"""Per-head fp8 scales (issue 39 item 2): pagedattn.write_kv and reshape_and_cache_flash with
k/v scales of [num_kv_heads] write each head as a per-tensor write with that head's scale
would; flash_attn_varlen_func with [batch, num_kv_heads] descales of differing values gives,
for request r and KV head h, the rows a per-tensor call with descale [r, h] gives (cpu, ref);
the layer loads per-head scales. Torch parts skip without torch."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn as pa
from conftest import HAS_CUDA, HAS_TORCH


def _fp8_write(key, value, slots, hk, d, scales_k, scales_v, dtype="fp8_e4m3"):
    cache = pa.allocate_kv_cache(4, 16, hk, d, "uint8")  # fp8 bytes
    pa.write_kv(key, value, slots, cache, kv_cache_dtype=dtype, k_scale=scales_k,
                v_scale=scales_v, backend="cpu")
    return cache


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_write_kv_per_head_equals_per_tensor_writes_head_by_head(rng, dtype) -> None:
    hk, d, n = 3, 32, 11
    key = rng.standard_normal((n, hk, d)).astype(np.float32) * 4
    value = rng.standard_normal((n, hk, d)).astype(np.float32)
    slots = rng.permutation(64)[:n].astype(np.int64)
    slots[2] = -1
    ks, vs = [0.05, 1.3, 0.4], [2.0, 0.011, 0.7]
    got = _fp8_write(key, value, slots, hk, d, np.array(ks, np.float32), vs, dtype)
    for h in range(hk):
        want = _fp8_write(key, value, slots, hk, d, ks[h], vs[h], dtype)
        np.testing.assert_array_equal(np.asarray(got)[..., h, :], np.asarray(want)[..., h, :],
                                      err_msg=f"head {h}")
    zero = _fp8_write(key, value, slots, hk, d, ks[0], vs[0], dtype)
    assert not np.array_equal(np.asarray(got), np.asarray(zero))  # head 0's scale is not all


def test_write_kv_refuses_other_lengths(rng) -> None:
    key = rng.standard_normal((4, 2, 16)).astype(np.float32)
    cache = pa.allocate_kv_cache(2, 16, 2, 16, "uint8")
    slots = np.arange(4, dtype=np.int64)
    with pytest.raises(pa.InvalidArgument, match="scales.k_scales has 3 values"):
        pa.write_kv(key, key, slots, cache, kv_cache_dtype="fp8_e4m3", k_scale=[1, 2, 3])
    with pytest.raises(pa.InvalidArgument, match=r"scales.v_scales\[1\] \(0\) must be"):
        pa.write_kv(key, key, slots, cache, kv_cache_dtype="fp8_e4m3", v_scale=[1.0, 0.0])


def test_layer_loads_per_head_scales() -> None:
    ctx = pa.ForwardContext()
    cc = pa.CacheConfig(cache_dtype="fp8_e4m3")
    layer = pa.Attention(ctx, 4, 16, 0.25, num_kv_heads=2, cache_config=cc, prefix="l0",
                         dtype="float32")
    layer.load_kv_scales([0.5, 0.25], [2.0, 8.0], [3.0, 0.75])
    assert list(layer.k_scales) == [2.0, 8.0]
    assert list(layer.v_scales) == [3.0, 0.75]
    assert list(layer.q_scales) == [0.5, 0.25]
    with pytest.raises(pa.InvalidArgument, match="k_scales has 3 values"):
        layer.load_kv_scales([], [1.0, 2.0, 3.0], [])
    layer.load_kv_scales(1.0, 2.0, 3.0)
    assert list(layer.k_scales) == [] and layer.k_scale == 2.0


if HAS_TORCH:
    import torch

    import pagedattn.torch as pt
    from torch_helpers import make_torch_step

    def _varlen(s, **kw):
        return pt.flash_attn_varlen_func(
            s.q, s.key_cache, s.value_cache, s.max_seqlen_q, s.cu_seqlens_q, s.max_seqlen_k,
            seqused_k=s.seqused_k, block_table=s.block_table, **kw)


needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_reshape_and_cache_flash_per_head(device, kv_cache_dtype) -> None:
    """k_scale / v_scale tensors of [num_kv_heads]: head h's bytes are those of a write with
    the float scales of head h (vLLM's per-head reshape_and_cache_flash)."""
    gen = torch.Generator().manual_seed(3)
    nb, bs, hk, d, n = 4, 16, 4, 64, 19
    key = (torch.randn(n, hk, d, generator=gen) * 3).to(torch.bfloat16).to(device)
    value = torch.randn(n, hk, d, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.randperm(nb * bs, generator=gen)[:n].to(device)
    slots[5] = -1
    ks, vs = [0.02, 0.3, 1.7, 0.09], [1.1, 0.013, 0.5, 3.0]

    def write(k_scale, v_scale):
        kv = pt.allocate_kv_cache(nb, bs, hk, d, torch.uint8, device=device)
        pt.reshape_and_cache_flash(key, value, kv[:, 0], kv[:, 1], slots, kv_cache_dtype,
                                   k_scale, v_scale)
        return kv.cpu()

    got = write(torch.tensor(ks, device=device), torch.tensor(vs, device=device))
    for h in range(hk):
        want = write(ks[h], vs[h])
        assert torch.equal(got[..., h, :], want[..., h, :]), f"head {h}"


@needs_torch
@pytest.mark.parametrize("backend", ["cpu", "ref"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_varlen_descales_per_request_and_head(backend, kv_cache_dtype) -> None:
    """Descales [batch, num_kv_heads] of differing values: request r's rows of the query heads
    of KV head h equal those of a call with the one descale [r, h]."""
    hq, hk, d = 8, 2, 64
    reqs = [(0, 9), (33, 1), (20, 6)]
    s = make_torch_step(reqs, num_heads=hq, num_kv_heads=hk, head_size=d, dtype="float32",
                        kv_cache_dtype=kv_cache_dtype, device="cpu", seed=5, k_scale=0.05,
                        v_scale=0.07)
    pt.reshape_and_cache_flash(s.k, s.v, s.key_cache, s.value_cache, s.slot_mapping,
                               kv_cache_dtype, s.k_scale, s.v_scale)
    kd = torch.tensor([[0.05, 0.11], [0.02, 0.05], [0.3, 0.01]])
    vd = torch.tensor([[0.07, 0.5], [0.9, 0.07], [0.01, 0.2]])
    out = _varlen(s, softmax_scale=d ** -0.5, causal=True, k_descale=kd, v_descale=vd,
                  backend=backend)
    cu = s.cu_seqlens_q.tolist()
    g = hq // hk
    for r in range(len(reqs)):
        for h in range(hk):
            one = _varlen(s, softmax_scale=d ** -0.5, causal=True,
                          k_descale=float(kd[r, h]), v_descale=float(vd[r, h]), backend=backend)
            rows, heads = slice(cu[r], cu[r + 1]), slice(h * g, (h + 1) * g)
            torch.testing.assert_close(out[rows, heads], one[rows, heads], rtol=1e-6, atol=1e-6,
                                       msg=f"request {r} head {h}")
    # Row 0 of the descales for every request differs: the rows do not come from element 0.
    first = _varlen(s, softmax_scale=d ** -0.5, causal=True, k_descale=kd[0:1].expand(3, 2),
                    v_descale=vd[0:1].expand(3, 2), backend=backend)
    assert not torch.allclose(out, first)


@needs_torch
def test_torch_layer_per_head_scales_serve_each_head_its_own() -> None:
    """pagedattn.torch.Attention with per-head checkpoint scales: KV head h's rows equal those
    of a layer loaded with head h's scales per tensor (cpu backend, float32)."""
    hq, hk, d, bs = 4, 2, 32, 16
    ctx = pt.ForwardContext()
    cc = pa.CacheConfig(block_size=bs, cache_dtype="fp8_e4m3")
    layers, caches = [], []
    for i in range(3):
        layer = pt.Attention(hq, d, d ** -0.5, num_kv_heads=hk, prefix=f"l.{i}",
                             dtype=torch.float32, device="cpu", cache_config=cc, context=ctx)
        kv = pt.allocate_kv_cache(4, bs, hk, d, torch.uint8, device="cpu")
        layer.bind_kv_cache([kv])
        layers.append(layer)
        caches.append(kv)
    layers[0].load_kv_scales(-1.0, torch.tensor([0.3, 3.0]), [0.7, 1.9])
    layers[1].load_kv_scales(-1.0, 0.3, 0.7)
    layers[2].load_kv_scales(-1.0, 3.0, 1.9)
    step = pa.MetadataBuilder(bs).add(0, 7, [2]).add(0, 3, [1]).build()
    md = pt.AttentionMetadata.from_step(step, "cpu")
    gen = torch.Generator().manual_seed(4)
    t = step.num_actual_tokens
    q, k, v = (torch.randn(t, h * d, generator=gen) for h in (hq, hk, hk))
    with pt.set_forward_context(md, context=ctx):
        outs = [layer(q, k, v).view(t, hq, d) for layer in layers]
    g = hq // hk
    torch.testing.assert_close(outs[0][:, :g], outs[1][:, :g], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][:, g:], outs[2][:, g:], rtol=0, atol=0)
    assert not torch.equal(outs[1], outs[2])


def test_case_file_per_head_scales(tmp_path) -> None:
    """Per-head scales round trip through a case file, run on cpu and ref within the accuracy
    rule, and a wrong length is refused on load naming the tensor."""
    case = pa.make_random_case(seed=3, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.5)
    case.k_scales = [0.05, 2.0]
    case.v_scales = [3.0, 0.1]
    path = str(tmp_path / "case.safetensors")
    pa.save_case(path, case)
    loaded = pa.load_case(path)
    np.testing.assert_array_equal(np.float32(loaded.k_scales), np.float32([0.05, 2.0]))
    np.testing.assert_array_equal(np.float32(loaded.v_scales), np.float32([3.0, 0.1]))
    for backend in ["cpu", "ref"]:
        check = pa.check_case(loaded, pa.run_case(loaded, backend=backend, lse=True))
        assert check.passed, str(check)
    case.k_scales = [1.0, 2.0, 3.0]
    pa.save_case(path, case)
    with pytest.raises(pa.FormatError, match=r"tensor 'k_scales' must be float32 \[num_kv_heads=2\]"):
        pa.load_case(path)
