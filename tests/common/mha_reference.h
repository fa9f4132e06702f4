// Test helpers for MultiHeadAttention: random host tensors and a float64 loop over the stored
// (rounded) inputs, shared by the unit tests and the CUDA tests.
#pragma once

#include <cmath>
#include <random>
#include <vector>

#include "pagedattn/tensor.h"

namespace pagedattn::test {

inline Tensor random_tensor(const std::vector<int64_t>& shape, DType dtype, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  std::normal_distribution<double> dist;
  for (int64_t i = 0; i < t.view().numel(); ++i) store_element(t.data(), dtype, i, dist(rng));
  return t;
}

// out[b, i, h, :] = softmax_j(scale * q[b,i,h] . k[b,j,h/G]) v[b,j,h/G], in float64 from the
// stored (rounded) inputs. q [B, S, Hq*D], k / v [B, S, Hkv*D].
inline Tensor naive_mha(const Tensor& q, const Tensor& k, const Tensor& v, int hq, int hkv, int d,
                        double scale) {
  const int64_t b = q.view().size(0), s = q.view().size(1);
  Tensor out = Tensor::empty({b, s, int64_t(hq) * d}, DType::kF64);
  auto at = [](const Tensor& t, int64_t i) { return load_element(t.data(), t.view().dtype, i); };
  const int g = hq / hkv;
  std::vector<double> p(static_cast<size_t>(s), 0.0);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t i = 0; i < s; ++i) {
      for (int h = 0; h < hq; ++h) {
        const int kh = h / g;
        double mx = -INFINITY;
        for (int64_t j = 0; j < s; ++j) {
          double dot = 0;
          for (int e = 0; e < d; ++e) {
            dot +=
                at(q, ((bi * s + i) * hq + h) * d + e) * at(k, ((bi * s + j) * hkv + kh) * d + e);
          }
          p[size_t(j)] = dot * scale;
          mx = std::max(mx, p[size_t(j)]);
        }
        double sum = 0;
        for (auto& x : p) sum += (x = std::exp(x - mx));
        for (int e = 0; e < d; ++e) {
          double acc = 0;
          for (int64_t j = 0; j < s; ++j)
            acc += p[size_t(j)] * at(v, ((bi * s + j) * hkv + kh) * d + e);
          static_cast<double*>(out.data())[((bi * s + i) * hq + h) * d + e] = acc / sum;
        }
      }
    }
  }
  return out;
}

}  // namespace pagedattn::test
