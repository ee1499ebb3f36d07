// Decode attention over the slot KV cache, for CPUs: one pass over each row's keys and values,
// read in place from the cache (no gathered or transposed copies), float32 accumulation.
// Built and loaded by agent_r1/native (see there); called by agent_r1/rollout/attention.py.
//
// Row n of the query (N, H, R, D) is attended by its R query vectors per kv head h over positions
// lo[n] <= t < hi[n] of cache slot slot[n]: o = softmax(q k_t^T * scale) v_t, lse = the log of
// the softmax's denominator (the scaled scores' log-sum-exp). An empty range gives o = 0,
// lse = -inf.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using agent_r1::load;
using agent_r1::store;

// Any head dimension, scalar loops the compiler vectorises as it can.
template <typename T>
void generic(const float* qf, int R, int D, const T* K, const T* V, int64_t cT, int a, int T_, float* s, T* o,
             float* l) {
  std::vector<float> row(D), acc(size_t(R) * D, 0.0f);
  for (int t = 0; t < T_; t++) {
    for (int d = 0; d < D; d++) row[d] = load(K[int64_t(a + t) * cT + d]);
    for (int r = 0; r < R; r++) {
      float dot = 0.0f;
      for (int d = 0; d < D; d++) dot += qf[r * D + d] * row[d];
      s[size_t(r) * T_ + t] = dot;
    }
  }
  for (int r = 0; r < R; r++) {
    float* sr = s + size_t(r) * T_;
    float m = sr[0];
    for (int t = 1; t < T_; t++) m = sr[t] > m ? sr[t] : m;
    float sum = 0.0f;
    for (int t = 0; t < T_; t++) sum += (sr[t] = std::exp(sr[t] - m));
    l[r] = m + std::log(sum);
    for (int t = 0; t < T_; t++) sr[t] /= sum;
  }
  for (int t = 0; t < T_; t++) {
    for (int d = 0; d < D; d++) row[d] = load(V[int64_t(a + t) * cT + d]);
    for (int r = 0; r < R; r++)
      for (int d = 0; d < D; d++) acc[size_t(r) * D + d] += s[size_t(r) * T_ + t] * row[d];
  }
  for (size_t i = 0; i < acc.size(); i++) store(o + i, acc[i]);
}

// Vectors of 16 floats (one AVX-512 register, two AVX2 ones): the head dimension in chunks.
typedef float v16 __attribute__((vector_size(64)));

inline float hsum(v16 x) {
#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#else
  float s = 0.0f;
  for (int i = 0; i < 16; i++) s += x[i];
  return s;
#endif
}

template <typename T>
inline v16 load16(const T* p) {
  v16 x;
  for (int i = 0; i < 16; i++) x[i] = load(p[i]);
  return x;
}

// 16 floats stored in T (bf16: rounded to nearest even, NaN kept), in vector instructions.
inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }
inline void store16(uint16_t* p, v16 x) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u32x16 u;
  std::memcpy(&u, &x, sizeof(u));
  const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const u32x16 nan = (u & 0x7fffffffu) > 0x7f800000u;  // all ones where x is NaN
  const u16x16 h = __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & rounded), u16x16);
  std::memcpy(p, &h, sizeof(h));
}

// One (row, kv head) item, C chunks of 16 in the head dimension (D = 16 C).
// Ask for a cache row's lines ahead of use: one item's keys span a few KB of one slot, too short a
// run for the hardware prefetcher to ramp up, so the loads otherwise wait on memory. Level 3: into
// L1 (needed within a few rows), 2: into L2 (needed by the next pass or the next item).
template <int Level = 3, typename T>
inline void prefetch(const T* p, int D) {
  for (int b = 0; b < D * int(sizeof(T)); b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, Level);
}

// The item this thread runs next (its keys and values from its first position; T = 0: not known).
// A bf16 item computes for about as long as memory takes to bring in its keys and values, so each
// of its passes asks for the next pass's rows into L2 as it goes (the scores: this item's values
// and the next item's keys; the values: the next item's values) and the reads overlap the
// arithmetic (decode attention at SmolLM2's shape: 15 -> 10 ms a step). The float32 passes compute
// for longer than their reads take; asking ahead there only costs instructions.
template <typename T>
struct Next {
  const T* K = nullptr;
  const T* V = nullptr;
  int T_ = 0;
};

