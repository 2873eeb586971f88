// CPU kernel: exact sampling of tag sequences WITH replacement, by forward filtering, backward
// sampling (the replacement=True path of crfkit.sample; its PyTorch form, and the proof that it is
// exact, in crfkit/sampling.py).
//
// For a sentence of length m >= 1, with the forward scores alpha (alpha_0 = start + emit_0,
// alpha_i[t] = logsumexp_s(alpha_{i-1}[s] + trans_i[s, t]) + emit_i[t]):
//     y_{m-1} = argmax_s ((alpha_{m-1}[s] + end[s])                + noise[L-m][b, j, s])
//     y_i     = argmax_s ((alpha_i[s]     + trans_{i+1}[s, y_{i+1}]) + noise[L-1-i][b, j, s])
// for row j of sentence b: each tag drawn from its exact conditional by the Gumbel-max trick.
// The kernel draws no random number: noise (L, B, n, T) holds standard Gumbels in the emissions'
// dtype, drawn by the caller from the user's generator (crfkit.reference.gumbel_noise). noise[k]
// is the k-th step of the right-to-left sweep, position i = L - 1 - k: the order in which the
// PyTorch path draws its (B, n, T) block per position (crfkit/sampling.py), so that the same
// generator gives the same samples on both. Positions at or after a sentence's length use no
// noise.
//
// Arithmetic: the forward scores in double (log_space.h's forward_step: a max, one dot product of
// scaled exponentials per tag, the exact log-space sum where that would underflow), whatever the
// input dtype; a logit is then (alpha_i[s] + trans[s, t]) + noise[s] in double, the association of
// the PyTorch path, and ties go to the smaller tag (torch.argmax's first maximum). In float64 that
// is the PyTorch path's arithmetic up to the rounding of alpha (an ulp or two), so the paths agree
// unless two perturbed logits fall within that of each other (never seen in the tests). In float32
// the PyTorch path rounds alpha and the logits to float32 and this kernel does not: the paths are
// those of the PyTorch path run in float64 on the same (exactly upcast) inputs and noise.
//
// Output: paths (B, n, L) int64, -1 at padded positions; every row of a sentence whose sequences
// are all forbidden (log Z = -inf), and of a length-0 one (its empty sequence), is -1 throughout.
// The paths are integers: nothing to differentiate. The log-probabilities of the samples are the
// front end's sequence_score - log_partition (crfkit.functional.sample), differentiable through
// those ops' own autograd, so this op has no autograd formula.
//
// Transitions (T, T) with start, end (T,), or per example (B, Lt, T, T), Lt = 1 or L, with start,
// end (B, T) (per_example.h; transitions[b, i] scores y_{i-1} -> y_i). Parallel over sentences.
// Cost O(L T^2) for the forward (O(T) exponentials per position with shared or per-sentence
// transitions, O(T^2) with per-position ones) plus O(n L T) for the draws, per sentence.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../tensor.h"
#include "isa.h"
#include "log_space.h"
#include "per_example.h"

