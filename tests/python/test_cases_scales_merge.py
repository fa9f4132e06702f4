"""Case files (round trip, run, check), calc_kv_scales and the merge of partial results
(CI: numpy only)."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn as pa
import reference as R


# --- case files -----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    dict(),
    dict(dtype="float16", kv_cache_dtype="fp8_e4m3", k_scale=0.03, v_scale=0.05, sinks=True),
    dict(dtype="float32", sliding_window=9, logits_soft_cap=30.0, alibi=True, pad_tokens=2),
    dict(attn_type="encoder_only", sliding_window=4, requests=[(0, 6), (0, 3)]),
    dict(attn_type="encoder_decoder", requests=[(0, 1), (0, 1)], cross_kv=False),
], ids=["default", "fp8-sinks", "window-cap-alibi", "encoder_only", "cross-decode"])
def test_case_round_trip_run_and_check(tmp_path, spec: dict) -> None:
    case = pa.make_random_case(seed=11, **spec)
    path = str(tmp_path / "case.safetensors")
    pa.save_case(path, case)
    loaded = pa.load_case(path)
    assert repr(loaded) == repr(case)
    for name in ("query", "key", "value", "kv_cache", "block_table", "seq_lens",
                 "query_start_loc", "slot_mapping"):
        a, b = getattr(case, name), getattr(loaded, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(pa.to_float32(a), pa.to_float32(b), err_msg=name)
    for backend in [None, "ref"]:
        result = pa.run_case(loaded, backend=backend, lse=True)
        check = pa.check_case(loaded, result)
        assert check.passed, str(check)
        assert check.output.got.count > 0
    result_path = str(tmp_path / "result.safetensors")
    pa.save_case_result(result_path, loaded, result, "ref")


def test_case_from_arrays_and_external_result(rng) -> None:
    """A case built from numpy arrays, and a result computed outside run_case (here: by the
    Impl API) checked with the library's accuracy rule; a corrupted output fails."""
    hq, hk, d, bs = 4, 2, 32, 16
    config = pa.AttentionConfig(hq, d, num_kv_heads=hk, dtype="float32", block_size=bs)
    step = pa.MetadataBuilder(bs).add(0, 5, [1]).add(18, 1, [3, 2]).build()
    t = step.num_actual_tokens
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    k = rng.standard_normal((t, hk, d)).astype(np.float32)
    v = rng.standard_normal((t, hk, d)).astype(np.float32)
    kv = pa.allocate_kv_cache(config, 4)
    kv[...] = rng.standard_normal(kv.shape).astype(np.float32)
    case = pa.Case(config, q, k, v, kv, step.block_table, step.seq_lens, step.query_start_loc,
                   step.slot_mapping)
    assert (case.num_seqs, case.num_actual_tokens, case.writes_kv) == (2, t, True)
    impl = pa.get_impl(config)
    kv_after = kv.copy()
    impl.write_kv(k, v, step.slot_mapping, kv_after)
    out = np.zeros((t, hq * d), np.float32)
    impl.forward(q, kv_after, step.metadata(), out)
    assert pa.check_case(case, pa.CaseResult(out, kv_after)).passed
    bad = out.copy()
    bad[1, 3] += 0.01
    check = pa.check_case(case, pa.CaseResult(bad, kv_after))
    assert not check.passed and "FAIL" in str(check)
    kv_bad = kv_after.copy()
    kv_bad[1, 0, 0, 0, 0] += 1
    check = pa.check_case(case, pa.CaseResult(out, kv_bad))
    assert not check.passed and check.kv_cache_mismatches == 1