// A bf16 cache on a CPU with AVX512_BF16: each score from the bf16 query and key as they are, 32
// products a dot instruction accumulated in float32 (exact products: as the float32 path, but half
// the instructions and no conversions of the keys), then scaled.
template <typename T, int C>
bool bf16_scores(const uint16_t* qb, float scale, int R, const T* K, const T* V, int64_t cT, int a, int T_, float* s,
                 const Next<T>& nx) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, uint16_t>::value && C % 2 == 0) {
    constexpr int AHEAD = 16;
    __m512bh qv[7][C / 2];  // R < 8
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C / 2; c++) qv[r][c] = (__m512bh)_mm512_loadu_si512(qb + r * 16 * C + 32 * c);
    for (int t = 0; t < T_; t++) {
      if (t + AHEAD < T_) prefetch(K + int64_t(a + t + AHEAD) * cT, 16 * C);
      prefetch<2>(V + int64_t(a + t) * cT, 16 * C);
      if (t < nx.T_) prefetch<2>(nx.K + int64_t(t) * cT, 16 * C);
      const T* kp = K + int64_t(a + t) * cT;
      __m512bh k[C / 2];
      for (int c = 0; c < C / 2; c++) k[c] = (__m512bh)_mm512_loadu_si512(kp + 32 * c);
      for (int r = 0; r < R; r++) {
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[r][0], k[0]);
        for (int c = 1; c < C / 2; c++) acc = _mm512_dpbf16_ps(acc, qv[r][c], k[c]);
        s[size_t(r) * T_ + t] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
    return true;
  }
#endif
  (void)qb, (void)scale, (void)R, (void)K, (void)V, (void)cT, (void)a, (void)T_, (void)s, (void)nx;
  return false;
}

template <typename T, int C>
constexpr bool kBf16Values =
#if defined(__AVX512BF16__)
    std::is_same<T, uint16_t>::value && C % 2 == 0;
#else
    false;
#endif

// The weighted values of a bf16 cache on a CPU with AVX512_BF16, rounded as PyTorch's CPU flash
// attention rounds them in bf16: the softmax numerators e (float32, at most 1) rounded to bf16, two
// keys per dot instruction (the pair's values interleaved in registers, their numerators
// broadcast), float32 accumulation, then divided by the float32 sum of e (inv = 1 / sum). Half the
// instructions of converting every value to float32.
template <typename T, int C>
bool bf16_values(int R, const T* V, int64_t cT, int a, int T_, const float* e, const float* inv, uint16_t* pb,
                 T* o, const Next<T>& nx) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, uint16_t>::value && C % 2 == 0) {
    constexpr int Z = C / 2;                // 32 dimensions a register
    constexpr int RB = C <= 4 ? 4 : 2;      // rows a pass: RB * C accumulators
    const int TP = (T_ + 1) & ~1;           // pairs of keys, the last one padded with a zero
    for (int r = 0; r < R; r++) {
      for (int t = 0; t < T_; t++) store(pb + size_t(r) * TP + t, e[size_t(r) * T_ + t]);
      if (TP != T_) pb[size_t(r) * TP + T_] = 0;
    }
    for (int r0 = 0; r0 < R; r0 += RB) {
      const int rb = R - r0 < RB ? R - r0 : RB;
      __m512 acc[RB][C];
      for (int r = 0; r < RB; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
      for (int t = 0; t < TP; t += 2) {
        const T* v0 = V + int64_t(a + t) * cT;
        if (r0 == 0)
          for (int u = t; u < t + 2 && u < nx.T_; u++) prefetch<2>(nx.V + int64_t(u) * cT, 16 * C);
        __m512bh lo[Z], hi[Z];
        for (int z = 0; z < Z; z++) {
          const __m512i x = _mm512_loadu_si512(v0 + 32 * z);
          const __m512i y = t + 1 < T_ ? _mm512_loadu_si512(v0 + cT + 32 * z) : _mm512_setzero_si512();
          lo[z] = (__m512bh)_mm512_unpacklo_epi16(x, y);  // per 128-bit lane: dims 0-3 of t, t+1
          hi[z] = (__m512bh)_mm512_unpackhi_epi16(x, y);  // dims 4-7
        }
        for (int r = 0; r < RB; r++) {
          if (r >= rb) break;
          uint32_t pair;
          std::memcpy(&pair, pb + size_t(r0 + r) * TP + t, 4);
          const __m512bh p = (__m512bh)_mm512_set1_epi32(int(pair));
          for (int z = 0; z < Z; z++) {
            acc[r][2 * z] = _mm512_dpbf16_ps(acc[r][2 * z], p, lo[z]);
            acc[r][2 * z + 1] = _mm512_dpbf16_ps(acc[r][2 * z + 1], p, hi[z]);
          }
        }
      }
      for (int r = 0; r < rb; r++) {  // float j of lane k: dimension 8k + j (lo), 8k + 4 + j (hi)
        alignas(64) float lanes[2][16], out[16 * C];
        for (int z = 0; z < Z; z++) {
          _mm512_store_ps(lanes[0], _mm512_mul_ps(acc[r][2 * z], _mm512_set1_ps(inv[r0 + r])));
          _mm512_store_ps(lanes[1], _mm512_mul_ps(acc[r][2 * z + 1], _mm512_set1_ps(inv[r0 + r])));
          for (int k = 0; k < 4; k++)
            for (int j = 0; j < 4; j++) {
              out[32 * z + 8 * k + j] = lanes[0][4 * k + j];
              out[32 * z + 8 * k + 4 + j] = lanes[1][4 * k + j];
            }
        }
        for (int c = 0; c < C; c++) store16(o + (r0 + r) * C * 16 + 16 * c, *reinterpret_cast<v16*>(out + 16 * c));
      }
    }
    return true;
  }
#endif
  (void)R, (void)V, (void)cT, (void)a, (void)T_, (void)e, (void)inv, (void)pb, (void)o, (void)nx;
  return false;
}

