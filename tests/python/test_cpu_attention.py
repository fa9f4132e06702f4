"""The CPU backend through the Python API against the numpy reference, over a grid of layer
shapes, cache types and layouts, masks and batch mixes (CI: numpy only)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pagedattn as pa
import reference as R
from helpers import assert_close, cache_floats, fill_context, make_step

BATCHES = {
    "prefill": ([(0, 13), (0, 5)], 0),
    "decode": ([(40, 1), (17, 1), (1, 1), (63, 1)], 0),
    "mixed_padded": ([(0, 9), (33, 1), (20, 6), (0, 0)], 3),  # zero-length request, 3 pad rows
    "chunked_prefix": ([(32, 16), (5, 12), (48, 2)], 1),
}
# (sliding_window, logits_soft_cap, alibi, sinks)
FEATURES = [
    (None, None, False, False),
    (7, None, False, False),
    (None, 30.0, False, False),
    (None, None, True, False),
    (None, None, False, True),
    (1, None, False, True),
    (16, 20.0, True, True),
    (33, None, False, False),
]
HEAD_SIZES = [32, 64, 80, 128]
BLOCK_SIZES = [16, 8, 32]
GRID = []
for n, (dtype, heads, kv_dt, layout) in enumerate(itertools.product(
        ["float32", "float16"], [(4, 4), (8, 2), (6, 1)], ["auto", "fp8_e4m3", "fp8_e5m2"],
        ["NHD", "HND"])):
    batch = list(BATCHES)[n % len(BATCHES)]
    GRID.append(dict(dtype=dtype, heads=heads, kv_cache_dtype=kv_dt, layout=layout,
                     features=FEATURES[n % len(FEATURES)], head_size=HEAD_SIZES[n % 4],
                     block_size=BLOCK_SIZES[n % 3], batch=batch, seed=n))


def _id(c: dict) -> str:
    w, cap, alibi, sinks = c["features"]
    parts = [c["dtype"], f"h{c['heads'][0]}-{c['heads'][1]}", f"d{c['head_size']}",
             f"bs{c['block_size']}", c["kv_cache_dtype"], c["layout"], c["batch"]]
    parts += [f"w{w}"] if w else []
    parts += [f"cap{cap:g}"] if cap else []
    parts += ["alibi"] if alibi else []
    parts += ["sinks"] if sinks else []
    return "-".join(parts)


def _config(c: dict, rng: np.random.Generator, attn_type: str = "decoder") -> pa.AttentionConfig:
    hq, hk = c["heads"]
    window, cap, alibi, sinks = c["features"]
    return pa.AttentionConfig(
        num_heads=hq, head_size=c["head_size"], scale=c["head_size"] ** -0.5, num_kv_heads=hk,
        sliding_window=window, logits_soft_cap=cap,
        alibi_slopes=pa.alibi_slopes(hq) if alibi else None,
        sinks=list(rng.normal(0, 2, hq)) if sinks else None, attn_type=attn_type,
        dtype=c["dtype"], kv_cache_dtype=c["kv_cache_dtype"], kv_cache_layout=c["layout"],
        block_size=c["block_size"])


def _reference(config, q, step, keys_of, attn_type):
    return R.attention_reference(
        q, step.query_start_loc, step.seq_lens, config.scale, keys_of=keys_of,
        attn_type=attn_type, sliding_window=config.sliding_window,
        logits_soft_cap=config.logits_soft_cap,
        alibi_slopes=config.alibi_slopes or None, sinks=config.sinks or None)


@pytest.mark.parametrize("c", GRID, ids=[_id(c) for c in GRID])
def test_decoder_step_matches_reference(c: dict) -> None:
    rng = np.random.default_rng(c["seed"])
    config = _config(c, rng)
    dtype = np.dtype(c["dtype"])
    hq, hk = c["heads"]
    d = c["head_size"]
    fp8 = c["kv_cache_dtype"] != "auto"
    k_scale, v_scale = (0.05, 0.08) if fp8 else (1.0, 1.0)
    requests, pad = BATCHES[c["batch"]]
    step = make_step(rng, requests, c["block_size"], pad_tokens=pad)
    kv = pa.allocate_kv_cache(config, step.num_blocks)
    assert kv.shape == (step.num_blocks, 2, c["block_size"], hk, d)
    assert kv.dtype == (np.uint8 if fp8 else dtype)
    fill_context(rng, step, kv, dtype, c["kv_cache_dtype"], k_scale, v_scale, hk, d)

    t = step.num_tokens
    q = (rng.standard_normal((t, hq, d)) * 2).astype(dtype)
    k = rng.standard_normal((t, hk, d)).astype(dtype)
    v = rng.standard_normal((t, hk, d)).astype(dtype)
    impl = pa.get_impl(config)
    assert impl.backend.name == ("cpu" if pa.with_cpu_backend else "ref")

    # write_kv: bit-exact against the numpy writer (fp8 through the searching encoder).
    expected = kv.copy()
    R.write_kv_reference(k, v, step.slot_mapping, expected[:, 0], expected[:, 1],
                         c["kv_cache_dtype"], k_scale, v_scale)
    impl.write_kv(k, v, step.slot_mapping, kv, k_scale, v_scale)
    np.testing.assert_array_equal(kv, expected)

    md = pa.AttentionMetadata(step.query_start_loc, step.seq_lens, step.block_table,
                              step.slot_mapping)
    assert md.num_actual_tokens == step.num_actual_tokens
    out = np.zeros((t, hq * d), dtype=dtype)
    lse = np.zeros((hq, t), dtype=np.float32)
    impl.forward(q, kv, md, out, lse, k_scale=k_scale, v_scale=v_scale)

    kf, vf = cache_floats(kv, c["kv_cache_dtype"], k_scale, v_scale)
    ref_out, ref_lse = _reference(config, q, step, R.paged_keys(kf, vf, step.block_table,
                                                                step.seq_lens), "decoder")
    t_a = step.num_actual_tokens
    assert_close(out[:t_a].reshape(t_a, hq, d), ref_out, dtype)
    np.testing.assert_allclose(lse[:, :t_a], ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn_type", ["encoder", "encoder_only", "encoder_decoder"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_encoder_types_match_reference(attn_type: str, window, dtype: str) -> None:
    rng = np.random.default_rng(7)
    hq, hk, d, bs = 8, 2, 64, 16
    c = dict(heads=(hq, hk), head_size=d, dtype=dtype, kv_cache_dtype="auto", layout="NHD",
             block_size=bs, features=(window, None, False, attn_type == "encoder_decoder"))
    config = _config(c, rng, attn_type)
    np_dtype = np.dtype(dtype)
    if attn_type == "encoder_decoder":
        # Cross attention: the encoder's K/V are written this step, decoder queries read all.
        step = make_step(rng, [(0, 11), (0, 4), (0, 7)], bs)
    else:
        step = make_step(rng, [(0, 11), (0, 4), (0, 1)], bs)
    t = step.num_tokens
    q = rng.standard_normal((t, hq, d)).astype(np_dtype)
    k = rng.standard_normal((t, hk, d)).astype(np_dtype)
    v = rng.standard_normal((t, hk, d)).astype(np_dtype)
    impl = pa.get_impl(config)
    out = np.zeros((t, hq, d), dtype=np_dtype)
    lse = np.zeros((hq, t), dtype=np.float32)
    if attn_type == "encoder_decoder":
        kv = pa.allocate_kv_cache(config, step.num_blocks)
        impl.write_kv(k, v, step.slot_mapping, kv)
        md = pa.AttentionMetadata(step.query_start_loc, step.seq_lens, step.block_table,
                                  step.slot_mapping, causal=False)
        impl.forward(q, kv, md, out, lse)
        kf, vf = cache_floats(kv, "auto", 1.0, 1.0)
        keys_of = R.paged_keys(kf, vf, step.block_table, step.seq_lens)
    else:
        md = pa.AttentionMetadata(step.query_start_loc, step.seq_lens, causal=False)
        impl.forward(q, None, md, out, lse, key=k, value=v)
        keys_of = R.direct_keys(k, v, step.query_start_loc)
    ref_out, ref_lse = _reference(config, q, step, keys_of, attn_type)
    assert_close(out, ref_out, np_dtype)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_attention_layer_steps_match_reference() -> None:
    """The C++ Attention layer through pagedattn.Attention / ForwardContext: a prefill then a
    decode step on one cache, a KV-sharing consumer, a profiling step."""
    rng = np.random.default_rng(3)
    hq, hk, d, bs = 8, 2, 64, 16
    ctx = pa.ForwardContext()
    cache_config = pa.CacheConfig(cache_dtype="fp8_e4m3", block_size=bs, layout="HND")
    layer = pa.Attention(ctx, hq, d, d ** -0.5, num_kv_heads=hk, cache_config=cache_config,
                         prefix="model.layers.0.self_attn.attn", dtype="float32",
                         per_layer_sliding_window=24, logits_soft_cap=25.0)
    shared = pa.Attention(ctx, hq, d, d ** -0.5, num_kv_heads=hk, cache_config=cache_config,
                          prefix="model.layers.1.self_attn.attn", dtype="float32",
                          per_layer_sliding_window=24, logits_soft_cap=25.0,
                          kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    assert ctx.layer_names() == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert shared.get_kv_cache_spec() is None
    spec = layer.get_kv_cache_spec()
    assert (spec.kind, spec.block_size, spec.dtype, spec.sliding_window) == (
        "sliding_window", bs, "float8_e4m3fn", 24)
    assert "backend=" in layer.extra_repr()
    # The cpu backend takes every head size: nothing is padded.
    assert layer.run_config.head_size == layer.config.head_size == spec.head_size
    layer.load_kv_scales(-1.0, 0.04, 0.06)  # q absent: it follows k, with a warning
    assert (layer.k_scale, layer.v_scale, layer.q_scale) == pytest.approx((0.04, 0.06, 0.04))
    assert any("q_scale" in w for w in layer.warnings)
    # A consumer reads the target's bytes with its own scales (as in vLLM, each layer loads
    # its own): give it the same ones.
    shared.load_kv_scales(-1.0, 0.04, 0.06)
    kv = pa.allocate_kv_cache(layer.config, 12)
    layer.bind_kv_cache([kv])

    builder_steps = [
        pa.MetadataBuilder(bs).add(0, 20, [3, 7]).add(0, 9, [5]).build(),
        pa.MetadataBuilder(bs).add(20, 1, [3, 7]).add(9, 1, [5]).pad_slots_to(4).build(),
    ]
    for n, step in enumerate(builder_steps):
        t = 4 if n == 1 else step.num_actual_tokens
        q = rng.standard_normal((t, hq * d)).astype(np.float32)
        k = rng.standard_normal((t, hk * d)).astype(np.float32)
        v = rng.standard_normal((t, hk * d)).astype(np.float32)
        md = step.metadata()
        with pa.step(ctx, md):
            out = layer(q, k, v)
            out_shared = shared.forward(q, None, None)
        assert out.shape == (t, hq * d)
        kf, vf = cache_floats(kv, "fp8_e4m3", 0.04, 0.06)
        ref_out, _ = R.attention_reference(
            q.reshape(t, hq, d), step.query_start_loc, step.seq_lens, d ** -0.5,
            keys_of=R.paged_keys(kf, vf, step.block_table, step.seq_lens), sliding_window=24,
            logits_soft_cap=25.0)
        t_a = step.num_actual_tokens
        assert_close(out[:t_a].reshape(t_a, hq, d), ref_out, np.float32)
        np.testing.assert_array_equal(out_shared[:t_a], out[:t_a])
        assert not out[t_a:].any()  # the allocating forward zeroes padding rows

    with pa.step(ctx, None):  # profiling run: zero output, no writes
        before = kv.copy()
        out = layer(np.ones((3, hq * d), np.float32), np.ones((3, hk * d), np.float32),
                    np.ones((3, hk * d), np.float32))
        assert not out.any()
        np.testing.assert_array_equal(kv, before)


def test_layer_calculates_kv_scales_on_first_batch() -> None:
    rng = np.random.default_rng(5)
    ctx = pa.ForwardContext()
    layer = pa.Attention(ctx, 4, 32, 32 ** -0.5, num_kv_heads=4, dtype="float32",
                         cache_config=pa.CacheConfig(cache_dtype="fp8", calculate_kv_scales=True),
                         prefix="calib")
    assert layer.calculate_kv_scales
    kv = pa.allocate_kv_cache(layer.config, 4)
    layer.bind_kv_cache(kv)
    step = pa.MetadataBuilder(16).add(0, 5, [1]).build()
    q = rng.standard_normal((5, 128)).astype(np.float32)
    k = rng.standard_normal((5, 128)).astype(np.float32) * 3
    v = rng.standard_normal((5, 128)).astype(np.float32) * 5
    with pa.step(ctx, step.metadata()):
        layer(q, k, v)
    assert not layer.calculate_kv_scales
    assert layer.q_scale == pytest.approx(np.abs(q).max() / 200)
    assert layer.k_scale == pytest.approx(np.abs(k).max() / 200)
    assert layer.v_scale == pytest.approx(np.abs(v).max() / 100)


def test_quantize_query_attends_with_the_e4m3_query() -> None:
    """quantize_query (vLLM's query_quant): the layer's q_scale quantises the query to e4m3; the
    cpu backend refuses it, so the selector explains and takes the next backend (ref here)."""
    rng = np.random.default_rng(6)
    ctx = pa.ForwardContext()
    opts = dict(num_kv_heads=2, dtype="float32", has_checkpoint_kv_scales=True,
                cache_config=pa.CacheConfig(cache_dtype="fp8_e4m3"))
    quant = pa.Attention(ctx, 4, 32, 32 ** -0.5, prefix="q.0", quantize_query=True, **opts)
    plain = pa.Attention(ctx, 4, 32, 32 ** -0.5, prefix="q.1", attn_backend="ref", **opts)
    assert quant.config.query_quant and not plain.config.query_quant
    assert quant.backend.name != "cpu"
    q_scale = 0.0125
    for layer in (quant, plain):
        layer.load_kv_scales(q_scale, 0.25, 0.5)
        layer.bind_kv_cache(pa.allocate_kv_cache(layer.config, 4))
    step = pa.MetadataBuilder(16).add(0, 5, [1]).build()
    q = rng.standard_normal((5, 128)).astype(np.float32)
    k = rng.standard_normal((5, 64)).astype(np.float32)
    v = rng.standard_normal((5, 64)).astype(np.float32)
    q8 = np.clip(q / np.float32(q_scale), -448, 448)
    # e4m3 rounding of |x| in [2^e, 2^(e+1)): steps of 2^(e-3) (normal range; |q8| >= 2^-6 here
    # except for a few near-zero values, whose subnormal step is 2^-9)
    e = np.floor(np.log2(np.maximum(np.abs(q8), 2.0 ** -6)))
    step_ = 2.0 ** (e - 3)
    q8 = (np.round(q8 / step_) * step_).astype(np.float32)  # numpy rounds half to even
    with pa.step(ctx, step.metadata()):
        got = np.asarray(quant(q, k, v))
        want = np.asarray(plain(q8 * np.float32(q_scale), k, v))
        unquantised = np.asarray(plain(q, k, v))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.abs(got - unquantised).max() > 1e-4
