// The causal softmax of a CPU learner's bf16 matmul attention (learner/policy.py:
// matmul_causal_attention), forward and backward, over raw scores s = q . k of (B, R, L) where
// row r of a batch entry is query position i = r mod L (a group's query heads stacked by rows):
//   p[j] = exp(c * s[j] - m) / sum_{j' <= i} exp(c * s[j'] - m)  for j <= i, 0 beyond (c: the scale)
//   ds[j] = c * p[j] * (dp[j] - sum_{j' <= i} p[j'] dp[j'])
// Each row reads only its i + 1 causal scores, float32 inside, results rounded once to T. In
// PyTorch this was a baddbmm adding an (R x L) -inf bias, then softmax and its backward over all
// L columns of every row and the scale's multiply: ~4 ms a layer for SmolLM2's buckets.
// Built and loaded by agent_r1/native; called by agent_r1/learner/policy.py.
#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace {

using agent_r1::load;
using agent_r1::store;

template <typename T>
void forward(const T* s, float c, T* p, int B, int R, int L, int threads) {
  const int64_t rows = int64_t(B) * R;
#pragma omp parallel for num_threads(rows * L >= 65536 ? threads : 1) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const int n = int(r % R % L) + 1;  // the causal columns of this row
    const T* sr = s + r * L;
    T* pr = p + r * L;
    float m = -INFINITY;
    for (int j = 0; j < n; j++) m = std::fmax(m, c * load(sr[j]));
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += std::exp(c * load(sr[j]) - m);
    const float inv = 1.0f / sum;
    for (int j = 0; j < n; j++) store(pr + j, std::exp(c * load(sr[j]) - m) * inv);
    for (int j = n; j < L; j++) store(pr + j, 0.0f);
  }
}

template <typename T>
void backward(const T* p, const T* dp, float c, T* ds, int B, int R, int L, int threads) {
  const int64_t rows = int64_t(B) * R;
#pragma omp parallel for num_threads(rows * L >= 65536 ? threads : 1) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const int n = int(r % R % L) + 1;
    const T* pr = p + r * L;
    const T* gr = dp + r * L;
    T* o = ds + r * L;
    float dot = 0.0f;
    for (int j = 0; j < n; j++) dot += load(pr[j]) * load(gr[j]);
    for (int j = 0; j < n; j++) store(o + j, c * load(pr[j]) * (load(gr[j]) - dot));
    for (int j = n; j < L; j++) store(o + j, 0.0f);
  }
}

}  // namespace

extern "C" {
void agent_r1_causal_softmax_forward_f32(const float* s, float c, float* p, int B, int R, int L, int threads) {
  forward(s, c, p, B, R, L, threads);
}
void agent_r1_causal_softmax_forward_bf16(const uint16_t* s, float c, uint16_t* p, int B, int R, int L,
                                          int threads) {
  forward(s, c, p, B, R, L, threads);
}
void agent_r1_causal_softmax_backward_f32(const float* p, const float* dp, float c, float* ds, int B, int R, int L,
                                          int threads) {
  backward(p, dp, c, ds, B, R, L, threads);
}
void agent_r1_causal_softmax_backward_bf16(const uint16_t* p, const uint16_t* dp, float c, uint16_t* ds, int B,
                                           int R, int L, int threads) {
  backward(p, dp, c, ds, B, R, L, threads);
}
}
