// The cuda backend's MLADeviceOps: the kernels of proj.cu behind the interface the core sees.
#include "cuda/mla/proj.h"

namespace pagedattn::cuda::mla {
namespace {

class ProjOps final : public MLADeviceOps {
 public:
  void build_latent(const TensorView& kv_c, const TensorView& k_pe, const TensorView& latent,
                    Stream stream) const override {
    mla::build_latent(kv_c, k_pe, latent, stream.handle);
  }
  void absorb_query(const TensorView& q, const float* w_uk_t, int p, const TensorView& q_lat,
                    const int64_t* rows, Stream stream) const override {
    mla::absorb_query(q, w_uk_t, p, q_lat, stream.handle, rows);
  }
  void up_project(const TensorView& o_lat, const float* w_uv, int l, int v, int64_t num_tokens,
                  const TensorView& out, const int64_t* rows, Stream stream) const override {
    mla::up_project(o_lat, w_uv, l, v, num_tokens, out, stream.handle, rows);
  }
  void gather_latent(const TensorView& cache, const TensorView& block_table, const int32_t* keys,
                     float scale, const TensorView& latent, Stream stream) const override {
    mla::gather_latent(cache, block_table, keys, scale, latent, stream.handle);
  }
  void expand_kv(const TensorView& latent, const float* w_uk, const float* w_uv, int p, int v,
                 const TensorView& k, const TensorView& vv, Stream stream) const override {
    mla::expand_kv(latent, w_uk, w_uv, p, v, k, vv, stream.handle);
  }
  void copy_heads(const TensorView& src, const TensorView& dst, Stream stream) const override {
    mla::copy_heads(src, dst, stream.handle);
  }
  void zero_rows(const TensorView& out, Stream stream) const override {
    mla::zero_rows(out, stream.handle);
  }
};

}  // namespace

const MLADeviceOps& device_ops() {
  static const ProjOps ops;
  return ops;
}

}  // namespace pagedattn::cuda::mla
