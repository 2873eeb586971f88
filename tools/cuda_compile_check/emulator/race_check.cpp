// Runs every emulated CUDA op (crfkit_emu::*, see cuda_emulator.h) on a set of shapes, built
// with -fsanitize=thread by `build.py --race-check`: ThreadSanitizer then reports any two
// accesses of different lanes to the same memory that no barrier (__syncwarp / __syncthreads /
// shuffle) orders, i.e. a missing synchronisation in a kernel, whatever the timing of the run.
// A standalone program because the sanitizer's runtime cannot be preloaded into Python here.
// Exit status 0 when every op ran (the sanitizer's own exit code reports races).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

namespace {

using Tensor = at::Tensor;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Inputs {
  Tensor emissions, transitions, start, end, lengths;
};

// Ragged lengths with 0 and L; -inf transitions when `forbid`.
Inputs make(int64_t B, int64_t L, int64_t T, at::ScalarType dtype, bool forbid) {
  Inputs x;
  x.emissions = at::randn({B, L, T}, at::TensorOptions().dtype(dtype)) * 2;
  x.transitions = at::randn({T, T}, at::TensorOptions().dtype(dtype));
  x.start = at::randn({T}, at::TensorOptions().dtype(dtype));
  x.end = at::randn({T}, at::TensorOptions().dtype(dtype));
  x.lengths = at::randint(0, L + 1, {B}, at::TensorOptions().dtype(at::kLong));
  if (B > 0) x.lengths[0] = L;
  if (B > 2) x.lengths[1] = 0;
  if (forbid && T > 1) {
    x.transitions.masked_fill_(at::rand({T, T}) < 0.3, -std::numeric_limits<double>::infinity());
  }
  return x;
}

// The same CRF with per-example parameters: transitions (B, Lt, T, T) (Lt = 1: per sentence, L:
// per position), start and end (B, T), each example's drawn afresh.
Inputs make_per_example(int64_t B, int64_t L, int64_t T, int64_t Lt, at::ScalarType dtype, bool forbid) {
  Inputs x = make(B, L, T, dtype, forbid);
  const auto options = at::TensorOptions().dtype(dtype);
  x.transitions = at::randn({B, Lt, T, T}, options);
  x.start = at::randn({B, T}, options);
  x.end = at::randn({B, T}, options);
  if (forbid && T > 1) {
    x.transitions.masked_fill_(at::rand({B, Lt, T, T}) < 0.3, -std::numeric_limits<double>::infinity());
  }
  return x;
}

// Every op on x; marginals_backward (a second derivative) only where `second_derivatives`: it
// takes shared transitions only.
void run_all(const Inputs& x, int64_t k, bool second_derivatives = true) {
  using Crf = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  using Decode = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  using KDecode = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, const Tensor&, const Tensor&,
                                             const Tensor&);
  using Grads = std::tuple<Tensor, Tensor, Tensor, Tensor>;
  using Backward = Grads(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  using Score = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  using ScoreBackward = Grads(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  using WithMarginals = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                           const Tensor&, const Tensor&);
  using FromMarginals = Grads(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  using KDecodeLogProbs = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, const Tensor&,
                                                             const Tensor&, const Tensor&);
  const int64_t B = x.emissions.size(0);
  op<Crf>("crfkit_emu::log_partition").call(x.emissions, x.transitions, x.lengths, x.start, x.end);
  op<Crf>("crfkit_emu::marginals").call(x.emissions, x.transitions, x.lengths, x.start, x.end);
  if (second_derivatives) {
    op<Backward>("crfkit_emu::marginals_backward")
        .call(at::randn_like(x.emissions), x.emissions, x.transitions, x.lengths, x.start, x.end);
  }
  op<Backward>("crfkit_emu::log_partition_backward")
      .call(at::ones({B}, x.emissions.options()), x.emissions, x.transitions, x.lengths, x.start, x.end);
  auto [log_z, marginals, counts] = op<WithMarginals>("crfkit_emu::log_partition_with_marginals")
                                        .call(x.emissions, x.transitions, x.lengths, x.start, x.end);
  op<FromMarginals>("crfkit_emu::log_partition_backward_from_marginals")
      .call(at::ones_like(log_z), marginals, counts, x.lengths);
  op<Crf>("crfkit_emu::expected_transition_counts").call(x.emissions, x.transitions, x.lengths, x.start, x.end);
  op<Decode>("crfkit_emu::viterbi").call(x.emissions, x.transitions, x.lengths, x.start, x.end);
  op<KDecodeLogProbs>("crfkit_emu::kbest_viterbi_with_log_probs")
      .call(x.emissions, x.transitions, k, x.lengths, x.start, x.end);
  auto [scores, paths] =
      op<KDecode>("crfkit_emu::kbest_viterbi").call(x.emissions, x.transitions, k, x.lengths, x.start, x.end);
  op<Score>("crfkit_emu::sequence_score").call(x.emissions, x.transitions, paths.clamp_min(0), x.lengths, x.start, x.end);
  op<ScoreBackward>("crfkit_emu::sequence_score_backward").call(at::ones_like(scores), x.emissions, paths, x.lengths);
}

struct Shape {
  int64_t B, L, T, k;
  bool forbid;
};

void print_shape(const Shape& s, at::ScalarType dtype, const char* note) {
  std::printf("B=%ld L=%ld T=%ld k=%ld %s %s%s\n", (long)s.B, (long)s.L, (long)s.T, (long)s.k,
              s.forbid ? "forbid" : "", dtype == at::kFloat ? "float" : "double", note);
  std::fflush(stdout);
}

// k-best's second kernel (kbest_per_tag_kernel, opt-in through CRFKIT_CUDA_KBEST_KERNEL): its
// block barriers, on shapes with 16 and 32 lanes per tag and backpointers in shared and in
// global memory.
void run_kbest_per_tag() {
  using KDecode = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, const Tensor&, const Tensor&,
                                             const Tensor&);
  setenv("CRFKIT_CUDA_KBEST_KERNEL", "per_tag", 1);
  const Shape shapes[] = {{5, 7, 3, 4, false}, {9, 12, 9, 15, true}, {3, 9, 17, 5, false}, {2, 90, 16, 17, false},
                          {4, 5, 1, 3, false}, {6, 0, 4, 2, false}};
  for (const Shape& s : shapes) {
    print_shape(s, at::kFloat, " (k-best per tag)");
    const Inputs x = make(s.B, s.L, s.T, at::kFloat, s.forbid);
    op<KDecode>("crfkit_emu::kbest_viterbi").call(x.emissions, x.transitions, s.k, x.lengths, x.start, x.end);
  }
  unsetenv("CRFKIT_CUDA_KBEST_KERNEL");
}