template <typename T, int C>
void item(const float* qf, const uint16_t* qb, float scale, int R, const T* K, const T* V, int64_t cT, int a, int T_,
          float* s, uint16_t* pb, T* o, float* l, const Next<T>& nx) {
  constexpr int AHEAD = 16;  // keys
  for (int t = 0; t < AHEAD && t < T_; t++) prefetch(K + int64_t(a + t) * cT, 16 * C);
  if (R < 8 && qb != nullptr && bf16_scores<T, C>(qb, scale, R, K, V, cT, a, T_, s, nx)) {
  } else if (R < 8) {
    for (int t = 0; t < T_; t++) {  // scores: each key read once for the R queries
      if (t + AHEAD < T_) prefetch(K + int64_t(a + t + AHEAD) * cT, 16 * C);
      prefetch(V + int64_t(a + t) * cT, 16 * C);  // for the pass over the values
      v16 k[C];
      for (int c = 0; c < C; c++) k[c] = load16(K + int64_t(a + t) * cT + 16 * c);
      for (int r = 0; r < R; r++) {
        const v16* qr = reinterpret_cast<const v16*>(qf) + r * C;
        v16 acc = qr[0] * k[0];
        for (int c = 1; c < C; c++) acc += qr[c] * k[c];
        s[size_t(r) * T_ + t] = hsum(acc);
      }
    }
  } else {  // many queries (a shared prompt's group): 16 keys at a time, transposed, no sums across lanes
    v16 kt[16 * C];  // kt[d][j] = key j's dimension d
    for (int t0 = 0; t0 < T_; t0 += 16) {
      const int nb = T_ - t0 < 16 ? T_ - t0 : 16;
      for (int j = 0; j < 16; j++) {
        if (j >= nb) {
          for (int d = 0; d < 16 * C; d++) kt[d][j] = 0.0f;
          continue;
        }
        const T* kp = K + int64_t(a + t0 + j) * cT;
        if (t0 + j + AHEAD < T_) prefetch(kp + AHEAD * cT, 16 * C);
        prefetch(V + int64_t(a + t0 + j) * cT, 16 * C);
        for (int d = 0; d < 16 * C; d++) kt[d][j] = load(kp[d]);
      }
      for (int r0 = 0; r0 < R; r0 += 4) {
        const int rb = R - r0 < 4 ? R - r0 : 4;
        v16 acc[4] = {};
        for (int d = 0; d < 16 * C; d++)
          for (int r = 0; r < 4; r++) acc[r] += qf[(r0 + (r < rb ? r : 0)) * 16 * C + d] * kt[d];
        for (int r = 0; r < rb; r++)
          for (int j = 0; j < nb; j++) s[size_t(r0 + r) * T_ + t0 + j] = acc[r][j];
      }
    }
  }
  const bool direct = R < 8 && pb != nullptr && kBf16Values<T, C>;  // bf16_values, unnormalised e
  float inv[8];
  for (int r = 0; r < R; r++) {  // softmax numerators in place, their sum
    float* sr = s + size_t(r) * T_;
    float m = sr[0];
    for (int t = 1; t < T_; t++) m = sr[t] > m ? sr[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < T_; t++) {
      sr[t] = std::exp(sr[t] - m);
      sum += sr[t];
    }
    l[r] = m + std::log(sum);
    if (direct) {
      inv[r] = 1.0f / sum;
    } else {
      const float iv = 1.0f / sum;
      for (int t = 0; t < T_; t++) sr[t] *= iv;
    }
  }
  if (direct && bf16_values<T, C>(R, V, cT, a, T_, s, inv, pb, o, nx)) return;
  constexpr int RB = C <= 4 ? 4 : 2;  // rows per pass over the values: RB * C accumulators in registers
  for (int r0 = 0; r0 < R; r0 += RB) {
    const int rb = R - r0 < RB ? R - r0 : RB;
    v16 acc[RB][C] = {};
    for (int t = 0; t < T_; t++) {  // weighted values
      v16 v[C];
      for (int c = 0; c < C; c++) v[c] = load16(V + int64_t(a + t) * cT + 16 * c);
      for (int r = 0; r < rb; r++) {
        const float p = s[size_t(r0 + r) * T_ + t];
        for (int c = 0; c < C; c++) acc[r][c] += p * v[c];
      }
    }
    for (int r = 0; r < rb; r++)
      for (int c = 0; c < C; c++)
        store16(o + (r0 + r) * C * 16 + 16 * c, acc[r][c]);
  }
}

