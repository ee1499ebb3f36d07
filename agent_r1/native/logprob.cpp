// The learner's per-token logprob and entropy over a (rows, V) block of vocabulary-parallel logits
// (float32 or bfloat16, read in place), for agent_r1/learner/policy.py's _VocabParallelLogprob:
// z = logits / T over the real vocabulary (columns at or past vocab_size - vocab_start are the
// TP padding: left out), all in float32. One row at a time, so a row stays in cache across its
// passes; PyTorch's version made a float32 copy of the block and went over it six times.
//   row_max: m = max_j z_j
//   row_stats: with z_j - m (m all-reduced over the TP ranks first): sum exp, sum exp * (z - m),
//              and (z - m) at the row's target where this rank holds it (else 0)
//   row_grad: the gradient of logprob (weight g_lp) and entropy (weight g_ent) with respect to
//             the logits, in their dtype: ex_j / S * (-g_lp + (-g_ent) (z_j - m - lse + H)),
//             plus g_lp at the target, over T.
// Built and loaded by agent_r1/native.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"

namespace {

using agent_r1::load;
using agent_r1::store;

template <typename T>
void row_max(const T* x, int64_t stride, int A, int V, float inv_t, float* m, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int a = 0; a < A; a++) {
    const T* r = x + int64_t(a) * stride;
    float best = -INFINITY;
    for (int j = 0; j < V; j++) {
      const float z = load(r[j]) * inv_t;
      best = z > best ? z : best;
    }
    m[a] = best;
  }
}

template <typename T>
void row_stats(const T* x, int64_t stride, int A, int V, float inv_t, const float* m, const int64_t* local,
               const uint8_t* inside, float* stats, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int a = 0; a < A; a++) {
    const T* r = x + int64_t(a) * stride;
    const float mx = m[a];
    float s = 0.0f, ez = 0.0f;
#pragma omp simd reduction(+ : s, ez)
    for (int j = 0; j < V; j++) {
      const float z = load(r[j]) * inv_t - mx;
      const float e = std::exp(z);
      s += e;
      ez += e * z;
    }
    stats[3 * a] = s;
    stats[3 * a + 1] = ez;
    stats[3 * a + 2] = inside[a] ? load(r[local[a]]) * inv_t - mx : 0.0f;
  }
}

template <typename T>
void row_grad(const T* x, int64_t stride, int A, int V, int Vt, float inv_t, const float* m, const float* sumexp,
              const float* lse, const float* entropy, const float* g_lp, const float* g_ent, const int64_t* local,
              const uint8_t* inside, T* grad, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int a = 0; a < A; a++) {
    const T* r = x + int64_t(a) * stride;
    T* g = grad + int64_t(a) * Vt;
    const float mx = m[a], inv_s = 1.0f / sumexp[a];
    const float coef = g_lp ? -g_lp[a] : 0.0f;
    const float ge = g_ent ? -g_ent[a] : 0.0f, shift = entropy[a] - lse[a];
    const int tgt = g_lp && inside[a] ? int(local[a]) : -1;
    for (int j = 0; j < V; j++) {
      const float z = load(r[j]) * inv_t - mx;
      float w = std::exp(z) * inv_s * (coef + ge * (z + shift));
      if (j == tgt) w += g_lp[a];
      store(g + j, w * inv_t);
    }
    for (int j = V; j < Vt; j++) store(g + j, 0.0f);  // the TP padding columns
  }
}

}  // namespace

#define ENTRY(NAME, T)                                                                                            \
  void agent_r1_logprob_max_##NAME(const T* x, int64_t stride, int A, int V, float inv_t, float* m, int threads) { \
    row_max(x, stride, A, V, inv_t, m, threads);                                                                  \
  }                                                                                                               \
  void agent_r1_logprob_stats_##NAME(const T* x, int64_t stride, int A, int V, float inv_t, const float* m,      \
                                     const int64_t* local, const uint8_t* inside, float* stats, int threads) {    \
    row_stats(x, stride, A, V, inv_t, m, local, inside, stats, threads);                                          \
  }                                                                                                               \
  void agent_r1_logprob_grad_##NAME(const T* x, int64_t stride, int A, int V, int Vt, float inv_t, const float* m, \
                                    const float* sumexp, const float* lse, const float* entropy, const float* g_lp, \
                                    const float* g_ent, const int64_t* local, const uint8_t* inside, T* grad,      \
                                    int threads) {                                                                \
    row_grad(x, stride, A, V, Vt, inv_t, m, sumexp, lse, entropy, g_lp, g_ent, local, inside, grad, threads);     \
  }

extern "C" {
ENTRY(f32, float)
ENTRY(bf16, uint16_t)
}
