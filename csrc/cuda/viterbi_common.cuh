// What the CUDA decoders, Viterbi (viterbi.cu) and k-best Viterbi (kbest.cu), share: their
// launch parameters, the launch itself and the size checks; their kernels' driver, templated on
// the semiring, is decode_sentences (semiring.cuh).
//
// The decoders: Viterbi and exact k-best Viterbi, the whole time loop and the backtrace in
// one launch, with results identical to the CPU kernels (csrc/cpu/viterbi.cpp, kbest.cpp) bit
// for bit.
//
// Identical because the arithmetic is: scores are only ever added, in the same order as the
// CPU kernels and crfkit.reference (score_i = (score_{i-1} + trans[s, t]) + emit[i, t]), and
// IEEE additions and comparisons are exact operations (no multiply, so no FMA contraction),
// and the candidates are compared in the same order with the same strict '>', which is the
// tie rule: among equal scores the smaller predecessor tag wins, within one predecessor's
// list the earlier rank wins, and the final choice over last tags prefers the smaller tag
// (sequences of equal score come out ordered by their tags read from the last position
// backwards, smaller first).
//
// Layout: one group of G lanes per sentence (common.cuh), lane l owns tags l, l + G, ...
// Viterbi: the group's arena holds delta (two rows of T); per position and tag one lane scans
// the T predecessors. k-best: the arena holds the K-lists of every tag (two rows of T x K,
// sorted descending) and, per lane, the merge state of the tag it is working on (the next
// candidate of each predecessor's list and how far that list was taken, T entries each); per
// position and tag one lane merges the T sorted lists into the K best, exactly as the CPU
// kbest_step. Backpointers (predecessor tag, or code = predecessor tag * K + rank) go to a
// per-group (L, T[, K]) workspace in the smallest unsigned type that holds them; the final
// merge over end tags runs on the group's first lane, then the lanes backtrace the K rows
// in parallel (one row per lane). The transitions are staged in shared memory when they fit.
// For small batches k-best has a second layout, a block per sentence and a group of lanes per
// tag (kbest_per_tag_kernel in kbest.cu; opt-in until timed on a GPU, see KbestKernel).
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "common.cuh"
#include "semiring.cuh"  // decode_sentences, the driver both decoders run