constexpr int kChunk = 8;  // items a thread takes at a time (the next one's reads are asked for ahead)

template <typename T>
void attend(const T* q, int64_t qN, int64_t qH, int64_t qR,                  // query and strides
            const T* K, const T* V, int64_t cS, int64_t cH, int64_t cT,       // cache and strides
            const int32_t* slot, const int32_t* lo, const int32_t* hi,        // per row n
            int N, int H, int R, int D, float scale, T* out, float* lse, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<v16> qv(size_t(R) * ((D + 15) / 16));
    std::vector<uint16_t> qraw(std::is_same<T, uint16_t>::value ? size_t(R) * D : 0);
    std::vector<float> s;
    std::vector<uint16_t> pb;  // bf16_values' rounded numerators
#pragma omp for schedule(dynamic, kChunk)
    for (int64_t nh = 0; nh < int64_t(N) * H; nh++) {
      const int64_t n = nh / H, h = nh % H;
      const int a = lo[n], b = hi[n], T_ = b - a;
      T* o = out + nh * R * D;
      float* l = lse + nh * R;
      if (T_ <= 0) {
        for (int r = 0; r < R; r++) {
          l[r] = -INFINITY;
          for (int d = 0; d < D; d++) store(o + r * D + d, 0.0f);
        }
        continue;
      }
      float* qf = reinterpret_cast<float*>(qv.data());
      const uint16_t* qb = qraw.empty() ? nullptr : qraw.data();
      for (int r = 0; r < R; r++) {
        const T* qp = q + n * qN + h * qH + r * qR;
        for (int d = 0; d < D; d++) qf[r * D + d] = load(qp[d]) * scale;
        if (qb != nullptr) std::memcpy(qraw.data() + r * D, qp, sizeof(T) * D);
      }
      s.resize(size_t(R) * T_);
      if (!qraw.empty()) pb.resize(size_t(R) * (T_ + 1));
      const int64_t base = int64_t(slot[n]) * cS + h * cH;
      Next<T> nx;  // the next item of this thread's chunk (chunks of kChunk items from 0)
      if ((nh + 1) % kChunk != 0 && nh + 1 < int64_t(N) * H) {
        const int64_t n1 = (nh + 1) / H, start = int64_t(slot[n1]) * cS + (nh + 1) % H * cH + int64_t(lo[n1]) * cT;
        nx = {K + start, V + start, hi[n1] - lo[n1]};
      }
      switch (D) {
        case 64: item<T, 4>(qf, qb, scale, R, K + base, V + base, cT, a, T_, s.data(), pb.data(), o, l, nx); break;
        case 128: item<T, 8>(qf, qb, scale, R, K + base, V + base, cT, a, T_, s.data(), pb.data(), o, l, nx); break;
        default: generic(qf, R, D, K + base, V + base, cT, a, T_, s.data(), o, l);
      }
    }
  }
}

}  // namespace

extern "C" {
void agent_r1_decode_attention_f32(const float* q, int64_t qN, int64_t qH, int64_t qR, const float* K,
                                   const float* V, int64_t cS, int64_t cH, int64_t cT, const int32_t* slot,
                                   const int32_t* lo, const int32_t* hi, int N, int H, int R, int D,
                                   float scale, float* out, float* lse, int threads) {
  attend(q, qN, qH, qR, K, V, cS, cH, cT, slot, lo, hi, N, H, R, D, scale, out, lse, threads);
}
void agent_r1_decode_attention_bf16(const uint16_t* q, int64_t qN, int64_t qH, int64_t qR, const uint16_t* K,
                                    const uint16_t* V, int64_t cS, int64_t cH, int64_t cT, const int32_t* slot,
                                    const int32_t* lo, const int32_t* hi, int N, int H, int R, int D,
                                    float scale, uint16_t* out, float* lse, int threads) {
  attend(q, qN, qH, qR, K, V, cS, cH, cT, slot, lo, hi, N, H, R, D, scale, out, lse, threads);
}
}
