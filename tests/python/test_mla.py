"""pagedattn.MLAAttention from Python: two steps over a float32 latent cache against a numpy
float64 loop of the non-absorbed formulation (K = [kv_c W_UK | k_pe], V = kv_c W_UV), in each
formulation: vLLM's split (decodes absorbed, prefills expanded with the cached context in
chunks), and either one forced for every request."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn as pa

N, P, R, V, L, BS = 4, 16, 16, 8, 48, 16


def _reference(q, kv_c, k_pe, w, scale, positions):
    """q [T, N, P+R] of the step's tokens at `positions` (request, position); kv_c / k_pe per
    request, all positions so far."""
    w = w.reshape(L, N, P + V)
    out = []
    for (r, pos), qt in zip(positions, q):
        kc, kp = kv_c[r][: pos + 1], k_pe[r][: pos + 1]
        row = []
        for h in range(N):
            k_nope = kc @ w[:, h, :P]                     # [pos+1, P]
            logits = (k_nope @ qt[h, :P] + kp @ qt[h, P:]) * scale
            p = np.exp(logits - logits.max())
            p /= p.sum()
            row.append(p @ (kc @ w[:, h, P:]))          # [V]
        out.append(np.concatenate(row))
    return np.array(out)


@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_matches_numpy_over_two_steps(backend) -> None:
    if backend == "cpu" and not pa.with_cpu_backend:
        pytest.skip("this build has no cpu backend")
    rng = np.random.default_rng(11)
    scale = (P + R) ** -0.5
    ctx = pa.ForwardContext()
    w = (rng.standard_normal((L, N * (P + V))) * 0.2).astype(np.float32)
    layer = pa.MLAAttention(ctx, N, scale, P, R, V, None, L, kv_b_proj=w,
                            cache_config=pa.CacheConfig(block_size=BS), attn_backend=backend,
                            dtype="float32")
    assert layer.backend_name == backend
    assert layer.config.head_size == L + R and layer.config.num_kv_heads == 1
    assert layer.get_kv_cache_spec().kind == "mla"
    cache = np.zeros((5, BS, L + R), np.float32)
    layer.bind_kv_cache(cache)
    lens = [19, 6]
    kv_c = [rng.standard_normal((n, L)).astype(np.float32) for n in lens]
    k_pe = [rng.standard_normal((n, R)).astype(np.float32) for n in lens]
    q_all = [rng.standard_normal((n, N, P + R)).astype(np.float32) for n in lens]
    steps = [[(0, 0, 17), (1, 0, 4)], [(0, 17, 2), (1, 4, 2)]]  # (request, start, count)
    blocks = [[1, 2], [3]]
    for step in steps:
        b = pa.MetadataBuilder(BS)
        for r, start, count in step:
            b.add(start, count, blocks[r])
        md = b.build()
        q = np.concatenate([q_all[r][s:s + c] for r, s, c in step])
        kv = np.concatenate([kv_c[r][s:s + c] for r, s, c in step])
        pe = np.concatenate([k_pe[r][s:s + c] for r, s, c in step])
        with pa.step(ctx, md.metadata()):
            out = np.asarray(layer(q, kv, pe))
        positions = [(r, s + i) for r, s, c in step for i in range(c)]
        want = _reference(q.astype(np.float64), [x.astype(np.float64) for x in kv_c],
                          [x.astype(np.float64) for x in k_pe], w.astype(np.float64), scale,
                          positions)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("formulation", ["split", "absorbed", "prefill"])
def test_formulations_match_numpy_on_a_mixed_step(backend, formulation) -> None:
    if backend == "cpu" and not pa.with_cpu_backend:
        pytest.skip("this build has no cpu backend")
    rng = np.random.default_rng(23)
    scale = (P + R) ** -0.5
    ctx = pa.ForwardContext()
    w = (rng.standard_normal((L, N * (P + V))) * 0.2).astype(np.float32)
    # A workspace of 8 latent entries: request 0's 25 cached tokens take several chunks.
    layer = pa.MLAAttention(ctx, N, scale, P, R, V, None, L, kv_b_proj=w,
                            cache_config=pa.CacheConfig(block_size=BS), attn_backend=backend,
                            dtype="float32", formulation=formulation, context_chunk_tokens=8)
    assert layer.formulation == formulation
    cache = np.zeros((5, BS, L + R), np.float32)
    layer.bind_kv_cache(cache)
    lens = [30, 12, 9]
    kv_c = [rng.standard_normal((n, L)).astype(np.float32) for n in lens]
    k_pe = [rng.standard_normal((n, R)).astype(np.float32) for n in lens]
    q_all = [rng.standard_normal((n, N, P + R)).astype(np.float32) for n in lens]
    # Step 2: a decode, a chunked prefill over cached context and a fresh prompt.
    steps = [[(0, 0, 25), (1, 0, 11)], [(1, 11, 1), (0, 25, 5), (2, 0, 9)]]
    blocks = [[1, 2], [3], [4]]
    for step in steps:
        b = pa.MetadataBuilder(BS)
        for r, start, count in step:
            b.add(start, count, blocks[r])
        md = b.build()
        q = np.concatenate([q_all[r][s:s + c] for r, s, c in step])
        kv = np.concatenate([kv_c[r][s:s + c] for r, s, c in step])
        pe = np.concatenate([k_pe[r][s:s + c] for r, s, c in step])
        out = np.full((len(q), N * V), np.nan, np.float32)
        with pa.step(ctx, md.metadata()):
            layer(q, kv, pe, out)
        positions = [(r, s + i) for r, s, c in step for i in range(c)]
        want = _reference(q.astype(np.float64), [x.astype(np.float64) for x in kv_c],
                          [x.astype(np.float64) for x in k_pe], w.astype(np.float64), scale,
                          positions)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_rejects_an_unknown_formulation() -> None:
    with pytest.raises(pa.InvalidArgument, match="MLA formulation 'expanded' is not one of"):
        pa.MLAAttention(pa.ForwardContext(), N, 1.0, P, R, V, None, L, dtype="float32",
                        formulation="expanded")