namespace crfkit {
namespace cuda {

template <typename scalar_t, typename bp_t>
struct DecodeParams {
  const scalar_t* emissions;    // (B, L, T)
  const scalar_t* transitions;  // (T, T)
  const scalar_t* start;        // (T,)
  const scalar_t* end;          // (T,)
  const int64_t* lengths;       // (B,)
  scalar_t* scores;             // (B, rows)
  const scalar_t* log_z;        // (B,) or null: with it, k-best also writes
  scalar_t* log_probs;          // (B, rows) = scores - max(log_z, lowest finite)
  int64_t* paths;               // (B, rows, L), written whole by the kernel (-1 where no tag)
  bp_t* backpointers;           // (slots, L, T, K)
  unsigned char* arena_workspace;  // (slots, arena_bytes) when the arenas are not in shared memory
  long long* status;
  int64_t batch, max_len;
  int64_t rows;      // k requested (rows of the output), >= K
  int64_t list_len;  // K = min(k, T^L): longer lists would only hold -inf
  int num_tags;
  SharedPlan plan;
  size_t arena_bytes;
  InputChecks<scalar_t> checks;  // run by the kernel first (check_inputs)
};

// Backpointer workspaces are per group of a persistent launch; cap their total so that a huge
// L * T * K does not allocate gigabytes (fewer groups then run at once; results are the same).
constexpr int64_t kBackpointerBudget = int64_t{256} << 20;

// k-best's log-probabilities, written by its kernel with the scores: log_z (B,) in, log_probs
// (B, k) out (both undefined: none).
struct LogProbOutputs {
  Tensor log_z, log_probs;
};

// The parameters every decoder launch shares (the arena fields stay at their defaults: no
// arena); `backpointers` is the global workspace, undefined when the kernel keeps them in
// shared memory.
template <typename scalar_t, typename bp_t>
DecodeParams<scalar_t, bp_t> decode_params(const CrfArgs& a, int64_t rows, int64_t K, Tensor& scores,
                                           Tensor& paths, const Tensor& backpointers, Status& status,
                                           const LogProbOutputs& log_probs = {}) {
  DecodeParams<scalar_t, bp_t> params{};
  set_crf_arguments<scalar_t>(params, a, status);
  params.scores = scores.mutable_data_ptr<scalar_t>();
  params.log_z = log_probs.log_z.defined() ? log_probs.log_z.mutable_data_ptr<scalar_t>() : nullptr;
  params.log_probs = log_probs.log_probs.defined() ? log_probs.log_probs.mutable_data_ptr<scalar_t>() : nullptr;
  params.paths = paths.mutable_data_ptr<int64_t>();
  params.backpointers = backpointers.defined() ? reinterpret_cast<bp_t*>(backpointers.mutable_data_ptr<uint8_t>()) : nullptr;
  params.rows = rows;
  params.list_len = K;
  params.checks = input_checks<scalar_t>(a, status);
  return params;
}

// shared_kernel / generic_kernel: the decoder's kAllShared = true / false variants.
template <typename scalar_t, typename bp_t, typename Kernel>
void launch_decoder(Kernel shared_kernel, Kernel generic_kernel, const CrfArgs& a, int64_t rows, int64_t K,
                    size_t arena_bytes, Tensor& scores, Tensor& paths, Status& status,
                    const LogProbOutputs& log_probs = {}) {
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2);
  if (B == 0) return;
  const SharedPlan plan = plan_shared(T, arena_bytes, 0, align_up(T * T * sizeof(scalar_t)));
  const Kernel kernel = all_in_shared(plan, false) ? shared_kernel : generic_kernel;
  const int64_t per_block = std::max<int64_t>(1, plan.groups_per_block * L * T * K * (int64_t)sizeof(bp_t));
  const int64_t blocks = persistent_blocks(kernel, plan, B, std::max<int64_t>(1, kBackpointerBudget / per_block));
  const int64_t slots = blocks * plan.groups_per_block;
  const auto bytes = options_of(a.emissions).dtype(kByte);
  Tensor backpointers = empty({std::max<int64_t>(1, slots * L * T * K * (int64_t)sizeof(bp_t))}, bytes);
  Tensor arena_workspace = plan.arena_in_shared ? Tensor() : empty({slots * (int64_t)arena_bytes}, bytes);

  auto params = decode_params<scalar_t, bp_t>(a, rows, K, scores, paths, backpointers, status, log_probs);
  params.arena_workspace = arena_workspace.defined() ? arena_workspace.mutable_data_ptr<uint8_t>() : nullptr;
  params.plan = plan;
  params.arena_bytes = arena_bytes;
  kernel<<<(unsigned)blocks, plan.threads, plan.shared_bytes, current_stream()>>>(params);
  CRFKIT_CUDA_KERNEL_LAUNCH_CHECK();
}

inline void check_sizes(int64_t T, int64_t K) {
  // Table indices s * T + t and codes s * K + rank are 32-bit.
  CRFKIT_CHECK_VALUE(T * T < (int64_t{1} << 31) && T * K < (int64_t{1} << 31),
                    "crfkit: the CUDA kernels need num_tags^2 and num_tags * k below 2^31, got num_tags = ", T,
                    ", k = ", K);
}

// Number of tag sequences of length L, saturated at `cap` (k-best's list length, as the CPU
// kernels'; kbest.cu, per_example.cu).
inline int64_t num_sequences_capped(int64_t T, int64_t L, int64_t cap) {
  int64_t count = 1;
  for (int64_t i = 0; i < L && count < cap; ++i) count = count > cap / T ? cap : count * T;
  return std::min(count, cap);
}

// log_probs (B, k) = scores (B, k) - log Z (B,), log Z clamped to the lowest finite value as
// reference.log_probs_from_scores does (so missing rows stay -inf); kbest.cu.
Tensor log_probs_from_scores(const Tensor& scores, const Tensor& log_z);

// Viterbi's launch (viterbi.cu), for arguments checked by checked_cuda_args, their values
// checked into `status` by its first kernel (input_checks); k-best's launch (kbest.cu) runs it for k = 1.
// scores (B,), paths (B, L) int64 (-1 at padded positions and where no sequence is allowed).
std::tuple<Tensor, Tensor> launch_viterbi(const CrfArgs& a, Status& status);

}  // namespace cuda
}  // namespace crfkit