namespace crfkit {
namespace cpu {
inline namespace CRFKIT_CPU_ISA {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// noise (seq_len, batch, num_samples, num_tags) of the emissions' dtype and device.
void check_noise_argument(const Tensor& noise, const Tensor& emissions) {
  const int64_t B = emissions.size(0), L = emissions.size(1), T = emissions.size(2);
  CRFKIT_CHECK_VALUE(noise.dim() == 4 && noise.size(0) == L && noise.size(1) == B && noise.size(3) == T,
                     "crfkit: noise must be (seq_len, batch, num_samples, num_tags) = (", L, ", ", B, ", n, ", T,
                     "), got ", noise.sizes());
  CRFKIT_CHECK_TYPE(noise.scalar_type() == emissions.scalar_type(), "crfkit: noise must have the dtype of emissions (",
                    emissions.scalar_type(), "), got ", noise.scalar_type());
  CRFKIT_CHECK(noise.device() == emissions.device(), "crfkit: noise must be on the device of emissions (",
               emissions.device(), "), got ", noise.device());
}

// Whether x[0 .. count) holds NaN or +-inf (on the bits, as checks.h's has_nan_or_posinf: the
// exponent all ones).
template <typename scalar_t>
bool has_non_finite(const scalar_t* x, int64_t count) {
  using bits_t = std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint64_t>;
  constexpr bits_t kInf = sizeof(scalar_t) == 4 ? bits_t(0x7f800000u) : bits_t(0x7ff0000000000000ull);
  bits_t bad = 0;
  for (int64_t k = 0; k < count; ++k) {
    bits_t u;
    std::memcpy(&u, x + k, sizeof u);
    bad |= static_cast<bits_t>((u & kInf) == kInf);
  }
  return bad != 0;
}

// argmax_s ((a[s] + right[s]) + g[s]) over s in [0, T), in double; ties go to the first maximum
// (torch.argmax's rule), and 0 when every value is -inf (never NaN: a and right are finite or -inf,
// g finite).
template <typename scalar_t>
inline int64_t perturbed_argmax(const double* a, const double* right, const scalar_t* g, int64_t T) {
  double best = -std::numeric_limits<double>::infinity();
  int64_t tag = 0;
  for (int64_t s = 0; s < T; ++s) {
    const double v = (a[s] + right[s]) + static_cast<double>(g[s]);
    if (v > best) {
      best = v;
      tag = s;
    }
  }
  return tag;
}

// One (T, T) transition matrix in double, as the sweeps read it: as given ([s][t]) with its
// scaled exponentials by column (log_space.h, for the forward), and transposed ([t][s]: the scores
// into tag t, contiguous, for the draws). load() refills the buffers (per-position transitions).
struct Matrix {
  int64_t T;
  std::vector<double> plain, transposed;
  ScaledTransitions<double> by_column;

  explicit Matrix(int64_t num_tags)
      : T(num_tags), plain(num_tags * num_tags), transposed(num_tags * num_tags),
        by_column(plain.data(), num_tags, /*by_column=*/true) {}

  // The matrix trans (T, T), and with `scaled` ScaledTransitions(plain, T, by_column=true)'s values
  // (the forward's; the draws read `transposed` only), computed into the existing buffers.
  template <typename scalar_t>
  void load(const scalar_t* trans, bool scaled = true) {
    for (int64_t k = 0; k < T * T; ++k) plain[k] = static_cast<double>(trans[k]);
    for (int64_t s = 0; s < T; ++s) {
      for (int64_t t = 0; t < T; ++t) transposed[t * T + s] = plain[s * T + t];
    }
    if (!scaled) return;
    for (int64_t t = 0; t < T; ++t) {
      const double* column = transposed.data() + t * T;  // trans[., t]
      const double top = max_of(column, T);
      by_column.line_max[t] = top;
      for (int64_t s = 0; s < T; ++s) {
        by_column.scaled[t * T + s] = top == kNegInf ? 0.0 : std::exp(column[s] - top);
      }
    }
  }
};

// The dense, checked arguments of one call (both forms of the transitions).
template <typename scalar_t>
struct Inputs {
  int64_t B, L, T, n, Lt;  // Lt = 0 for shared (T, T) transitions
  const scalar_t *emit, *trans, *start, *end, *noise;
  const int64_t* len;

  Inputs(const CrfArgs& a, const Tensor& noise_tensor)
      : B(a.emissions.size(0)), L(a.emissions.size(1)), T(a.emissions.size(2)), n(noise_tensor.size(2)),
        Lt(a.transitions.dim() == 4 ? a.transitions.size(1) : 0), emit(data<scalar_t>(a.emissions)),
        trans(data<scalar_t>(a.transitions)), start(data<scalar_t>(a.start)), end(data<scalar_t>(a.end)),
        noise(data<scalar_t>(noise_tensor)), len(data<int64_t>(a.lengths)) {}

  // Sentence b's transitions into position i >= 1 (per example), its start and end.
  const scalar_t* trans_into(int64_t b, int64_t i) const {
    return trans + (b * Lt + (Lt == 1 ? 0 : i)) * T * T;
  }
  const scalar_t* start_of(int64_t b) const { return start + (Lt ? b * T : 0); }
  const scalar_t* end_of(int64_t b) const { return end + (Lt ? b * T : 0); }
  // The Gumbels of rows 0 .. n of sentence b at position i: (n, T).
  const scalar_t* noise_at(int64_t b, int64_t i) const { return noise + ((L - 1 - i) * B + b) * n * T; }
};

// One thread's space for one sentence at a time.
struct Work {
  std::vector<double> alpha;  // (L, T)
  std::vector<double> emit, end, p;         // (T,)
  std::vector<int64_t> tags;                 // (n,): each row's tag at the position to the right
  Matrix own;                                // the sentence's transitions (per example)
  Work(int64_t L, int64_t T, int64_t n)
      : alpha(std::max<int64_t>(L, 1) * T), emit(T), end(T), p(T), tags(n), own(T) {}
};

// Samples the n rows of sentence b (length m >= 1) into paths (n, L). shared: the (T, T)
// transitions of every sentence, or null for per-example ones (converted here: once for Lt = 1,
// per position for Lt = L, in each sweep). paths is all -1 on entry; only real positions are written.
template <typename scalar_t>
void sample_sentence(const Inputs<scalar_t>& x, int64_t b, const Matrix* shared, Work& w, int64_t* paths) {
  const int64_t T = x.T, L = x.L, n = x.n, m = x.len[b];
  const scalar_t* emit = x.emit + b * L * T;
  const scalar_t* start = x.start_of(b);
  // Per-example transitions, converted when first needed (Lt = 1: in the forward, with its scaled
  // exponentials) or at each position (Lt = L: the backward sweep needs no exponentials).
  int64_t loaded = -1;  // the position whose matrix w.own holds (Lt = L), 0 for the sentence's (Lt = 1)
  auto matrix_into = [&](int64_t i, bool forward) -> const Matrix& {
    if (shared != nullptr) return *shared;
    const int64_t key = x.Lt == 1 ? 0 : i;
    if (loaded != key) {
      w.own.load(x.trans_into(b, i), forward || x.Lt == 1);
      loaded = key;
    }
    return w.own;
  };

  // Forward, in double.
  double* alpha = w.alpha.data();
  for (int64_t t = 0; t < T; ++t) alpha[t] = static_cast<double>(start[t]) + static_cast<double>(emit[t]);
  for (int64_t i = 1; i < m; ++i) {
    const Matrix& into = matrix_into(i, /*forward=*/true);
    for (int64_t t = 0; t < T; ++t) w.emit[t] = static_cast<double>(emit[i * T + t]);
    forward_step<double>(alpha + (i - 1) * T, into.plain.data(), into.by_column, w.emit.data(), alpha + i * T,
                         w.p.data());
  }
  const scalar_t* end = x.end_of(b);
  for (int64_t t = 0; t < T; ++t) w.end[t] = static_cast<double>(end[t]);
  // Every sequence forbidden (log Z = -inf): no row holds a sequence, paths stay -1.
  bool any = false;
  for (int64_t t = 0; t < T; ++t) any |= alpha[(m - 1) * T + t] + w.end[t] > kNegInf;
  if (!any) return;

  // Backward sampling, right to left; row j of the output is paths[j * L ...].
  for (int64_t i = m - 1; i >= 0; --i) {
    const double* a = alpha + i * T;
    const scalar_t* noise = x.noise_at(b, i);
    const Matrix* into = i + 1 < m ? &matrix_into(i + 1, /*forward=*/false) : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      // The scores of each tag s at i with the tag to its right: end, or trans_{i+1}[s, y_{i+1}].
      const double* right = into == nullptr ? w.end.data() : into->transposed.data() + w.tags[j] * T;
      const int64_t tag = perturbed_argmax(a, right, noise + j * T, T);
      w.tags[j] = tag;
      paths[j * L + i] = tag;
    }
  }
}

}  // namespace

// paths (B, n, L) int64 for noise (L, B, n, T): see the top of this file.
Tensor sample_with_replacement_cpu(const Tensor& emissions_in, const Tensor& transitions_in, const Tensor& noise_in,
                                   const Tensor& lengths_in, const Tensor& start_in, const Tensor& end_in) {
  const CrfArgs a = transitions_in.dim() == 4
                        ? checked_per_example_args(emissions_in, transitions_in, lengths_in, start_in, end_in)
                        : checked_cpu_args(emissions_in, transitions_in, lengths_in, start_in, end_in);
  const Tensor noise = as_contiguous(noise_in);
  check_noise_argument(noise, a.emissions);
  const int64_t B = a.emissions.size(0), L = a.emissions.size(1), T = a.emissions.size(2), n = noise.size(2);
  auto paths = full({B, n, L}, -1, options_of(a.lengths));
  if (B == 0 || L == 0 || n == 0) return paths;
  std::vector<char> bad_emissions(B, 0), bad_noise(B, 0);
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_sample_with_replacement", [&] {
    const Inputs<scalar_t> x(a, noise);
    std::vector<Matrix> shared;  // shared (T, T) transitions: converted once for every sentence
    if (x.Lt == 0) {
      shared.emplace_back(T);
      shared.front().load(x.trans);
    }
    int64_t* out = data<int64_t>(paths);
    parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
      Work work(L, T, n);
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t m = x.len[b];
        if (has_nan_or_posinf(x.emit + b * L * T, m * T)) {
          bad_emissions[b] = 1;
          continue;
        }
        bool noise_ok = true;
        for (int64_t i = 0; i < m && noise_ok; ++i) noise_ok = !has_non_finite(x.noise_at(b, i), n * T);
        if (!noise_ok) {
          bad_noise[b] = 1;
          continue;
        }
        if (m > 0) sample_sentence(x, b, shared.empty() ? nullptr : &shared.front(), work, out + b * n * L);
      }
    });
  });
  raise_if_bad_emissions(bad_emissions);
  for (int64_t b = 0; b < B; ++b) {
    CRFKIT_CHECK_VALUE(!bad_noise[b], "crfkit: noise[:, ", b,
                       "] contains NaN or +-inf within the sentence's length (noise holds standard Gumbels)");
  }
  return paths;
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
