// One token per row of a logits matrix (float32 or bfloat16, read in place), as
// agent_r1/rollout/sampling.py's sample_batch does without truncation: z = logits / temp,
// greedy rows take the argmax (the first of equal maxima), sampled rows the first token whose
// running sum of exp(z - max) reaches u * (the whole sum) (inverse CDF with the row's uniform u);
// every row's logprob is z[token] - max - log(sum). Three passes over a row that stays in cache
// (max; exponentials and their sum; the running sum up to the draw), all in float32.
// agent_r1_token_logprob: the same logprob of given tokens, through the same two functions for the
// max and the sum (compiled once, so the same bits): the learner's logprobs in deterministic mode
// (agent_r1/engines/embedded/scorer.py), equal to the engine's sampled ones.
// Built and loaded by agent_r1/native.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

namespace {

using agent_r1::load;
using agent_r1::store;

// the row's max of z = x / t and its first argmax
template <typename T>
__attribute__((noinline)) int row_max(const T* x, int V, float t, float* m_out) {
  float m = load(x[0]) / t;
  int arg = 0;
  for (int j = 1; j < V; j++) {
    const float z = load(x[j]) / t;
    if (z > m) m = z, arg = j;
  }
  *m_out = m;
  return arg;
}

// e_j = exp(z_j - m) and their sum (one vectorised reduction order, whoever calls it)
template <typename T>
__attribute__((noinline)) float exp_sum(const T* x, int V, float t, float m, float* e) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < V; j++) {
    e[j] = std::exp(load(x[j]) / t - m);
    sum += e[j];
  }
  return sum;
}

template <typename T>
void sample(const T* logits, int64_t row_stride, int B, int V, const float* temp, const uint8_t* greedy,
            const float* u, int64_t* token, float* logprob, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> e(V);
#pragma omp for schedule(dynamic, 1)
    for (int b = 0; b < B; b++) {
      const T* x = logits + int64_t(b) * row_stride;
      const float t = temp[b];
      float m;
      const int arg = row_max(x, V, t, &m);
      const float sum = exp_sum(x, V, t, m, e.data());
      int tok = arg;
      if (!greedy[b]) {
        const float target = (u[b] > 1e-12f ? u[b] : 1e-12f) * sum;
        float run = 0.0f;
        tok = V - 1;
        for (int j = 0; j < V; j++) {
          run += e[j];
          if (run >= target) {
            tok = j;
            break;
          }
        }
      }
      token[b] = tok;
      logprob[b] = load(x[tok]) / t - m - std::log(sum);
    }
  }
}

template <typename T>
void token_logprob(const T* logits, int64_t row_stride, int B, int V, float t, const int64_t* token,
                   float* logprob, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> e(V);
#pragma omp for schedule(dynamic, 1)
    for (int b = 0; b < B; b++) {
      const T* x = logits + int64_t(b) * row_stride;
      float m;
      row_max(x, V, t, &m);
      const float sum = exp_sum(x, V, t, m, e.data());
      logprob[b] = load(x[token[b]]) / t - m - std::log(sum);
    }
  }
}

}  // namespace

extern "C" {
void agent_r1_sample_f32(const float* logits, int64_t row_stride, int B, int V, const float* temp,
                         const uint8_t* greedy, const float* u, int64_t* token, float* logprob, int threads) {
  sample(logits, row_stride, B, V, temp, greedy, u, token, logprob, threads);
}
void agent_r1_sample_bf16(const uint16_t* logits, int64_t row_stride, int B, int V, const float* temp,
                          const uint8_t* greedy, const float* u, int64_t* token, float* logprob, int threads) {
  sample(logits, row_stride, B, V, temp, greedy, u, token, logprob, threads);
}
void agent_r1_token_logprob_f32(const float* logits, int64_t row_stride, int B, int V, float temp,
                                const int64_t* token, float* logprob, int threads) {
  token_logprob(logits, row_stride, B, V, temp, token, logprob, threads);
}
void agent_r1_token_logprob_bf16(const uint16_t* logits, int64_t row_stride, int B, int V, float temp,
                                 const int64_t* token, float* logprob, int threads) {
  token_logprob(logits, row_stride, B, V, temp, token, logprob, threads);
}
}
