"""pagedattn.torch: the ops (opcheck, torch.compile), the drop-in functions and the Attention
module against the numpy reference, on the CPU and, where present, on CUDA. Skipped without
torch; the CUDA-graph test needs a GPU."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from conftest import HAS_CUDA, HAS_TORCH

if not HAS_TORCH:
    pytest.skip("needs torch", allow_module_level=True)

import torch  # noqa: E402

import pagedattn as pa  # noqa: E402
import pagedattn.torch as pt  # noqa: E402
import reference as R  # noqa: E402
from torch_helpers import (  # noqa: E402
    TOLERANCE, assert_close_torch, make_torch_step, reference_for)

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DTYPES = ["float32", "bfloat16"] + (["float16"] if HAS_CUDA else [])


def _varlen(s, **kw):
    return pt.flash_attn_varlen_func(
        s.q, s.key_cache, s.value_cache, s.max_seqlen_q, s.cu_seqlens_q, s.max_seqlen_k,
        seqused_k=s.seqused_k, block_table=s.block_table, **kw)


def _check_served(q, kv_cache_dtype: str, head_size: int) -> None:
    """Raises NotSupported (with the reasons) when no backend serves this layer shape."""
    config = pa.AttentionConfig(q.shape[1], head_size, num_kv_heads=2,
                                dtype=str(q.dtype).replace("torch.", ""),
                                kv_cache_dtype=kv_cache_dtype)
    pa.select_backend(config, "cuda" if q.is_cuda else "cpu")


# --- ops ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    s = make_torch_step([(0, 5), (20, 1)], num_heads=8, num_kv_heads=2, head_size=64,
                        dtype="bfloat16", device=device)
    kc, vc = s.key_cache.clone(), s.value_cache.clone()
    torch.library.opcheck(torch.ops.pagedattn.write_kv.default,
                          (s.k, s.v, kc, vc, s.slot_mapping, "auto", 1.0, 1.0))
    out = torch.empty_like(s.q)
    lse = torch.empty(8, s.q.shape[0], dtype=torch.float32, device=device)
    torch.library.opcheck(
        torch.ops.pagedattn.attention.default,
        (s.q, None, None, kc, vc, s.cu_seqlens_q, s.seqused_k, s.block_table, out, lse,
         s.max_seqlen_q, s.max_seqlen_k, -1, "decoder", 0.125, 0, 0.0, None, None, "auto", 1.0,
         1.0, None, None, ""))
    po, so = torch.randn(2, 6, 8, 64, device=device, dtype=torch.bfloat16)
    pl, sl = torch.randn(2, 8, 6, device=device)
    torch.library.opcheck(torch.ops.pagedattn.merge_attn_states.default,
                          (torch.empty_like(po), po, pl, so, sl, torch.empty_like(pl)))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_matches_eager(device: str) -> None:
    s = make_torch_step([(0, 7), (30, 1), (12, 3)], num_heads=8, num_kv_heads=2, head_size=64,
                        dtype="bfloat16", device=device, seed=2)

    def step(q, k, v, key_cache, value_cache, slot_mapping, cu_q, seq_k, block_table):
        pt.reshape_and_cache_flash(k, v, key_cache, value_cache, slot_mapping, "auto", 1.0, 1.0)
        out = pt.flash_attn_varlen_func(
            q * 2, key_cache, value_cache, s.max_seqlen_q, cu_q, s.max_seqlen_k,
            seqused_k=seq_k, causal=True, window_size=(15, 0), softcap=30.0,
            block_table=block_table)
        return out.float().sum(-1)

    args = lambda kv: (s.q, s.k, s.v, kv[:, 0], kv[:, 1], s.slot_mapping, s.cu_seqlens_q,  # noqa
                       s.seqused_k, s.block_table)
    kv_eager = s.kv.clone()
    eager = step(*args(kv_eager))
    backends = ["aot_eager"]
    if device == "cuda" and importlib.util.find_spec("triton") is not None:
        backends.append("inductor")
    for backend in backends:
        torch._dynamo.reset()
        kv_compiled = s.kv.clone()
        compiled = torch.compile(step, fullgraph=True, backend=backend)(*args(kv_compiled))
        torch.testing.assert_close(compiled, eager)
        torch.testing.assert_close(kv_compiled, kv_eager)


# --- drop-in functions against the reference ------------------------------------------------

FEATURES = [
    dict(),
    dict(window=17),
    dict(softcap=30.0),
    dict(alibi=True),
    dict(sinks=True),
    dict(window=8, softcap=20.0, sinks=True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("feat", range(len(FEATURES)))
def test_flash_attn_varlen_paged(device, dtype, kv_cache_dtype, layout, feat) -> None:
    f = FEATURES[feat]
    hq, hk, d = 8, 2, 64
    fp8 = kv_cache_dtype != "auto"
    s = make_torch_step([(0, 9), (33, 1), (20, 6), (47, 1)], num_heads=hq, num_kv_heads=hk,
                        head_size=d, dtype=dtype, kv_cache_dtype=kv_cache_dtype, layout=layout,
                        device=device, seed=feat, k_scale=0.05 if fp8 else 1.0,
                        v_scale=0.07 if fp8 else 1.0)
    pt.reshape_and_cache_flash(s.k, s.v, s.key_cache, s.value_cache, s.slot_mapping,
                               kv_cache_dtype, s.k_scale, torch.tensor(s.v_scale))
    alibi = pa.alibi_slopes(hq) if f.get("alibi") else None
    sinks = list(np.random.default_rng(feat).normal(0, 2, hq)) if f.get("sinks") else None
    window = f.get("window")
    try:
        _check_served(s.q, kv_cache_dtype, d)
    except pa.NotSupported as e:  # listed with the backend's own reason
        pytest.skip(f"{device} backend refuses: {e}")
    out, lse = _varlen(s, softmax_scale=d ** -0.5, causal=True,
                       window_size=(window - 1, 0) if window else None,
                       softcap=f.get("softcap", 0.0),
                       alibi_slopes=torch.tensor(alibi) if alibi else None,
                       s_aux=torch.tensor(sinks) if sinks else None, return_softmax_lse=True,
                       k_descale=s.k_scale, v_descale=s.v_scale)
    ref_out, ref_lse = reference_for(s, d ** -0.5, sliding_window=window,
                                     softcap=f.get("softcap"), alibi_slopes=alibi, sinks=sinks)
    atol, rtol = TOLERANCE[s.q.dtype]
    t_a = s.num_actual_tokens
    assert_close_torch(out[:t_a], ref_out, atol, rtol)
    assert_close_torch(lse[:, :t_a], ref_lse, 1e-3, 1e-3, "lse")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_varlen_packed_kv(device: str, causal: bool) -> None:
    """Without a block table: packed K/V delimited by cu_seqlens_k (bottom-right causal)."""
    gen = torch.Generator().manual_seed(4)
    q_lens, k_lens = [3, 1, 6], [9, 4, 6]
    hq, hk, d = 4, 4, 32
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(device)
    k = torch.randn(sum(k_lens), hk, d, generator=gen).to(device)
    v = torch.randn(sum(k_lens), hk, d, generator=gen).to(device)
    cu_q = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.cumsum([0] + k_lens), dtype=torch.int32, device=device)
    out = pt.flash_attn_varlen_func(q, k, v, max(q_lens), cu_q, max(k_lens), cu_seqlens_k=cu_k,
                                    causal=causal)
    kn, vn = k.double().cpu().numpy(), v.double().cpu().numpy()
    cuk = cu_k.cpu().numpy()
    ref, _ = R.attention_reference(
        q.double().cpu().numpy(), cu_q.cpu().numpy(), k_lens, d ** -0.5,
        keys_of=lambda r: (kn[cuk[r]:cuk[r + 1]], vn[cuk[r]:cuk[r + 1]]),
        attn_type="decoder" if causal else "encoder_decoder")
    assert_close_torch(out, ref, *TOLERANCE[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_reshape_and_cache_flash_bytes(device, kv_cache_dtype, layout) -> None:
    """The written bytes equal the numpy writer's (fp8 through the searching encoder), with a
    uint8 cache for fp8 as vLLM allocates it; slots -1 skipped; key may have extra rows."""
    gen = torch.Generator().manual_seed(9)
    nb, bs, hk, d, n = 6, 16, 2, 64, 21
    fp8 = kv_cache_dtype != "auto"
    kv = pt.allocate_kv_cache(nb, bs, hk, d, torch.uint8 if fp8 else torch.bfloat16,
                              device=device, layout=layout)
    key = torch.randn(n + 3, hk, d, generator=gen).to(torch.bfloat16).to(device)
    value = torch.randn(n + 3, hk, d, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.from_numpy(np.random.default_rng(9).permutation(nb * bs)[:n]).to(device)
    slots[3] = -1
    k_scale = float(key.float().abs().max() / 64) if fp8 else 1.0
    v_scale = float(value.float().abs().max() / 64) if fp8 else 1.0
    pt.reshape_and_cache_flash(key, value, kv[:, 0], kv[:, 1], slots, kv_cache_dtype,
                               torch.tensor([k_scale], device=device), v_scale)
    expect = np.zeros((nb, 2, bs, hk, d), np.uint8 if fp8 else np.float32)
    R.write_kv_reference(key.float().cpu().numpy(), value.float().cpu().numpy(),
                         slots.cpu().numpy(), expect[:, 0], expect[:, 1], kv_cache_dtype,
                         k_scale, v_scale)
    got = kv.cpu().numpy() if fp8 else kv.float().cpu().numpy()
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("device", DEVICES)
def test_scale_tensors_of_differing_values_are_served_or_refused(device: str) -> None:
    """A scale tensor of one value in every element (vLLM's expanded per-tensor scale) is that
    value; one of differing values is served per head (tests/python/test_head_scales.py) where
    the backend can, and refused with its reason where not (never read as its first element):
    the cuda attention kernels take one scale per call."""
    s = make_torch_step([(0, 5), (20, 1)], num_heads=8, num_kv_heads=2, head_size=64,
                        dtype="bfloat16", kv_cache_dtype="fp8_e4m3", device=device)
    kc, vc = s.key_cache.clone(), s.value_cache.clone()
    same = torch.full((2,), 0.5, device=device)
    pt.reshape_and_cache_flash(s.k, s.v, kc, vc, s.slot_mapping, "fp8_e4m3", same, same)
    per_head = torch.tensor([0.5, 0.25], device=device)
    pt.reshape_and_cache_flash(s.k, s.v, kc, vc, s.slot_mapping, "fp8_e4m3", per_head, same)
    differing = torch.tensor([[0.5, 0.5], [0.5, 0.25]], device=device)
    if device == "cuda":
        with pytest.raises(pa.NotSupported, match="v_scales hold different values"):
            _varlen(s, k_descale=same.reshape(1, 2).expand(2, 2), v_descale=differing)
    else:
        _varlen(s, k_descale=same.reshape(1, 2).expand(2, 2), v_descale=differing)
    with pytest.raises(pa.InvalidArgument, match="k_descale must be a number"):
        _varlen(s, k_descale=torch.ones(2, 2, 2, device=device) * per_head)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_attn_states_torch(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    n, h, d = 39, 8, 128
    po, so = (torch.randn(n, h, d, generator=gen).to(torch.bfloat16).to(device) for _ in "ab")
    pl, sl = (torch.randn(h, n, generator=gen).to(device) for _ in "ab")
    pl[0, :5] = float("inf")
    out, out_lse = torch.empty_like(po), torch.empty_like(pl)
    pt.merge_attn_states(out, po, pl, so, sl, out_lse)
    ref, ref_lse = R.merge_reference(po.float().cpu().numpy(), pl.cpu().numpy(),
                                     so.float().cpu().numpy(), sl.cpu().numpy())
    assert_close_torch(out, ref, 1e-2, 1e-2)
    assert_close_torch(out_lse, ref_lse, 1e-5, 1e-5, "lse")


# --- the module -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_attention_module_prefill_decode_sharing(device: str) -> None:
    hq, hk, d, bs = 8, 2, 64, 16
    ctx = pt.ForwardContext()
    mk = lambda prefix, **kw: pt.Attention(  # noqa: E731
        hq, d, d ** -0.5, num_kv_heads=hk, prefix=prefix, dtype=torch.bfloat16, device=device,
        cache_config=pa.CacheConfig(block_size=bs), per_layer_sliding_window=20, context=ctx, **kw)
    layer = mk("model.layers.0.attn")
    consumer = mk("model.layers.1.attn", kv_sharing_target_layer_name="model.layers.0.attn")
    assert "backend=" in layer.extra_repr()
    assert consumer.get_kv_cache_spec() is None
    kv = pt.allocate_kv_cache(10, bs, hk, d, torch.bfloat16, device=device)
    layer.bind_kv_cache([kv])
    gen = torch.Generator().manual_seed(0)
    steps = [pa.MetadataBuilder(bs).add(0, 21, [4, 7]).add(0, 3, [2]).build(),
             pa.MetadataBuilder(bs).add(21, 1, [4, 7]).add(3, 1, [2]).pad_slots_to(3).build()]
    for n, step in enumerate(steps):
        md = pt.AttentionMetadata.from_step(step, device)
        t = 3 if n == 1 else step.num_actual_tokens
        q, k, v = (torch.randn(t, h * d, generator=gen).to(torch.bfloat16).to(device)
                   for h in (hq, hk, hk))
        with pt.set_forward_context(md, context=ctx):
            out = layer(q, k, v)
            out_consumer = consumer(q, None, None)
        t_a = step.num_actual_tokens
        kf = kv[:, 0].double().cpu().numpy()
        vf = kv[:, 1].double().cpu().numpy()
        ref, _ = R.attention_reference(
            q.view(t, hq, d).double().cpu().numpy(), step.query_start_loc, step.seq_lens,
            d ** -0.5, keys_of=R.paged_keys(kf, vf, step.block_table, step.seq_lens),
            sliding_window=20)
        assert_close_torch(out[:t_a].view(t_a, hq, d), ref, *TOLERANCE[torch.bfloat16])
        torch.testing.assert_close(out_consumer[:t_a], out[:t_a])
    with pt.set_forward_context(None, context=ctx):  # profiling run
        assert not layer(q, k, v).any()
    with pytest.raises(RuntimeError, match="no forward context"):
        layer(q, k, v)


def test_module_bad_arguments() -> None:
    ctx = pt.ForwardContext()
    with pytest.raises(pa.InvalidArgument, match="num_heads"):
        pt.Attention(16, 64, 0.125, num_kv_heads=5, prefix="a", context=ctx, device="cpu")
    keep = pt.Attention(8, 64, 0.125, prefix="b", context=ctx, device="cpu")
    with pytest.raises(pa.Error, match="b"):
        pt.Attention(8, 64, 0.125, prefix="b", context=ctx, device="cpu")
    with pytest.raises(pa.InvalidArgument, match="target"):
        pt.Attention(8, 64, 0.125, prefix="c", context=ctx, device="cpu",
                     kv_sharing_target_layer_name="model.layers.9.x")
    del keep
    q = torch.randn(4, 8, 64)
    with pytest.raises(pa.NotSupported, match="dropout"):
        pt.flash_attn_varlen_func(q.detach(), q.detach(), q.detach(), 4, torch.tensor([0, 4]), 4,
                                  dropout_p=0.1)
    with pytest.raises(pa.NotSupported, match="window_size"):
        pt.flash_attn_varlen_func(q.detach(), q.detach(), q.detach(), 4,
                                  torch.tensor([0, 4], dtype=torch.int32), 4,
                                  cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32),
                                  window_size=(3, 3), causal=True)
    with pytest.raises(pa.NotSupported, match="alibi_slopes with causal=False"):
        pt.flash_attn_varlen_func(q.detach(), q.detach(), q.detach(), 4,
                                  torch.tensor([0, 4], dtype=torch.int32), 4,
                                  cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32),
                                  alibi_slopes=[0.5] * 8)


def test_module_quantize_query_reaches_the_op() -> None:
    """pt.Attention(quantize_query=True) runs the op with query_quant and the layer's q_scale
    (the selector takes ref on the CPU): its output is the plain layer's on the e4m3 query."""
    ctx = pt.ForwardContext()
    opts = dict(num_kv_heads=2, dtype=torch.float32, device="cpu", context=ctx,
                has_checkpoint_kv_scales=True,
                cache_config=pa.CacheConfig(cache_dtype="fp8_e4m3"))
    quant = pt.Attention(4, 32, 32 ** -0.5, prefix="qq.0", quantize_query=True, **opts)
    plain = pt.Attention(4, 32, 32 ** -0.5, prefix="qq.1", attn_backend="ref", **opts)
    q_scale = 0.0125
    for layer in (quant, plain):
        layer.load_kv_scales(q_scale, 0.25, 0.5)
        layer.bind_kv_cache([pt.allocate_kv_cache(4, 16, 2, 32, torch.uint8)])
    md = pt.AttentionMetadata.from_step(pa.MetadataBuilder(16).add(0, 5, [1]).build(), "cpu")
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(5, h * 32, generator=gen) for h in (4, 2, 2))
    q8 = (q / q_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * q_scale
    with pt.set_forward_context(md, context=ctx):
        got = quant(q, k, v)
        want = plain(q8, k, v)
        unquantised = plain(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got - unquantised).abs().max() > 1e-4


# --- CUDA graphs ----------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
@pytest.mark.parametrize("with_host_mirrors", [False, True])
def test_decode_step_in_cuda_graph(with_host_mirrors: bool) -> None:
    """A decode step (write_kv + attention through the module) captured in a CUDA graph and
    replayed on new inputs and new (in-place updated) metadata matches eager runs."""
    hq, hk, d, bs, batch = 32, 8, 128, 16, 8
    ctx = pt.ForwardContext()
    layer = pt.Attention(hq, d, d ** -0.5, num_kv_heads=hk, prefix="graph.attn",
                         dtype=torch.bfloat16, device="cuda", context=ctx)
    kv = pt.allocate_kv_cache(batch * 40 + 1, bs, hk, d, torch.bfloat16, device="cuda")
    kv.normal_()
    layer.bind_kv_cache([kv])

    def metadata(lens):
        b = pa.MetadataBuilder(bs)
        for r, n in enumerate(lens):
            b.add(n - 1, 1, list(range(1 + r * 40, 1 + r * 40 + 40)))
        return b.max_seq_len_at_least(40 * bs).build()

    first = pt.AttentionMetadata.from_step(metadata([100 + 37 * r for r in range(batch)]), "cuda")
    if not with_host_mirrors:
        first.query_start_loc_cpu = first.seq_lens_cpu = None
    static = [torch.randn(batch, h * d, device="cuda", dtype=torch.bfloat16)
              for h in (hq, hk, hk)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), pt.set_forward_context(first, context=ctx):
        for _ in range(2):  # warm up: impls are built outside the capture
            layer(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), pt.set_forward_context(first, context=ctx):
        static_out = layer(*static)

    for lens in ([200 + 11 * r for r in range(batch)], [5 + r for r in range(batch)]):
        nxt = metadata(lens)
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            getattr(first, name).copy_(torch.from_numpy(getattr(nxt, name)))
        for x in static:
            x.normal_()
        kv_before = kv.clone()
        graph.replay()
        torch.cuda.synchronize()
        replayed = static_out.clone()
        kv_graph = kv.clone()
        kv.copy_(kv_before)
        with pt.set_forward_context(pt.AttentionMetadata.from_step(nxt, "cuda"), context=ctx):
            eager = layer(*static)
        torch.testing.assert_close(kv_graph, kv)
        torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=1e-2)
