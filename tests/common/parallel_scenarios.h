// Scenarios for the tensor- and decode-context-parallel tests, shared by the in-process unit
// tests and the MPI test (one scenario, computed whole or by one rank).
#pragma once

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/parallel.h"

namespace pagedattn::test {

inline Tensor random_f32(const std::vector<int64_t>& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  std::normal_distribution<float> dist;
  for (int64_t i = 0; i < t.view().numel(); ++i) static_cast<float*>(t.data())[i] = dist(rng);
  return t;
}

// ---- tensor parallelism: two steps (a prefill of two requests, then a decode and a chunk) ----

struct TpScenario {
  AttentionOptions options;
  std::vector<StepMetadata> md;
  std::vector<Tensor> q, k, v;  // [T, H*D] per step
};

inline TpScenario make_tp_scenario(int hq, int hk, bool alibi, bool sinks, uint32_t seed) {
  std::mt19937 rng(seed);
  TpScenario s;
  const int d = 32;
  s.options.num_heads = hq;
  s.options.num_kv_heads = hk;
  s.options.head_size = d;
  s.options.scale = 0.2f;
  s.options.dtype = DType::kF32;
  s.options.prefix = "model.layers.0.attn";
  if (alibi) s.options.alibi_slopes = alibi_slopes(hq);
  for (int h = 0; sinks && h < hq; ++h) s.options.sinks.push_back(0.3f * float(h) - 1.0f);
  s.md.push_back(MetadataBuilder(16).add({0, 20, {1, 2}}).add({0, 9, {3}}).build());
  s.md.push_back(MetadataBuilder(16).add({20, 1, {1, 2}}).add({9, 5, {3}}).build());
  for (const StepMetadata& m : s.md) {
    const int64_t t = m.view().num_actual_tokens;
    s.q.push_back(random_f32({t, int64_t(hq) * d}, rng));
    s.k.push_back(random_f32({t, int64_t(hk) * d}, rng));
    s.v.push_back(random_f32({t, int64_t(hk) * d}, rng));
  }
  return s;
}

// Runs the scenario's steps through one layer: the whole layer (shard == nullptr), or one
// rank's shard writing its columns of `outputs` (which must hold [T, H*D] per step).
inline void run_tp(const TpScenario& s, const std::string& backend,
                   const TensorParallelShard* shard, std::vector<Tensor>& outputs) {
  AttentionOptions o = shard ? shard_options(s.options, *shard) : s.options;
  o.attn_backend = backend;
  ForwardContext ctx;
  Attention layer(ctx, o);
  KVCache cache = KVCache::allocate(layer.config(), 6);
  layer.bind_kv_cache({cache.view()});
  const int d = s.options.head_size;
  for (size_t i = 0; i < s.md.size(); ++i) {
    if (outputs.size() <= i) {
      outputs.push_back(
          Tensor::zeros({s.q[i].view().size(0), int64_t(s.options.num_heads) * d}, DType::kF32));
    }
    const AttentionMetadata md = s.md[i].view();
    ctx.begin_step({&md});
    if (shard) {
      layer.forward(shard_query(s.q[i].view(), *shard, d), shard_kv(s.k[i].view(), *shard, d),
                    shard_kv(s.v[i].view(), *shard, d), shard_query(outputs[i].view(), *shard, d));
    } else {
      layer.forward(s.q[i].view(), s.k[i].view(), s.v[i].view(), outputs[i].view());
    }
    ctx.end_step();
  }
}

// ---- decode context parallelism: one decode step of three requests with cached contexts ----

struct DcpScenario {
  AttentionConfig config;
  std::vector<int> contexts = {37, 5, 64};
  Tensor ctx_k, ctx_v;  // [sum contexts, Hkv, D]
  Tensor new_k, new_v;  // [requests, Hkv, D]
  Tensor q;             // [requests, H, D]
};

inline DcpScenario make_dcp_scenario(uint32_t seed) {
  std::mt19937 rng(seed);
  DcpScenario s;
  const int hq = 8, hk = 2, d = 32;
  s.config.num_heads = hq;
  s.config.num_kv_heads = hk;
  s.config.head_size = d;
  s.config.scale = 0.18f;
  s.config.dtype = DType::kF32;
  s.config.block_size = 16;
  s.config.logits_soft_cap = 20.0f;  // position-free features work under DCP
  int64_t ctx_tokens = 0;
  for (int c : s.contexts) ctx_tokens += c;
  const int64_t n = int64_t(s.contexts.size());
  s.ctx_k = random_f32({ctx_tokens, hk, d}, rng);
  s.ctx_v = random_f32({ctx_tokens, hk, d}, rng);
  s.new_k = random_f32({n, hk, d}, rng);
  s.new_v = random_f32({n, hk, d}, rng);
  s.q = random_f32({n, hq, d}, rng);
  return s;
}

// The decode step's output and LSE: over the whole cache (dcp == nullptr) or over one rank's
// share of it.
inline void run_dcp(const DcpScenario& s, const Backend& backend, const DecodeContextParallel* dcp,
                    Tensor& out, Tensor& lse) {
  const AttentionConfig& c = s.config;
  const int bs = c.block_size;
  const int64_t n = int64_t(s.contexts.size());
  const auto impl = backend.make_impl(c, Device::cpu());
  KVCache cache = KVCache::allocate(c, 16);
  StepMetadata decode;
  if (dcp == nullptr) {
    MetadataBuilder prefill(bs), step(bs);
    int next_block = 1;
    for (int ctx : s.contexts) {
      std::vector<int32_t> ids;
      for (int i = 0; i < (ctx + 1 + bs - 1) / bs; ++i) ids.push_back(next_block++);
      prefill.add({0, ctx, ids});
      step.add({ctx, 1, ids});
    }
    const StepMetadata pm = prefill.build();
    impl->write_kv({s.ctx_k.view(), s.ctx_v.view(), pm.view().slot_mapping, cache.view(), {}, {}});
    decode = step.build();
  } else {
    std::vector<DcpDecodeRequest> reqs;
    std::vector<int64_t> slots;
    int next_block = 1;
    for (int ctx : s.contexts) {
      DcpDecodeRequest req{ctx, {}};
      for (int64_t i = 0; i < (dcp->local_len(ctx + 1) + bs - 1) / bs; ++i) {
        req.local_block_ids.push_back(next_block++);
      }
      dcp_prefill_slots(ctx, req.local_block_ids, bs, *dcp, slots);
      reqs.push_back(req);
    }
    const Tensor slot_t = Tensor::empty({int64_t(slots.size())}, DType::kI64);
    std::copy(slots.begin(), slots.end(), static_cast<int64_t*>(slot_t.data()));
    impl->write_kv({s.ctx_k.view(), s.ctx_v.view(), slot_t.view(), cache.view(), {}, {}});
    decode = dcp_decode_metadata(reqs, bs, *dcp);
  }
  const AttentionMetadata dv = decode.view();
  impl->write_kv({s.new_k.view(), s.new_v.view(), dv.slot_mapping, cache.view(), {}, {}});
  out = Tensor::empty({n, c.num_heads, c.head_size}, DType::kF32);
  lse = Tensor::empty({c.num_heads, n}, DType::kF32);
  const auto plan = backend.plan(dv, c);
  std::vector<uint8_t> ws(plan->workspace_bytes());
  ForwardArgs f;
  f.query = s.q.view();
  f.kv_cache = cache.view();
  f.metadata = &dv;
  f.output = out.view();
  f.lse = lse.view();
  f.plan = plan.get();
  f.workspace = {ws.data(), ws.size()};
  impl->forward(f);
}

// ---- DCP over several steps of prefill chunks and decodes, through the Attention layer ----

// Five requests over four steps: fresh prefills (1..70 tokens, so some ranks hold none of a
// request's first tokens), chunks over contexts not divisible by the world size, decodes of
// sequences shorter than the world size, a 3-token speculative verification, and requests in a
// different order in each step. Each step's new K/V are written by that step and read by the
// later ones.
struct DcpChunkScenario {
  struct Row {
    int request = 0, num_new_tokens = 0;
  };
  AttentionOptions options;
  std::vector<std::vector<Row>> steps;
  int num_requests = 5;
  std::vector<Tensor> q, k, v;  // per step: q [T, H, D], k/v [T, Hkv, D]
};

inline DcpChunkScenario make_dcp_chunk_scenario(bool sinks, uint32_t seed) {
  std::mt19937 rng(seed);
  DcpChunkScenario s;
  const int hq = 8, hk = 2, d = 32;
  s.options.num_heads = hq;
  s.options.num_kv_heads = hk;
  s.options.head_size = d;
  s.options.scale = 0.18f;
  s.options.dtype = DType::kF32;
  s.options.logits_soft_cap = 25.0f;
  s.options.cache_config = CacheConfig{};
  s.options.cache_config->block_size = 8;
  s.options.prefix = "model.layers.0.attn";
  for (int h = 0; sinks && h < hq; ++h) s.options.sinks.push_back(0.4f * float(h) - 1.5f);
  s.steps = {{{0, 13}, {1, 1}, {2, 37}, {3, 2}},
             {{0, 7}, {1, 1}, {2, 1}, {3, 1}, {4, 70}},
             {{1, 40}, {0, 1}, {3, 3}, {4, 1}, {2, 29}},
             {{2, 1}, {4, 16}, {0, 1}, {1, 1}, {3, 1}}};
  for (const auto& step : s.steps) {
    int64_t t = 0;
    for (const auto& row : step) t += row.num_new_tokens;
    s.q.push_back(random_f32({t, hq, d}, rng));
    s.k.push_back(random_f32({t, hk, d}, rng));
    s.v.push_back(random_f32({t, hk, d}, rng));
  }
  return s;
}

// Runs every step through one Attention layer on `backend`: the whole cache (dcp == nullptr) or
// one rank's share of it (dcp_options, dcp_step_metadata, dcp_clear_empty_rows). Outputs
// [T, H, D] and LSEs [H, T] per step, each poisoned with NaN before its forward.
inline void run_dcp_chunks(const DcpChunkScenario& s, const std::string& backend,
                           const DecodeContextParallel* dcp, std::vector<Tensor>& outs,
                           std::vector<Tensor>& lses) {
  AttentionOptions o = dcp ? dcp_options(s.options, *dcp) : s.options;
  o.attn_backend = backend;
  ForwardContext ctx;
  Attention layer(ctx, o);
  const int bs = layer.config().block_size;
  // Each request's blocks for its final length, from a pool in reverse order (block 0 unused).
  std::vector<int> total(size_t(s.num_requests), 0);
  for (const auto& step : s.steps) {
    for (const auto& row : step) total[size_t(row.request)] += row.num_new_tokens;
  }
  std::vector<std::vector<int32_t>> blocks(size_t(s.num_requests));
  int64_t num_blocks = 1;
  for (int r = 0; r < s.num_requests; ++r) {
    const int64_t len = dcp ? dcp->local_len(total[size_t(r)]) : total[size_t(r)];
    num_blocks += (len + bs - 1) / bs;
  }
  int32_t next = int32_t(num_blocks - 1);
  for (int r = 0; r < s.num_requests; ++r) {
    const int64_t len = dcp ? dcp->local_len(total[size_t(r)]) : total[size_t(r)];
    for (int64_t b = 0; b < (len + bs - 1) / bs; ++b) blocks[size_t(r)].push_back(next--);
  }
  KVCache cache = KVCache::allocate(layer.config(), num_blocks);
  // Finite garbage everywhere (large keys, so that it dominates any softmax that sees it): a
  // read of a slot no step wrote (block 0 included, which the empty rows of a rank read) shows
  // up in the result unless it is masked or cleared.
  fill_host(cache.tensor(), 9.0);
  layer.bind_kv_cache({cache.view()});
  std::vector<int> context(size_t(s.num_requests), 0);
  const int hq = s.options.num_heads, d = s.options.head_size;
  for (size_t i = 0; i < s.steps.size(); ++i) {
    StepMetadata md;
    DcpStep step;
    if (dcp) {
      std::vector<DcpRequest> reqs;
      for (const auto& row : s.steps[i]) {
        reqs.push_back(
            {context[size_t(row.request)], row.num_new_tokens, blocks[size_t(row.request)]});
      }
      step = dcp_step_metadata(reqs, bs, *dcp);
    } else {
      MetadataBuilder b(bs);
      for (const auto& row : s.steps[i]) {
        b.add({context[size_t(row.request)], row.num_new_tokens, blocks[size_t(row.request)]});
      }
      md = b.build();
    }
    for (const auto& row : s.steps[i]) context[size_t(row.request)] += row.num_new_tokens;
    const AttentionMetadata view = dcp ? step.metadata.view() : md.view();
    const int64_t t = s.q[i].view().size(0);
    Tensor out = Tensor::empty({t, hq, d}, s.options.dtype);
    Tensor lse = Tensor::empty({hq, t}, DType::kF32);
    fill_host(out.view(), std::nan(""));
    fill_host(lse.view(), std::nan(""));
    ctx.begin_step({&view});
    layer.forward(s.q[i].view(), s.k[i].view(), s.v[i].view(), out.view(), lse.view());
    ctx.end_step();
    if (dcp) dcp_clear_empty_rows(step, out.view(), lse.view());
    outs.push_back(std::move(out));
    lses.push_back(std::move(lse));
  }
}

// Merges the ranks' results in rank order (merge_states, spec 4.12); the merged LSE goes to
// `merged_lse` when given.
inline Tensor merge_ranks(const Backend& backend, std::vector<Tensor> outs,
                          std::vector<Tensor> lses, Tensor* merged_lse_out = nullptr) {
  Tensor merged = std::move(outs[0]), merged_lse = std::move(lses[0]);
  for (size_t r = 1; r < outs.size(); ++r) {
    Tensor next = Tensor::empty(merged.view().shape_vector(), merged.view().dtype);
    Tensor next_lse = Tensor::empty(merged_lse.view().shape_vector(), DType::kF32);
    backend.merge_states({merged.view(),
                          merged_lse.view(),
                          outs[r].view(),
                          lses[r].view(),
                          next.view(),
                          next_lse.view(),
                          {}});
    merged = std::move(next);
    merged_lse = std::move(next_lse);
  }
  if (merged_lse_out) *merged_lse_out = std::move(merged_lse);
  return merged;
}

}  // namespace pagedattn::test