// marginals_backward alone (its kernel publishes rows between lanes with __syncwarp): T below,
// at and above a warp, an all-forbidden line, batches larger than the grid's warps.
void run_marginals_backward() {
  using Backward = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                              const Tensor&, const Tensor&, const Tensor&);
  const Shape shapes[] = {{5, 7, 3, 0, true}, {20, 9, 9, 0, false}, {3, 6, 33, 0, true}, {2, 4, 70, 0, false}};
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const Shape& s : shapes) {
      print_shape(s, dtype, " (marginals_backward)");
      const Inputs x = make(s.B, s.L, s.T, dtype, s.forbid);
      op<Backward>("crfkit_emu::marginals_backward")
          .call(at::randn_like(x.emissions), x.emissions, x.transitions, x.lengths, x.start, x.end);
    }
  }
}

// Both samplers alone (csrc/cuda/sampling.cu: rows published between lanes with __syncwarp, the
// beams of two generations): T below and above a warp, n below and above it, forbidden
// transitions, batches larger than the grid's warps, empty sentences.
void run_samplers_on(const Inputs& x, int64_t n) {
  using Sample = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
  const Tensor u = at::rand({x.emissions.size(1), x.emissions.size(0), n, x.emissions.size(2)},
                            x.emissions.options()).clamp_min(1e-30);
  const Tensor noise = -(-u.log()).log();
  for (const char* name : {"crfkit_emu::sample_with_replacement", "crfkit_emu::sample_without_replacement"}) {
    op<Sample>(name).call(x.emissions, x.transitions, noise, x.lengths, x.start, x.end);
  }
}

