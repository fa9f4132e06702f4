"""Paged steps as torch tensors for the torch tests, and their numpy reference."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

import reference as R
from helpers import make_step

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8_TORCH = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}


@dataclasses.dataclass
class TorchStep:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new keys
    v: torch.Tensor
    key_cache: torch.Tensor  # [NB, bs, Hkv, D] (a view of kv)
    value_cache: torch.Tensor
    kv: torch.Tensor  # [NB, 2, bs, Hkv, D]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seqused_k: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, W]
    slot_mapping: torch.Tensor  # int64 [T]
    max_seqlen_q: int
    max_seqlen_k: int
    num_actual_tokens: int
    kv_cache_dtype: str
    k_scale: float
    v_scale: float
    requests: List[Tuple[int, int]]


def make_torch_step(
    requests: Sequence[Tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int = 16,
    dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
    layout: str = "NHD",
    device: str = "cpu",
    seed: int = 0,
    pad_tokens: int = 0,
    extra_blocks: int = 3,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> TorchStep:
    """A cache with random context K/V (written by reshape_and_cache_flash) and the step's new
    query/key/value; blocks shuffled, block 0 unused."""
    import pagedattn.torch as pt

    rng = np.random.default_rng(seed)
    step = make_step(rng, requests, block_size, pad_tokens=pad_tokens, spare_blocks=extra_blocks)
    gen = torch.Generator().manual_seed(seed)
    tdt = TORCH_DTYPES[dtype]
    cache_dt = FP8_TORCH.get(kv_cache_dtype, tdt)
    kv = pt.allocate_kv_cache(step.num_blocks, block_size, num_kv_heads, head_size, cache_dt,
                              device=device, layout=layout)
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    ctx_slots = np.concatenate(step.context_slots) if step.context_slots else np.zeros(0)
    if len(ctx_slots):
        n = len(ctx_slots)
        ck = torch.randn(n, num_kv_heads, head_size, generator=gen).to(tdt).to(device)
        cv = torch.randn(n, num_kv_heads, head_size, generator=gen).to(tdt).to(device)
        pt.reshape_and_cache_flash(ck, cv, key_cache, value_cache,
                                   torch.from_numpy(ctx_slots.astype(np.int64)).to(device),
                                   kv_cache_dtype, k_scale, v_scale)
    t = step.num_tokens
    q = torch.randn(t, num_heads, head_size, generator=gen).to(tdt).to(device)
    k = torch.randn(t, num_kv_heads, head_size, generator=gen).to(tdt).to(device)
    v = torch.randn(t, num_kv_heads, head_size, generator=gen).to(tdt).to(device)
    return TorchStep(
        q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache, kv=kv,
        cu_seqlens_q=torch.from_numpy(step.query_start_loc).to(device),
        seqused_k=torch.from_numpy(step.seq_lens).to(device),
        block_table=torch.from_numpy(step.block_table).to(device),
        slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
        max_seqlen_q=max(n for _, n in requests), max_seqlen_k=max(c + n for c, n in requests),
        num_actual_tokens=step.num_actual_tokens, kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale, v_scale=v_scale, requests=list(requests))


def cache_values(cache: torch.Tensor, kv_cache_dtype: str, scale: float) -> np.ndarray:
    """float64 values of a [NB, bs, Hkv, D] cache (fp8 decoded by the reference's table)."""
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or cache.dtype == torch.uint8:
        codes = cache.contiguous().view(torch.uint8).cpu().numpy()
        name = {torch.float8_e5m2: "float8_e5m2"}.get(cache.dtype)
        name = name or R.CACHE_DTYPE_NAME.get(kv_cache_dtype, "float8_e4m3fn")
        return R.fp8_decode(codes, name) * scale
    return cache.double().cpu().numpy()


def reference_for(s: TorchStep, scale: float, *, attn_type: str = "decoder",
                  sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                  alibi_slopes=None, sinks=None):
    """(out [T_a, Hq, D], lse [Hq, T_a]) of the step over the cache as it is now."""
    kf = cache_values(s.key_cache, s.kv_cache_dtype, s.k_scale)
    vf = cache_values(s.value_cache, s.kv_cache_dtype, s.v_scale)
    qsl = s.cu_seqlens_q.cpu().numpy()
    seq_lens = s.seqused_k.cpu().numpy()
    bt = s.block_table.cpu().numpy()
    return R.attention_reference(
        s.q.double().cpu().numpy(), qsl, seq_lens, scale,
        keys_of=R.paged_keys(kf, vf, bt, seq_lens), attn_type=attn_type,
        sliding_window=sliding_window, logits_soft_cap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks)


def assert_close_torch(got: torch.Tensor, ref: np.ndarray, atol: float, rtol: float,
                       what: str = "output") -> None:
    g = got.double().cpu().numpy()
    err = np.abs(g - ref)
    bad = ~(err <= atol + rtol * np.abs(ref))
    if bad.any():
        idx = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.size} off; first {idx}: got "
                             f"{g[idx]}, ref {ref[idx]}; max err {np.nanmax(err)}")


TOLERANCE = {torch.float32: (2e-4, 2e-4), torch.float16: (4e-3, 4e-3),
             torch.bfloat16: (1.5e-2, 1e-2)}
