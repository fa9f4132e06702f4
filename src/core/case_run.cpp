// Replaying a case on a backend: write K/V into a copy of the cache, attend, copy back.
#include <string>

#include "pagedattn/case_file.h"
#include "pagedattn/error.h"

namespace pagedattn {

CaseResult run_case(const Case& c, const Backend& backend, const RunCaseOptions& options) {
  const AttentionConfig& cfg = c.config;
  const Device device = options.device;
  const std::vector<std::string> reasons = backend.check(BackendQuery{cfg, device});
  if (!reasons.empty()) {
    std::string all;
    for (const auto& r : reasons) all += (all.empty() ? "" : "; ") + r;
    detail::fail<NotSupported>("backend '", backend.name(), "' cannot run this case: ", all);
  }
  auto on_device = [device](const Tensor& t) {
    return t.defined() ? Tensor::copy_of(t.view(), device) : Tensor();
  };
  const Tensor query = on_device(c.query);        // [num_tokens, num_heads, head_size]
  const Tensor key = on_device(c.key);            // [num_kv_tokens, num_kv_heads, head_size]
  const Tensor value = on_device(c.value);        // [num_kv_tokens, num_kv_heads, head_size]
  const Tensor kv_cache = on_device(c.kv_cache);  // a copy: the case stays as loaded
  const Tensor query_start_loc = on_device(c.query_start_loc);  // int32 [num_seqs + 1]
  const Tensor seq_lens = on_device(c.seq_lens);                // int32 [num_seqs]
  const Tensor block_table = on_device(c.block_table);          // int32 [num_seqs, max_blocks]
  const Tensor slot_mapping = on_device(c.slot_mapping);        // int64 [num_slots]

  AttentionMetadata md = c.metadata();  // host mirrors stay on the case's tensors
  md.query_start_loc = query_start_loc.view();
  md.seq_lens = seq_lens.view();
  md.block_table = block_table.view();
  md.slot_mapping = slot_mapping.view();

  const int64_t num_tokens = c.num_tokens();
  const DType output_dtype = options.output_dtype.value_or(cfg.dtype);
  // Zero-filled, so rows (and LSE columns) past num_actual_tokens read as 0.
  const Tensor output =  // [num_tokens, num_heads, head_size]
      Tensor::zeros({num_tokens, cfg.num_heads, cfg.head_size}, output_dtype, device);
  Tensor lse;  // [num_heads, num_tokens]
  if (options.lse) lse = Tensor::zeros({cfg.num_heads, num_tokens}, options.lse_dtype, device);

  const bool cached = uses_kv_cache(cfg.attn_type);
  const KVCacheView cache_view =
      cached ? KVCacheView::from_combined(kv_cache.view()) : KVCacheView{};
  WriteKVArgs write;
  if (c.writes_kv()) {
    write.key = key.view();
    write.value = value.view();
    write.slot_mapping = slot_mapping.view();
    write.kv_cache = cache_view;
    write.scales = c.scales;
    write.scales.q_scales.clear();  // the query's: forward only
    check_write_kv_args(cfg, write);
  }
  ForwardArgs forward;
  forward.query = query.view();
  if (cached) {
    forward.kv_cache = cache_view;
  } else {
    forward.key = key.view();
    forward.value = value.view();
  }
  forward.scales = c.scales;
  forward.metadata = &md;
  forward.output = output.view();
  if (lse.defined()) forward.lse = lse.view();
  check_forward_args(cfg, forward);

  const std::unique_ptr<Plan> plan = backend.plan(md, cfg);
  Tensor workspace;
  if (plan && plan->workspace_bytes() > 0) {
    workspace = Tensor::empty({int64_t(plan->workspace_bytes())}, DType::kU8, device);
    forward.workspace = {workspace.data(), plan->workspace_bytes()};
  }
  forward.plan = plan.get();
  const std::unique_ptr<AttentionImpl> impl = backend.make_impl(cfg, device);
  if (c.writes_kv()) impl->write_kv(write);  // write first: attention reads the new keys back
  impl->forward(forward);
  require_device(device).synchronize(device.index);

  CaseResult result;
  result.output = Tensor::copy_of(
      output.view().reshape({num_tokens, int64_t(cfg.num_heads) * cfg.head_size}), Device::cpu());
  if (kv_cache.defined()) result.kv_cache = Tensor::copy_of(kv_cache.view(), Device::cpu());
  if (lse.defined()) result.lse = Tensor::copy_of(lse.view(), Device::cpu());
  return result;
}

void save_case_result(const std::string& path, const Case& c, const CaseResult& result,
                      std::string_view backend_name) {
  SafeTensors f;
  detail::require(result.output.defined(), "save_case_result: the result has no output");
  f.tensors["output"] = result.output;
  if (result.kv_cache.defined()) {
    Tensor kv = result.kv_cache;
    if (c.kv_cache_as_bytes && is_fp8(kv.view().dtype)) kv.view().dtype = DType::kU8;
    f.tensors["kv_cache"] = kv;
  }
  if (result.lse.defined()) f.tensors["lse"] = result.lse;
  if (!backend_name.empty()) f.metadata["backend"] = std::string(backend_name);
  save_safetensors(path, f);
}

}  // namespace pagedattn
