"""The Python API: configs, metadata, caches, backends, array exchange and the exceptions that
bad arguments raise (CI: numpy only)."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn as pa
from dlpack_producer import KDL_CUDA, Producer


def _config(**kw) -> pa.AttentionConfig:
    args = dict(num_heads=8, head_size=64, num_kv_heads=2, dtype="float32")
    args.update(kw)
    return pa.AttentionConfig(**args)


def _step():
    return pa.MetadataBuilder(16).add(0, 5, [1]).add(20, 1, [2, 3]).build()


def _arrays(rng, t=6, hq=8, hk=2, d=64, dtype=np.float32):
    return (rng.standard_normal((t, hq, d)).astype(dtype),
            rng.standard_normal((t, hk, d)).astype(dtype),
            rng.standard_normal((t, hk, d)).astype(dtype))


# --- configs, builder, caches -------------------------------------------------------------


def test_config_defaults_and_fields() -> None:
    c = pa.AttentionConfig(num_heads=8, head_size=64)
    assert c.scale == pytest.approx(0.125)
    assert c.num_kv_heads == 8 and c.dtype == "bfloat16" and c.attn_type == "decoder"
    assert (c.kv_cache_dtype, c.kv_cache_layout, c.block_size) == ("auto", "NHD", 16)
    c.kv_cache_dtype = "fp8"
    assert c.cache_dtype == "float8_e4m3fn"
    c.dtype = "float16"
    c.sliding_window = 128
    c.sliding_window = None
    c.validate()
    assert "num_heads=8" in repr(c)
    assert pa.kv_cache_storage_dtype("auto", "bfloat16") == "bfloat16"
    assert len(pa.alibi_slopes(12)) == 12


def test_builder_metadata_matches_spec_example() -> None:
    # spec 2.4: decode, chunked prefill chunk, prefix-sharing prompt; padded to 32 rows.
    step = (pa.MetadataBuilder(16).add(10, 1, [7]).add(32, 16, [3, 9, 12])
            .add(pa.RequestSpec(32, 8, [3, 9, 5])).pad_slots_to(32).build())
    np.testing.assert_array_equal(step.query_start_loc, [0, 1, 17, 25])
    np.testing.assert_array_equal(step.seq_lens, [11, 48, 40])
    assert (step.num_actual_tokens, step.max_query_len, step.max_seq_len) == (25, 16, 48)
    slots = step.slot_mapping
    assert slots[0] == 122 and list(slots[1:17]) == list(range(192, 208))
    assert list(slots[17:25]) == list(range(80, 88)) and (slots[25:] == -1).all()
    assert step.block_table.shape == (3, 3)
    md = step.metadata()
    assert (md.num_seqs, md.num_actual_tokens, md.device) == (3, 25, "cpu")
    pa.validate_metadata(md, "decoder", num_blocks=16, block_size=16)
    with pytest.raises(pa.InvalidArgument, match="block_table"):
        pa.validate_metadata(md, "decoder", num_blocks=10, block_size=16)


def test_metadata_from_arrays_computes_scalars() -> None:
    md = pa.AttentionMetadata(np.array([0, 3, 4], np.int32), np.array([3, 9], np.int32),
                              np.array([[1], [2]], np.int32), np.array([16, 17, 18, 40]))
    assert (md.num_seqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (2, 4, 3, 9)
    assert md.query_start_loc_cpu is None  # CPU arrays are their own mirrors
    md.max_seq_len = 100
    assert md.max_seq_len == 100


def test_allocate_kv_cache_layouts() -> None:
    nhd = pa.allocate_kv_cache(5, 16, 2, 64, "float16")
    hnd = pa.allocate_kv_cache(5, 16, 2, 64, "float16", layout="HND")
    assert nhd.shape == hnd.shape == (5, 2, 16, 2, 64)
    assert nhd.flags.c_contiguous and not hnd.flags.c_contiguous
    assert hnd.strides[2:] == (64 * 2, 16 * 64 * 2, 2)  # heads outside tokens inside a block
    fp8 = pa.allocate_kv_cache(_config(kv_cache_dtype="fp8_e5m2"), 3)
    assert fp8.dtype == np.uint8 and fp8.shape == (3, 2, 16, 2, 64) and not fp8.any()
    bf16 = pa.allocate_kv_cache(2, 16, 1, 16, "bfloat16")
    assert not isinstance(bf16, np.ndarray) and hasattr(bf16, "__dlpack__")
    assert pa.array_info(bf16) == ("bfloat16", [2, 2, 16, 1, 16], "cpu")


def test_allocate_kv_cache_with_its_own_v_head_size() -> None:
    # No combined [num_blocks, 2, ...] view exists: the pair of views of one storage comes back,
    # and write_kv fills each page at its own head size.
    config = _config(head_size=64)
    config.v_head_size = 32
    key_cache, value_cache = pa.allocate_kv_cache(config, 3)
    assert key_cache.shape == (3, 16, 2, 64) and value_cache.shape == (3, 16, 2, 32)
    rng = np.random.default_rng(4)
    k = rng.standard_normal((2, 2, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, 32)).astype(np.float32)
    pa.write_kv(k, v, np.array([17, 40], np.int64), (key_cache, value_cache))
    np.testing.assert_array_equal(key_cache[1, 1], k[0])
    np.testing.assert_array_equal(value_cache[2, 8], v[1])
    assert np.count_nonzero(value_cache) == v.size and np.count_nonzero(key_cache) == k.size


def test_backends_explain_and_select() -> None:
    names = [b.name for b in pa.list_backends()]
    assert names[-1] == "ref" and ("cpu" in names) == pa.with_cpu_backend
    assert ("cuda" in names) == pa.with_cuda
    # The cpu backend serves every head size up to 576; past it, only ref.
    verdicts = pa.explain(_config(head_size=600))
    by_name = {v.name: v for v in verdicts}
    assert by_name["ref"].supported
    if pa.with_cpu_backend:
        assert not by_name["cpu"].supported
        assert any("head_size 600 is outside 1..576" in r for r in by_name["cpu"].reasons)
        assert pa.select_backend(_config(head_size=600)).name == "ref"
        assert {v.name: v for v in pa.explain(_config(head_size=24))}["cpu"].supported
    table = pa.format_verdicts(verdicts)
    assert "ref" in table
    assert pa.select_backend(_config(), name="ref").name == "ref"
    assert pa.get_backend("ref").check(_config(), "cpu") == []


def test_cast_and_to_float32_round_trip(rng) -> None:
    x = rng.standard_normal(100).astype(np.float32)
    bf16 = pa.cast(x, "bfloat16")
    np.testing.assert_allclose(pa.to_float32(bf16), x, rtol=2 ** -8)
    e4m3 = pa.cast(x * 1000, "float8_e4m3fn")
    assert e4m3.dtype == np.uint8
    assert np.abs(pa.to_float32(e4m3, "float8_e4m3fn")).max() == 448.0  # saturated


# --- array exchange -----------------------------------------------------------------------


def test_any_dlpack_producer_is_read_without_copy(rng) -> None:
    q, k, v = _arrays(rng)
    step = _step()
    kv = pa.allocate_kv_cache(_config(), 4)
    pa.write_kv(Producer(k), Producer(v), Producer(step.slot_mapping), kv)
    np.testing.assert_array_equal(kv[1, 0, :5], k[:5])
    # The cache itself through a producer: written in place.
    kv2 = np.zeros_like(kv)
    pa.write_kv(k, v, step.slot_mapping, Producer(kv2))
    np.testing.assert_array_equal(kv2, kv)
    impl = pa.get_impl(_config())
    out_np = np.zeros((6, 8 * 64), np.float32)
    out_dl = np.zeros((6, 8 * 64), np.float32)
    impl.forward(q, kv, step.metadata(), out_np)
    impl.forward(Producer(q), (Producer(kv[:, 0]), Producer(kv[:, 1])), step.metadata(),
                 Producer(out_dl))
    np.testing.assert_array_equal(out_np, out_dl)


def test_strided_query_and_separate_caches(rng) -> None:
    """Views with row strides (a fused QKV buffer) and vLLM's FA cache layout
    [2, num_blocks, block_size, heads, dim] split into two views."""
    t, hq, hk, d = 6, 8, 2, 64
    qkv = rng.standard_normal((t, (hq + 2 * hk) * d)).astype(np.float32)
    q = qkv[:, :hq * d]
    k = qkv[:, hq * d:(hq + hk) * d]
    v = qkv[:, (hq + hk) * d:]
    step = _step()
    fa_cache = np.zeros((2, 4, 16, hk, d), np.float32)
    pa.write_kv(k, v, step.slot_mapping, (fa_cache[0], fa_cache[1]))
    np.testing.assert_array_equal(fa_cache[0, 1, :5].reshape(5, -1), k[:5])
    impl = pa.get_impl(_config())
    out = np.zeros((t, hq * d), np.float32)
    impl.forward(q, (fa_cache[0], fa_cache[1]), step.metadata(), out)
    out2 = np.zeros_like(out)
    impl.forward(np.ascontiguousarray(q), (fa_cache[0].copy(), fa_cache[1].copy()),
                 step.metadata(), out2)
    np.testing.assert_array_equal(out, out2)


# --- exceptions ---------------------------------------------------------------------------


def test_exception_hierarchy() -> None:
    assert issubclass(pa.InvalidArgument, pa.Error) and issubclass(pa.InvalidArgument, ValueError)
    assert issubclass(pa.FormatError, pa.Error) and issubclass(pa.FormatError, ValueError)
    assert issubclass(pa.NotSupported, pa.Error)
    assert issubclass(pa.NotSupported, NotImplementedError)
    assert issubclass(pa.Error, RuntimeError)


def test_wrong_dtype(rng) -> None:
    q, k, v = _arrays(rng, dtype=np.float16)
    impl = pa.get_impl(_config())
    kv = pa.allocate_kv_cache(_config(), 4)
    with pytest.raises(ValueError, match=r"key must be float32; got float16\[6, 2, 64\]"):
        impl.write_kv(k, v, _step().slot_mapping, kv)
    with pytest.raises(pa.InvalidArgument, match="query must be float32; got float16"):
        impl.forward(q, kv, _step().metadata(), np.zeros((6, 512), np.float32))
    with pytest.raises(pa.InvalidArgument, match="slot_mapping must be int64"):
        impl.write_kv(k.astype(np.float32), v.astype(np.float32),
                      _step().slot_mapping.astype(np.int32), kv)
    with pytest.raises(pa.InvalidArgument, match="bool arrays are not supported"):
        impl.write_kv(np.zeros((6, 2, 64), bool), v, _step().slot_mapping, kv)


def test_wrong_device(rng) -> None:
    q, k, v = _arrays(rng)
    impl = pa.get_impl(_config())
    kv = pa.allocate_kv_cache(_config(), 4)
    fake_cuda_key = Producer(k, device_type=KDL_CUDA)
    with pytest.raises(pa.InvalidArgument, match="key is on cuda:0; expected cpu"):
        impl.write_kv(fake_cuda_key, v, _step().slot_mapping, kv)
    with pytest.raises(pa.InvalidArgument, match="is on cpu; expected cuda:0"):
        impl.forward(Producer(q, device_type=KDL_CUDA), kv, _step().metadata(),
                     np.zeros((6, 512), np.float32))
    with pytest.raises(pa.InvalidArgument, match="device_type 13 is not supported"):
        pa.array_info(Producer(q, device_type=13))
    if pa.device_count("cuda") == 0:
        with pytest.raises(pa.NotSupported, match="cuda"):
            pa.Impl(_config(), "cuda")
    with pytest.raises(pa.InvalidArgument, match="device 'tpu'"):
        pa.Impl(_config(), "tpu")


def test_non_contiguous_where_required(rng) -> None:
    q, k, v = _arrays(rng)
    impl = pa.get_impl(_config())
    kv = pa.allocate_kv_cache(_config(), 4)
    strided = np.zeros((6, 2, 128), np.float32)[:, :, ::2]  # head_size stride 2
    with pytest.raises(pa.InvalidArgument, match="key must be contiguous in its last dimension"):
        impl.write_kv(strided, v, _step().slot_mapping, kv)
    flat = np.zeros((6, 8 * 64 * 2), np.float32)[:, ::2]
    with pytest.raises(pa.InvalidArgument, match="query must be contiguous in its last dim"):
        impl.forward(flat, kv, _step().metadata(), np.zeros((6, 512), np.float32))
    with pytest.raises(pa.InvalidArgument, match="contiguous"):
        impl.forward(q, kv, _step().metadata(), np.zeros((6, 512), np.float32),
                     workspace=np.zeros(4096, np.uint8)[::2])


def test_shape_mismatch(rng) -> None:
    q, k, v = _arrays(rng, hq=4)
    impl = pa.get_impl(_config())
    kv = pa.allocate_kv_cache(_config(), 4)
    with pytest.raises(pa.InvalidArgument,
                       match=r"query must be \[num_tokens, num_heads=8, head_size=64\]"):
        impl.forward(q, kv, _step().metadata(), np.zeros((6, 8, 64), np.float32))
    with pytest.raises(pa.InvalidArgument, match=r"query must be \[num_tokens, 8\*64\]"):
        impl.forward(q.reshape(6, -1), kv, _step().metadata(), np.zeros((6, 8, 64), np.float32))
    small = pa.allocate_kv_cache(5, 8, 2, 64, "float32")
    with pytest.raises(pa.InvalidArgument, match=r"kv_cache.key must be \[num_blocks, "
                                                 r"block_size=16"):
        impl.write_kv(k, v, _step().slot_mapping, small)
    with pytest.raises(pa.InvalidArgument, match="key and value have 3 and 3 rows"):
        impl.write_kv(k[:3], v[:3], _step().slot_mapping, kv)
    with pytest.raises(pa.InvalidArgument, match=r"lse must be \[num_heads=8"):
        impl.forward(np.zeros((6, 8, 64), np.float32), kv, _step().metadata(),
                     np.zeros((6, 8, 64), np.float32), lse=np.zeros((4, 6), np.float32))


def test_strided_metadata_arrays(rng) -> None:
    # A block table that is a view into a wider one (every other column) reads as its strides
    # say; query_start_loc / seq_lens, which every plan reads as plain arrays, must be dense.
    q, k, v = _arrays(rng)
    impl = pa.get_impl(_config())
    kv = pa.allocate_kv_cache(_config(), 4)
    qsl, seq = np.array([0, 5, 6], np.int32), np.array([5, 21], np.int32)
    table = np.array([[1, 0], [2, 3]], np.int32)
    slots = np.array([16, 17, 18, 19, 20, 52])
    impl.write_kv(k, v, slots, kv)
    dense = np.full((6, 8, 64), np.nan, np.float32)
    impl.forward(q, kv, pa.AttentionMetadata(qsl, seq, table, slots), dense)
    wide = np.full((2, 4), -5, np.int32)
    wide[:, ::2] = table
    strided = np.full((6, 8, 64), np.nan, np.float32)
    impl.forward(q, kv, pa.AttentionMetadata(qsl, seq, wide[:, ::2], slots), strided)
    np.testing.assert_array_equal(strided, dense)
    with pytest.raises(pa.InvalidArgument, match="metadata.query_start_loc must be contiguous"):
        spread = np.zeros(6, np.int32)
        spread[::2] = qsl
        impl.forward(q, kv, pa.AttentionMetadata(spread[::2], seq, table, slots), dense)


def test_bad_metadata_and_slots(rng) -> None:
    q, k, v = _arrays(rng)
    impl = pa.get_impl(_config())
    kv = pa.allocate_kv_cache(_config(), 4)
    bad_slots = np.array([16, 17, 99999, 19, 20, 52])
    with pytest.raises(pa.InvalidArgument, match=r"slot_mapping\[2\] \(99999\) is outside"):
        impl.write_kv(k, v, bad_slots, kv)
    md = pa.AttentionMetadata(np.array([0, 5, 6], np.int32), np.array([5, 21], np.int32),
                              np.array([[1, 0], [2, 9]], np.int32),
                              np.array([16, 17, 18, 19, 20, 52]))
    with pytest.raises(pa.InvalidArgument, match=r"block_table\[1\]\[1\] \(9\) is outside"):
        impl.forward(q, kv, md, np.zeros((6, 512), np.float32))
    # (A query longer than its keys is legal, as in FlashAttention; a negative length is not.)
    with pytest.raises(pa.InvalidArgument, match=r"seq_lens\[0\] \(-1\) must be >= 0"):
        md2 = pa.AttentionMetadata(np.array([0, 5, 6], np.int32), np.array([-1, 21], np.int32),
                                   np.array([[1, 0], [2, 3]], np.int32),
                                   np.array([16, 17, 18, 19, 20, 52]))
        impl.forward(q, kv, md2, np.zeros((6, 512), np.float32))
    with pytest.raises(pa.InvalidArgument, match="query_start_loc must be int32"):
        pa.AttentionMetadata(np.array([0, 5, 6]), np.array([5, 21], np.int32))
    with pytest.raises(pa.InvalidArgument, match="num_actual_tokens is required"):
        pa.AttentionMetadata(Producer(np.array([0, 5, 6], np.int32), device_type=KDL_CUDA),
                             Producer(np.array([5, 21], np.int32), device_type=KDL_CUDA))


def test_bad_config_and_names() -> None:
    with pytest.raises(pa.InvalidArgument, match="num_kv_heads"):
        _config(num_heads=16, num_kv_heads=5).validate()
    with pytest.raises(pa.InvalidArgument):
        pa.Impl(_config(num_heads=16, num_kv_heads=5))
    with pytest.raises(ValueError, match="attn_type"):
        _config(attn_type="sideways")
    with pytest.raises(ValueError, match="fp9"):
        _config(kv_cache_dtype="fp9")
    with pytest.raises(ValueError, match="dtype 'float7'"):
        _config(dtype="float7")
    with pytest.raises(pa.InvalidArgument, match="backend 'nope' is not registered"):
        pa.get_backend("nope")
    with pytest.raises(pa.Error, match="nope"):
        pa.Impl(_config(), backend="nope")
    if pa.with_cpu_backend:
        with pytest.raises(pa.NotSupported, match="head_size 600"):
            pa.Impl(_config(head_size=600), backend="cpu")
    ctx = pa.ForwardContext()
    with pytest.raises(pa.InvalidArgument, match="num_heads"):
        pa.Attention(ctx, 16, 64, 0.125, num_kv_heads=5, prefix="x")
    first = pa.Attention(ctx, 8, 64, 0.125, prefix="dup", dtype="float32")
    with pytest.raises(pa.Error, match="Duplicate layer name: dup"):
        pa.Attention(ctx, 8, 64, 0.125, prefix="dup", dtype="float32")
    del first  # unregistered with the layer: the name is free again
    pa.Attention(ctx, 8, 64, 0.125, prefix="dup", dtype="float32")


def test_not_an_array_and_read_only_output(rng) -> None:
    impl = pa.get_impl(_config())
    kv = pa.allocate_kv_cache(_config(), 4)
    with pytest.raises(pa.InvalidArgument, match="key must be an array"):
        impl.write_kv("not an array", np.zeros((6, 2, 64), np.float32), _step().slot_mapping, kv)
    out = np.zeros((6, 512), np.float32)
    out.flags.writeable = False
    q, _, _ = _arrays(rng)
    with pytest.raises(pa.InvalidArgument, match="output must be a writable array"):
        impl.forward(q, kv, _step().metadata(), out)
    with pytest.raises(pa.InvalidArgument, match="kv_cache must be one"):
        impl.forward(q, (kv[:, 0],), _step().metadata(), np.zeros((6, 512), np.float32))
