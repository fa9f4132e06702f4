#include "cuda/backend/q_map.h"

namespace pagedattn::cuda {

bool q_map_shape(const TensorView& query, int head_size, int group, int block_m, QMapShape* shape,
                 const char** why) {
  const int64_t e = int64_t(dtype_size(query.dtype));
  auto refuse = [&](const char* reason) {
    *why = reason;
    return false;
  };
  if (query.ndim != 3 || e != 2) return refuse("the query is not a 3-D tensor of 16-bit elements");
  if (group <= 0 || block_m % group != 0)
    return refuse("the group does not divide the tile's rows");
  if (query.size(0) < block_m / group) return refuse("fewer tokens than one box");
  if (query.stride(2) != 1) return refuse("the query's rows are not contiguous");
  if (reinterpret_cast<uintptr_t>(query.data) % 16 != 0 || (query.stride(0) * e) % 16 != 0 ||
      (query.stride(1) * e) % 16 != 0) {
    return refuse("the query's base or row strides are not multiples of 16 bytes");
  }
  *shape = QMapShape{{uint64_t(head_size), uint64_t(query.size(1)), uint64_t(query.size(0))},
                     {uint64_t(query.stride(1) * e), uint64_t(query.stride(0) * e)},
                     {64, uint32_t(group), uint32_t(block_m / group)}};
  return true;
}

}  // namespace pagedattn::cuda
