#include "connector/block_copy.h"

#include <cstring>
#include <vector>

#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn::connector {
namespace {

// memcpy towards the cache (kToCache) or towards the packed form.
template <bool kToCache>
void move(char* mem, char* packed, size_t n) {
  if (kToCache) {
    std::memcpy(mem, packed, n);
  } else {
    std::memcpy(packed, mem, n);
  }
}

// One half (K or V) of block `block`: [block_size, num_kv_heads, head_size] with the cache's
// strides (stride(3) == 1, checked by the cache's users).
struct Half {
  char* base = nullptr;  // element (block, 0, 0, 0)
  int64_t s1 = 0, s2 = 0;
  int bs = 0, hk = 0, d = 0;
  size_t es = 0;

  Half(const TensorView& v, int64_t block)
      : base(static_cast<char*>(v.data) + block * v.stride(0) * int64_t(dtype_size(v.dtype))),
        s1(v.stride(1)),
        s2(v.stride(2)),
        bs(int(v.size(1))),
        hk(int(v.size(2))),
        d(int(v.size(3))),
        es(dtype_size(v.dtype)) {}
  size_t bytes() const { return size_t(bs) * size_t(hk) * size_t(d) * es; }
  bool nhd_dense() const { return s2 == d && s1 == int64_t(hk) * d; }
  // Elements from the first to one past the last element of the half.
  int64_t span() const { return int64_t(bs - 1) * s1 + int64_t(hk - 1) * s2 + d; }
  bool dense() const { return span() == int64_t(bs) * hk * d && s1 > 0 && s2 > 0; }
  // Copies between the half at `mem` (cache strides) and `packed` (NHD, contiguous).
  template <bool kToCache>
  void copy_host(char* mem, char* packed) const {
    if (nhd_dense()) {
      move<kToCache>(mem, packed, bytes());
      return;
    }
    const size_t row = size_t(d) * es;
    for (int o = 0; o < bs; ++o) {
      for (int h = 0; h < hk; ++h) {
        char* at = mem + (int64_t(o) * s1 + int64_t(h) * s2) * int64_t(es);
        move<kToCache>(at, packed, row);
        packed += row;
      }
    }
  }
};

template <bool kToCache>
void copy_block(const KVCacheView& cache, int64_t block, char* packed) {
  detail::require(block >= 0 && block < cache.num_blocks(), "KV connector: block ", block,
                  " is outside the cache's [0, ", cache.num_blocks(), ")");
  for (const TensorView* v : {&cache.key, &cache.value}) {
    const Half h(*v, block);
    if (v->device.is_cpu()) {
      h.copy_host<kToCache>(h.base, packed);
    } else {
      // Off-host: move the half's bytes in one copy and reorder them on the host. A dense half
      // is covered exactly by its elements, so a write needs no read first.
      detail::require<NotSupported>(h.dense(), "KV connector: a ", to_string(v->device),
                                    " cache block whose K or V half is not dense");
      DeviceRuntime& rt = require_device(v->device);
      std::vector<char> staging(size_t(h.span()) * h.es);
      if (kToCache) {
        h.copy_host<true>(staging.data(), packed);
        rt.copy(h.base, v->device, staging.data(), Device::cpu(), staging.size());
      } else {
        rt.copy(staging.data(), Device::cpu(), h.base, v->device, staging.size());
        h.copy_host<false>(staging.data(), packed);
      }
    }
    packed += h.bytes();
  }
}

}  // namespace

size_t block_bytes(const KVCacheView& cache) {
  return size_t(cache.block_size()) * size_t(cache.num_kv_heads()) *
         size_t(cache.head_size() + cache.head_size_v()) * dtype_size(cache.dtype());
}

void gather_block(const KVCacheView& cache, int64_t block, void* dst) {
  copy_block<false>(cache, block, static_cast<char*>(dst));
}

void scatter_block(const KVCacheView& cache, int64_t block, const void* src) {
  copy_block<true>(cache, block, static_cast<char*>(const_cast<void*>(src)));
}

}  // namespace pagedattn::connector
