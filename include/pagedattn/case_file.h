// Attention case files: one attention step (inputs, cache before the step, metadata) stored
// in safetensors, the code that replays it on a backend, checks the result against the float64
// reference, and generates random cases. docs/case_format.md is the contract.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/accuracy.h"
#include "pagedattn/backend.h"
#include "pagedattn/config.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"
#include "pagedattn/safetensors.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

/// One attention step. Every tensor is an owning, contiguous host tensor. A loaded case always
/// has query, block_table, seq_lens, query_start_loc and slot_mapping; key/value are absent only
/// for an encoder_decoder decode step, kv_cache only for encoder types.
struct Case {
  AttentionConfig config;  ///< dtype = query dtype; block_size = kv_cache.size(2) (16 without)
  KVScales scales;         ///< k_scale / v_scale; fp8 caches only read them

  Tensor query;            ///< [num_tokens, num_heads, head_size], config.dtype
  Tensor key;              ///< [num_kv_tokens, num_kv_heads, head_size], config.dtype
  Tensor value;            ///< [num_kv_tokens, num_kv_heads, head_size], config.dtype
  Tensor kv_cache;         ///< [num_blocks, 2, block_size, num_kv_heads, head_size], cache dtype
  Tensor block_table;      ///< int32 [>= num_seqs, max_blocks_per_seq]
  Tensor seq_lens;         ///< int32 [num_seqs]
  Tensor query_start_loc;  ///< int32 [num_seqs + 1]
  Tensor slot_mapping;     ///< int64 [num_slots]; -1 = not written
  bool kv_cache_as_bytes = false;  ///< the file held the fp8 cache as U8; results do the same

  /// Requests, zero-length ones included.
  int num_seqs() const { return int(seq_lens.view().size(0)); }
  /// Query rows, padding included.
  int64_t num_tokens() const { return query.view().size(0); }
  /// query_start_loc[num_seqs]: rows past it are padding.
  int num_actual_tokens() const;
  /// True when the step writes key/value into the cache (decoder, encoder_decoder with K/V).
  bool writes_kv() const { return uses_kv_cache(config.attn_type) && key.defined(); }
  /// Host views of the tensors above; max_query_len / max_seq_len computed from them,
  /// causal = (attn_type == decoder). Valid while this case lives.
  AttentionMetadata metadata() const;
};

/// "decoder, bfloat16, heads 8/2, head_size 64, ..." for the CLI.
std::string describe(const Case& c);

/// Builds a case from a parsed file, normalising what the format tolerates (2-D activations,
/// int64 metadata tensors, U8 fp8 caches, absent optional tensors). Throws FormatError naming
/// the tensor or metadata field, its value and what was expected; the step's metadata is
/// checked with validate_metadata (its message is kept, as a FormatError).
Case case_from_safetensors(const SafeTensors& file);
/// The file form of `c`: every tensor at its canonical shape, numbers as decimal strings.
SafeTensors case_to_safetensors(const Case& c);
/// load_safetensors + case_from_safetensors; messages start with the path.
Case load_case(const std::string& path);
/// Writes `c` (atomically) so that load_case gives it back.
void save_case(const std::string& path, const Case& c);

/// How run_case runs a step.
struct RunCaseOptions {
  bool lse = false;                   ///< also return the LSE
  std::optional<DType> output_dtype;  ///< default: the query dtype
  DType lse_dtype = DType::kF32;      ///< float32, or float64 for the reference
  Device device = Device::cpu();      ///< inputs are copied there, results back to the host
};

/// What a step produced, on the host.
struct CaseResult {
  Tensor output;    ///< [num_tokens, num_heads * head_size]; rows past num_actual_tokens are 0
  Tensor kv_cache;  ///< the cache after the step, as in the case; undefined when it has none
  Tensor lse;       ///< [num_heads, num_tokens] when asked; columns past num_actual_tokens are 0
};

/// Runs the step on `backend`: for decoder and encoder_decoder (with K/V) the new K/V are
/// written into a copy of the cache first (write_kv), then attention reads every key from it
/// (forward); encoder types attend over key/value directly. Arguments go through
/// check_write_kv_args / check_forward_args first (InvalidArgument naming the field).
CaseResult run_case(const Case& c, const Backend& backend, const RunCaseOptions& options = {});

