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
// stored (rounded) inputs. q [B, Sq, Hq*D], k / v [B, Skv, Hkv*D]: any Sq and Skv >= 1.
inline Tensor naive_mha(const Tensor& q, const Tensor& k, const Tensor& v, int hq, int hkv, int d,
                        double scale) {
  const int64_t b = q.view().size(0), sq = q.view().size(1), skv = k.view().size(1);
  Tensor out = Tensor::empty({b, sq, int64_t(hq) * d}, DType::kF64);
  auto at = [](const Tensor& t, int64_t i) { return load_element(t.data(), t.view().dtype, i); };
  const int g = hq / hkv;
  std::vector<double> p(static_cast<size_t>(skv), 0.0);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t i = 0; i < sq; ++i) {
      for (int h = 0; h < hq; ++h) {
        const int kh = h / g;
        double mx = -INFINITY;
        for (int64_t j = 0; j < skv; ++j) {
          double dot = 0;
          for (int e = 0; e < d; ++e) {
            dot += at(q, ((bi * sq + i) * hq + h) * d + e) *
                   at(k, ((bi * skv + j) * hkv + kh) * d + e);
          }
          p[size_t(j)] = dot * scale;
          mx = std::max(mx, p[size_t(j)]);
        }
        double sum = 0;
        for (auto& x : p) sum += (x = std::exp(x - mx));
        for (int e = 0; e < d; ++e) {
          double acc = 0;
          for (int64_t j = 0; j < skv; ++j)
            acc += p[size_t(j)] * at(v, ((bi * skv + j) * hkv + kh) * d + e);
          static_cast<double*>(out.data())[((bi * sq + i) * hq + h) * d + e] = acc / sum;
        }
      }
    }
  }
  return out;
}

}  // namespace pagedattn::test