def test_malformed_case_file(tmp_path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(pa.FormatError, match=str(path)):
        pa.load_case(str(path))
    with pytest.raises(ValueError):
        pa.load_case(str(path))
    with pytest.raises(pa.Error):
        pa.load_case(str(tmp_path / "missing.safetensors"))


# --- calc_kv_scales -------------------------------------------------------------------------


def test_calc_kv_scales(rng, monkeypatch) -> None:
    q = rng.standard_normal((7, 4, 32)).astype(np.float32)
    k = rng.standard_normal((7, 2, 32)).astype(np.float16) * 4
    v = rng.standard_normal((7, 2, 32)).astype(np.float32)[:, :, ::2]  # strided: fine
    s = pa.calc_kv_scales(q, k, v)
    assert not s.all_zero
    assert s.q_scale == pytest.approx(np.abs(q).max() / 200)
    assert s.k_scale == pytest.approx(float(np.abs(k.astype(np.float32)).max()) / 200)
    assert s.v_scale == pytest.approx(np.abs(v).max() / 100)
    assert pa.amax(k) == pytest.approx(float(np.abs(k.astype(np.float32)).max()))
    assert pa.calc_kv_scales(q, k, v, backend="ref").k_scale == pytest.approx(s.k_scale)
    monkeypatch.setenv("PAGEDATTN_K_SCALE_CONSTANT", "50")
    assert pa.calc_kv_scales(q, k, v).k_scale == pytest.approx(s.k_scale * 4)
    monkeypatch.setenv("PAGEDATTN_K_SCALE_CONSTANT", "-1")
    with pytest.raises(pa.InvalidArgument, match="PAGEDATTN_K_SCALE_CONSTANT"):
        pa.calc_kv_scales(q, k, v)
    monkeypatch.delenv("PAGEDATTN_K_SCALE_CONSTANT")
    assert pa.calc_kv_scales(q, np.zeros_like(k), v).all_zero
    q_nan = q.copy()
    q_nan[0, 0, 0] = np.nan
    with pytest.raises(pa.InvalidArgument, match="non-finite"):
        pa.calc_kv_scales(q_nan, k, v)


# --- merge ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [None, "ref"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(1, 4, 32), (39, 8, 64), (17, 16, 128)])
def test_merge_attn_states(backend, dtype: str, shape) -> None:
    rng = np.random.default_rng(sum(shape))
    n, h, d = shape
    np_dtype = np.dtype(dtype)
    po = rng.standard_normal((n, h, d)).astype(np_dtype)
    so = rng.standard_normal((n, h, d)).astype(np_dtype)
    pl = rng.standard_normal((h, n)).astype(np.float32) * 3
    sl = rng.standard_normal((h, n)).astype(np.float32) * 3
    # About 10% +inf per side (never both), and a few -inf, as vLLM's test injects.
    inf_p = rng.random((h, n)) < 0.1
    inf_s = (rng.random((h, n)) < 0.1) & ~inf_p
    pl[inf_p] = np.inf
    sl[inf_s] = np.inf
    sl[0, 0] = -np.inf
    out = np.zeros_like(po)
    out_lse = np.zeros((h, n), np.float32)
    pa.merge_attn_states(out, po, pl, so, sl, out_lse, backend=backend)
    ref_out, ref_lse = R.merge_reference(po, pl, so, sl)
    atol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(out.astype(np.float64), ref_out, atol=atol, rtol=atol)
    np.testing.assert_allclose(out_lse, ref_lse, atol=1e-5, rtol=1e-5)
    # Without output_lse, and both sides -inf: the prefix output is kept.
    pl[:, 0] = -np.inf
    sl[:, 0] = -np.inf
    out2 = np.zeros_like(po)
    pa.merge_attn_states(out2, po, pl, so, sl, backend=backend)
    np.testing.assert_array_equal(out2[0], po[0])


def test_merge_rejects_mismatched_shapes() -> None:
    po = np.zeros((4, 2, 32), np.float32)
    with pytest.raises(pa.InvalidArgument, match="suffix_output must match output"):
        pa.merge_attn_states(np.zeros_like(po), po, np.zeros((2, 4), np.float32),
                             np.zeros((4, 2, 16), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(pa.InvalidArgument, match="prefix_lse must be float32"):
        pa.merge_attn_states(np.zeros_like(po), po, np.zeros((2, 4), np.float16), po,
                             np.zeros((2, 4), np.float32))