/// Writes `result` as a result file: `output`, `kv_cache` when defined (U8 when the case's
/// was), `lse` when defined; __metadata__ carries `backend` when given.
void save_case_result(const std::string& path, const Case& c, const CaseResult& result,
                      std::string_view backend_name = {});

/// One tensor of a result against the float64 reference, with the budget set by the naive
/// low-precision run (accuracy.h).
struct TensorCheck {
  ErrorStats got;       ///< result vs float64 reference
  ErrorStats baseline;  ///< low-precision reference vs float64 reference
  Tolerance tolerance;
  bool pass = false;
  double budget() const { return tolerance.multiple * baseline.max_abs + tolerance.atol; }
};

/// The verdict of check_case.
struct CaseCheck {
  TensorCheck output;               ///< rows [0, num_actual_tokens)
  std::optional<TensorCheck> lse;   ///< columns [0, num_actual_tokens), when the result has one
  int64_t kv_cache_elements = 0;    ///< cache elements compared (0 without a cache)
  int64_t kv_cache_mismatches = 0;  ///< elements whose bytes differ from the reference's write
  std::string kv_cache_problem;     ///< non-empty when the result's cache is missing or misshaped
  /// True when every tensor passed and the cache matches.
  bool pass() const;
  /// One line per checked tensor, ending in PASS or FAIL.
  std::string to_string() const;
};

/// Checks `result` (from run_case on any backend) against the reference backend run in float64
/// (the oracle) and in low precision (the budget: default_tolerance(query dtype) for the output,
/// default_tolerance(float32) for the LSE). The cache after the step must be bit-identical to
/// the reference's, since every backend stores K/V by the same conversion rule.
CaseCheck check_case(const Case& c, const CaseResult& result);

/// One request of a generated case: seq_len = context_len + num_new_tokens keys. Encoder types
/// need context_len = 0; for encoder_decoder the seq_len keys are the encoder's tokens.
struct CaseRequest {
  int context_len = 0;     ///< keys already in the cache
  int num_new_tokens = 0;  ///< query tokens this step
};

/// Parameters of make_random_case.
struct CaseSpec {
  uint64_t seed = 0;                                  ///< same seed, same case
  AttentionType attn_type = AttentionType::kDecoder;  ///< the layer type
  int num_heads = 4;                                  ///< query heads
  int num_kv_heads = 2;                               ///< KV heads, divides num_heads
  int head_size = 32;                                 ///< Q, K and V head size
  DType dtype = DType::kBF16;                         ///< query / key / value dtype
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;  ///< cache storage (fp8: cached types only)
  int block_size = 16;                                ///< tokens per cache block
  std::optional<float> scale;                         ///< default 1/sqrt(head_size)
  std::optional<int> sliding_window;                  ///< tokens visible, current included
  std::optional<float> logits_soft_cap;               ///< tanh cap
  bool alibi = false;                                 ///< random positive slopes
  bool sinks = false;                                 ///< random sink logits
  KVScales scales;                                    ///< fp8 k_scale / v_scale (/ q_scale)
  bool query_quant = false;                           ///< fp8 e4m3 query (needs an e4m3 cache)
  std::vector<CaseRequest> requests{{0, 7}, {21, 1}, {5, 12}};  ///< the step's requests
  int pad_tokens = 0;    ///< query rows past num_actual_tokens (slot -1)
  int spare_blocks = 2;  ///< cache blocks no request uses (block 0, the null block, is extra)
  bool cross_kv = true;  ///< encoder_decoder: the encoder step (K/V written) or a decode step
};

/// A random case: normal Q/K/V, a cache filled with random values (the context tokens' K/V
/// and garbage elsewhere), physical blocks shuffled so that no request's blocks are contiguous,
/// metadata from MetadataBuilder. Deterministic for a seed. Throws InvalidArgument for specs
/// that make no valid step.
Case make_random_case(const CaseSpec& spec);

/// Parses "ctx:new,ctx:new,..." (e.g. "0:7,21:1"); throws InvalidArgument naming the entry.
std::vector<CaseRequest> parse_case_requests(std::string_view text);

}  // namespace pagedattn