void run_samplers() {
  const Shape shapes[] = {{5, 7, 3, 4, true}, {20, 9, 9, 40, false}, {3, 6, 37, 5, true}, {4, 5, 1, 3, false},
                          {6, 0, 4, 2, false}};
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const Shape& s : shapes) {
      print_shape(s, dtype, " (samplers; k = n)");
      run_samplers_on(make(s.B, s.L, s.T, dtype, s.forbid), s.k);
    }
  }
}

// Per-example transitions (csrc/cuda/per_example.cu, and the per-example strides of
// sequence_score.cu and sampling.cu): per sentence and per position; T below, at and above a
// warp; k and n above the warp; batches larger than the grid's warps; empty sentences.
void run_per_example() {
  const Shape shapes[] = {{5, 7, 3, 4, true}, {40, 6, 9, 15, false}, {3, 5, 33, 40, true}, {4, 5, 1, 3, false},
                          {6, 0, 4, 2, false}};
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const Shape& s : shapes) {
      for (const int64_t Lt : {int64_t{1}, s.L}) {
        if (Lt == 0) continue;
        print_shape(s, dtype, Lt == 1 ? " (per sentence)" : " (per position)");
        const Inputs x = make_per_example(s.B, s.L, s.T, Lt, dtype, s.forbid);
        run_all(x, s.k, /*second_derivatives=*/false);
        run_samplers_on(x, s.k);
      }
    }
  }
}

}  // namespace

// `race_check --kbest-per-tag` runs only run_kbest_per_tag, `race_check --marginals-backward`
// only run_marginals_backward, `race_check --samplers` only run_samplers, `race_check
// --per-example` only run_per_example (a few minutes each instead of 40).
int main(int argc, char** argv) {
  at::manual_seed(0);
  at::set_num_threads(1);  // torch's own thread pool is not what is checked here
  if (argc > 1 && std::strcmp(argv[1], "--samplers") == 0) {
    run_samplers();
    std::printf("all ops ran\n");
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "--per-example") == 0) {
    run_per_example();
    std::printf("all ops ran\n");
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "--marginals-backward") == 0) {
    run_marginals_backward();
    std::printf("all ops ran\n");
    return 0;
  }
  run_kbest_per_tag();
  if (argc > 1 && std::strcmp(argv[1], "--kbest-per-tag") == 0) {
    std::printf("all ops ran\n");
    return 0;
  }
  const Shape shapes[] = {
      {5, 7, 3, 4, false},    {9, 12, 9, 15, true},  {3, 6, 37, 5, false}, {70, 4, 2, 3, true},
      {3, 3, 100, 100, false}, {2, 3, 300, 2, false}, {4, 5, 1, 3, false},  {6, 0, 4, 2, false},
  };
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const Shape& s : shapes) {
      print_shape(s, dtype, "");
      run_all(make(s.B, s.L, s.T, dtype, s.forbid), s.k);
    }
  }
  run_samplers();
  run_per_example();
  // The error paths: NaN emissions (reported by the kernels themselves).
  Inputs bad = make(3, 4, 3, at::kFloat, false);
  bad.emissions[0][1][2] = std::numeric_limits<float>::quiet_NaN();
  try {
    run_all(bad, 3);
    std::printf("NaN emissions were not reported\n");
    return 1;
  } catch (const c10::Error& error) {
    std::printf("bad input raised: %s\n", std::string(error.what_without_backtrace()).substr(0, 80).c_str());
  }
  std::printf("all ops ran\n");
  return 0;
}
