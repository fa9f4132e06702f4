#include "cuda/backend/checked.h"

#include "cuda/common/check.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {

using detail::require;

namespace {

void require_not_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  PAGEDATTN_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  require(status == cudaStreamCaptureStatusNone,
          "checked mode (PAGEDATTN_CHECKED, or the cuda option checked=on) copies metadata to "
          "the host and cannot run inside CUDA graph capture; capture with checked mode off");
}

Tensor host_copy(const TensorView& v) {
  if (!v.defined()) return {};
  return Tensor::copy_of(v, Device::cpu());
}

int32_t i32_at(const TensorView& v, int64_t i) {
  return static_cast<const int32_t*>(v.data)[i * v.stride(0)];
}

void require_same(const TensorView& device_copy, const TensorView& mirror, const char* name) {
  if (!mirror.defined() || !device_copy.defined()) return;
  require(device_copy.size(0) == mirror.size(0), "metadata.", name, " has ", device_copy.size(0),
          " entries on the device but ", mirror.size(0), " in ", name, "_cpu");
  for (int64_t i = 0; i < mirror.size(0); ++i) {
    require(i32_at(device_copy, i) == i32_at(mirror, i), "metadata.", name, "[", i, "] is ",
            i32_at(device_copy, i), " on the device but ", i32_at(mirror, i), " in ", name, "_cpu");
  }
}

}  // namespace

void validate_device_metadata(const AttentionMetadata& md, AttentionType attn_type,
                              const CacheGeometry& cache, cudaStream_t stream) {
  require_not_capturing(stream);
  PAGEDATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  const Tensor qsl = host_copy(md.query_start_loc), sl = host_copy(md.seq_lens);
  const Tensor bt = host_copy(md.block_table), slots = host_copy(md.slot_mapping);
  require_same(qsl.view(), md.query_start_loc_cpu, "query_start_loc");
  require_same(sl.view(), md.seq_lens_cpu, "seq_lens");
  AttentionMetadata host = md;
  host.query_start_loc = host.query_start_loc_cpu = qsl.view();
  host.seq_lens = host.seq_lens_cpu = sl.view();
  host.block_table = bt.view();
  host.slot_mapping = slots.view();
  validate_metadata(host, attn_type, cache);
}

void validate_device_slots(const TensorView& slot_mapping, int64_t capacity, cudaStream_t stream) {
  require_not_capturing(stream);
  PAGEDATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  const Tensor slots = host_copy(slot_mapping);
  const auto* s = static_cast<const int64_t*>(slots.data());
  for (int64_t t = 0; t < slots.view().size(0); ++t) {
    require(s[t] == -1 || (s[t] >= 0 && s[t] < capacity), "slot_mapping[", t, "] (", s[t],
            ") is outside the cache's slots [0, ", capacity, ") and not -1");
  }
}

}  // namespace pagedattn::cuda
