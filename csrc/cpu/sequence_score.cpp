// CPU kernels: the score of given tag sequences and its gradient (a scatter of ones).
//
// tags (B, N, L) int64: N candidate sequences per sentence (N = 1 for gold tags, N = K for
// k-best paths). The score is accumulated in the same order as the Viterbi kernels (see
// viterbi.cpp), so the score of a decoded path equals the decoder's score bit for bit.


#include "../tensor.h"
#include "../checks.h"
#include "isa.h"
#include "per_example.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {
// (B, N): score of each sequence; 0 for a length-0 sentence.
Tensor sequence_score_cpu(const Tensor& emissions_in, const Tensor& transitions_in,
                              const Tensor& tags_in, const Tensor& lengths_in,
                              const Tensor& start_in, const Tensor& end_in) {
  if (transitions_in.dim() == 4) {  // per-example transitions: per_example.cpp
    return sequence_score_per_example(emissions_in, transitions_in, tags_in, lengths_in, start_in, end_in);
  }
  const Tensor tags = as_contiguous(tags_in);
  const auto [emissions, transitions, lengths, start, end] =
      checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  check_tags(tags, emissions);
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  const int64_t N = tags.size(1);
  auto scores = empty({B, N}, options_of(emissions));
  const int64_t* len = lengths.mutable_data_ptr<int64_t>();
  const int64_t* tag = tags.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < N; ++j) check_tag_row(tag + (b * N + j) * L, len[b], T, b, j);
  }
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_sequence_score", [&] {
    const scalar_t* emit = emissions.mutable_data_ptr<scalar_t>();
    const scalar_t* trans = transitions.mutable_data_ptr<scalar_t>();
    const scalar_t* st = start.mutable_data_ptr<scalar_t>();
    const scalar_t* en = end.mutable_data_ptr<scalar_t>();
    scalar_t* out = scores.mutable_data_ptr<scalar_t>();
    // The same NaN / +inf rule as every other op, although a score reads one tag per position.
    std::vector<char> bad(B, 0);
    for (int64_t b = 0; b < B; ++b) bad[b] = has_nan_or_posinf(emit + b * L * T, len[b] * T);
    raise_if_bad_emissions(bad);
    parallel_for(0, B * N, 64, [&](int64_t row_begin, int64_t row_end) {
      for (int64_t row = row_begin; row < row_end; ++row) {
        const int64_t b = row / N, n = len[b];
        const int64_t* y = tag + row * L;
        const scalar_t* e = emit + b * L * T;
        if (n == 0) {
          out[row] = 0;
          continue;
        }
        scalar_t score = st[y[0]] + e[y[0]];
        for (int64_t i = 1; i < n; ++i) score = (score + trans[y[i - 1] * T + y[i]]) + e[i * T + y[i]];
        out[row] = score + en[y[n - 1]];
      }
    });
  });
  return scores;
}

// Gradients of sum_{b, j} grad_scores[b, j] * score(tags[b, j]). Rows whose first tag is -1
// (k-best rows that hold no sequence) contribute nothing.
std::tuple<Tensor, Tensor, Tensor, Tensor> sequence_score_backward_cpu(
    const Tensor& grad_scores_in, const Tensor& emissions, const Tensor& tags_in,
    const Tensor& lengths_in) {
  // emissions only give the shape and dtype of the gradient; nothing of them is read.
  const Tensor grad_scores = as_contiguous(grad_scores_in);
  const Tensor lengths = as_contiguous(lengths_in);
  const Tensor tags = as_contiguous(tags_in);
  check_emissions_argument(emissions);
  check_tags(tags, emissions);
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  const int64_t N = tags.size(1);
  check_argument_like(grad_scores, "grad_scores", "(batch, num_sequences)", {B, N}, emissions, "emissions");
  check_lengths_argument(lengths, B, emissions);
  check_lengths_cpu(lengths, L);
  const int64_t* len = lengths.mutable_data_ptr<int64_t>();
  const int64_t* tag = tags.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < N; ++j) {
      const int64_t* y = tag + (b * N + j) * L;
      if (len[b] > 0 && y[0] != -1) check_tag_row(y, len[b], T, b, j);
    }
  }
  auto grad_emissions = zeros_like(emissions);
  auto grad_trans = zeros({B, T, T}, options_of(emissions));
  auto grad_start = zeros({B, T}, options_of(emissions));
  auto grad_end = zeros({B, T}, options_of(emissions));
  CRFKIT_DISPATCH_FLOATING_TYPES(emissions.scalar_type(), "crfkit_sequence_score_backward", [&] {
    const scalar_t* g = grad_scores.mutable_data_ptr<scalar_t>();
    scalar_t* ge = grad_emissions.mutable_data_ptr<scalar_t>();
    scalar_t* gt = grad_trans.mutable_data_ptr<scalar_t>();
    scalar_t* gs = grad_start.mutable_data_ptr<scalar_t>();
    scalar_t* gn = grad_end.mutable_data_ptr<scalar_t>();
    parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t n = len[b];
        if (n == 0) continue;
        for (int64_t j = 0; j < N; ++j) {
          const int64_t* y = tag + (b * N + j) * L;
          const scalar_t w = g[b * N + j];
          if (y[0] == -1 || w == 0) continue;
          gs[b * T + y[0]] += w;
          gn[b * T + y[n - 1]] += w;
          for (int64_t i = 0; i < n; ++i) ge[(b * L + i) * T + y[i]] += w;
          for (int64_t i = 1; i < n; ++i) gt[(b * T + y[i - 1]) * T + y[i]] += w;
        }
      }
    });
  });
  return {grad_emissions, sum_first_dim(grad_trans), sum_first_dim(grad_start), sum_first_dim(grad_end)};
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
