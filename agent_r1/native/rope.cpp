// The rotary embedding of a CPU learner's queries and keys, forward and backward, in one pass:
// t (S, B, D) rows of S positions (B: batch x heads), cos and sin (S, R) in t's dtype (Megatron's
// cos_ and sin_, R <= D rotary dimensions, the rest passes through), the rotate_half form
//   y = t * cos + rotate_half(t) * sin,  rotate_half([a, b]) = [-b, a]
//   dt = dy * cos + rotate_half^T(dy * sin),  rotate_half^T([g, h]) = [h, -g]
// float32 inside; with T = bf16 each product and the sum are rounded as PyTorch's ops round them,
// so the values are Megatron's unfused _apply_rotary_pos_emb_bshd's. That was ~12 ops a call
// (chunk, neg, cat, muls, adds, the pass-through cat) and as many backward.
// Built and loaded by agent_r1/native; called by agent_r1/learner/rope.py.
#include <cstdint>

#include "bf16.h"

namespace {

using agent_r1::load;
using agent_r1::round_to;
using agent_r1::store;

template <typename T, bool Forward>
void rows(const T* __restrict t, const T* __restrict cos, const T* __restrict sin, T* __restrict y, int S, int B,
          int D, int R, int threads) {
  const int half = R / 2;
  const T z = T();
#pragma omp parallel for num_threads(int64_t(S) * B * D >= 16384 ? threads : 1) schedule(static)
  for (int s = 0; s < S; s++) {
    const T* __restrict c = cos + int64_t(s) * R;
    const T* __restrict n = sin + int64_t(s) * R;
    for (int b = 0; b < B; b++) {
      const T* __restrict x = t + (int64_t(s) * B + b) * D;
      T* __restrict o = y + (int64_t(s) * B + b) * D;
      // forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; backward: dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1
#pragma GCC ivdep
      for (int j = 0; j < half; j++) {
        const float x1 = load(x[j]), x2 = load(x[j + half]);
        const float c1 = load(c[j]), c2 = load(c[j + half]);
        const float s1 = load(n[j]), s2 = load(n[j + half]);
        if (Forward) {
          store(o + j, round_to(x1 * c1, z) + round_to(-x2 * s1, z));
          store(o + j + half, round_to(x2 * c2, z) + round_to(x1 * s2, z));
        } else {
          store(o + j, round_to(x1 * c1, z) + round_to(x2 * s2, z));
          store(o + j + half, round_to(x2 * c2, z) - round_to(x1 * s1, z));
        }
      }
      for (int d = R; d < D; d++) o[d] = x[d];
    }
  }
}

template <typename T>
void apply(const T* t, const T* cos, const T* sin, T* y, int S, int B, int D, int R, float sign, int threads) {
  if (sign > 0)
    rows<T, true>(t, cos, sin, y, S, B, D, R, threads);
  else
    rows<T, false>(t, cos, sin, y, S, B, D, R, threads);
}

}  // namespace

extern "C" {
void agent_r1_rope_f32(const float* t, const float* cos, const float* sin, float* y, int S, int B, int D, int R,
                       float sign, int threads) {
  apply(t, cos, sin, y, S, B, D, R, sign, threads);
}
void agent_r1_rope_bf16(const uint16_t* t, const uint16_t* cos, const uint16_t* sin, uint16_t* y, int S, int B,
                        int D, int R, float sign, int threads) {
  apply(t, cos, sin, y, S, B, D, R, sign, threads);
}
}
