// CPU kernels: exact sampling of tag sequences from a linear-chain CRF, WITH replacement by forward
// filtering, backward sampling, and WITHOUT replacement by stochastic beam search (the two paths of
// crfkit.sample; their PyTorch form, and the proof that both are exact, in crfkit/sampling.py).
//
// WITH replacement (sample_with_replacement):
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
//
// WITHOUT replacement (sample_without_replacement; crfkit/sampling.py's _without_replacement,
// where the algorithm and its exactness are explained): n DISTINCT sequences per sentence, an exact
// sample without replacement, by stochastic beam search (the Gumbel-top-k trick over the same
// right-to-left factorisation; Kool, van Hoof and Welling, ICML 2019). Per sentence, beams j (at
// most n, in descending order of their perturbed value key_j; before the first step one beam, the
// empty suffix, phi = key = 0) are extended right to left. At position i every child s of beam j
// (tag s at i) gets
//     phi_c = phi_j + ((alpha_i[s] + right[s]) - norm)     log P of the extended suffix
//     g_c   = phi_c + noise[L-1-i][b, j, s]                 an unconditioned perturbed value
//     key_c = key_j - softplus(v),  v = (key_j - g_c) + log1mexp(g_c - max_s g)
// (right = end and norm = log Z at i = m - 1; right = trans_{i+1}[., tag_j] and norm =
// logsumexp_s(alpha_i[s] + trans_{i+1}[s, tag_j]), the forward's score into tag_j before its
// emission, below), and the n children of largest key_c over all beams become the next beams,
// sorted. That is the arithmetic of crfkit/sampling.py, operation for operation (log1mexp's two
// branches at -log 2, softplus's threshold 40), in double. The noise is the same (L, B, n, T)
// standard Gumbels as with replacement: the PyTorch path draws a (B, n, T) block per position for
// every beam and sentence, live or not, before it conditions them on the parents' values, so the
// conditioning is a function of the given noise, and a generator seeded alike gives both paths the
// same rows: in float64 bit for bit (up to two keys within an ulp or so of each other, which
// rounding may order differently: torch's vectorised exp / log differ from the C library's in the
// last bit), in float32 those of the PyTorch path run in float64 on the upcast inputs and noise.
// Ties (equal keys) go to the smaller code j * T + s; torch.topk leaves the order of ties open,
// but only impossible children (key -inf, never kept here: their rows are -1) tie in practice.
//
// What this kernel saves over the PyTorch path is the transcendentals (the PyTorch path conditions
// all n T children; only the n best matter). key_c increases with g_c, the children at a beam's
// maximum get key_j exactly, and every other child less: so the argmax children go into a heap of
// the n best at no cost, then each beam's other children, in descending order of g_c, until the
// first that does not enter; a beam with key_j <= h (h the n-th best key so far) is not scanned at
// all (nor, the beams being sorted, any after it), and a child with g_c <= min(h, max_s g) - log 2
// (minus a margin far above rounding; key_c = -log(exp(-key_j) - exp(-max g) + exp(-g_c)) cannot
// exceed h there) is never scored. The exact top n of the n T children, from O(n T) additions and
// about O(n) logarithms per position (the scan's early stop trusts the rounded key_c to increase
// with g_c, which it does but within an ulp: the same near-ties as above). Rows after the last
// allowed sequence (n larger than their number) and every row of a sentence with no allowed
// sequence or of length 0 are -1 (crfkit.sampling.missing_rows tells them apart). Cost O(L T^2)
// for the forward plus O(n L T) per sentence, O(L n) integers of back-pointers.

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
  std::vector<double> alpha;                 // (L, T)
  std::vector<double> into;                  // (L, T), without replacement only: see forward_scores
  std::vector<double> emit, end, p, zeros;   // (T,)
  std::vector<int64_t> tags;                 // (n,): each row's tag at the position to the right
  Matrix own;                                // the sentence's transitions (per example)
  Work(int64_t L, int64_t T, int64_t n, bool with_into)
      : alpha(std::max<int64_t>(L, 1) * T), into(with_into ? std::max<int64_t>(L, 1) * T : 0), emit(T), end(T), p(T),
        zeros(T, 0.0), tags(n), own(T) {}
};

// Sentence b's transition matrices as the sweeps read them: the shared (T, T) one, or the
// sentence's own (per example), converted into `own` when first needed (Lt = 1: once, with its
// scaled exponentials; Lt = L: at each position, the backward sweep needing no exponentials).
template <typename scalar_t>
class SentenceTransitions {
 public:
  SentenceTransitions(const Inputs<scalar_t>& x, int64_t b, const Matrix* shared, Matrix& own)
      : x_(x), b_(b), shared_(shared), own_(own) {}

  // The transitions into position i >= 1; `forward`: with the forward's scaled exponentials.
  const Matrix& into(int64_t i, bool forward) {
    if (shared_ != nullptr) return *shared_;
    const int64_t key = x_.Lt == 1 ? 0 : i;
    if (loaded_ != key) {
      own_.load(x_.trans_into(b_, i), forward || x_.Lt == 1);
      loaded_ = key;
    }
    return own_;
  }

 private:
  const Inputs<scalar_t>& x_;
  int64_t b_;
  const Matrix* shared_;
  Matrix& own_;
  int64_t loaded_ = -1;  // the position whose matrix own_ holds (Lt = L), 0 for the sentence's (Lt = 1)
};

// The forward scores of sentence b (length m >= 1) into w.alpha (m, T), in double, and its end
// scores into w.end. With record_into, also w.into[i, t] = logsumexp_s(alpha[i-1, s] + trans_i[s, t])
// for 1 <= i < m: alpha[i, t] before its emission, the normaliser of P(y_{i-1} | y_i = t); alpha[i]
// is then into[i] + emit[i], the very bits forward_step gives with the emissions added in.
template <typename scalar_t>
void forward_scores(const Inputs<scalar_t>& x, int64_t b, SentenceTransitions<scalar_t>& trans, Work& w,
                    bool record_into) {
  const int64_t T = x.T, L = x.L, m = x.len[b];
  const scalar_t* emit = x.emit + b * L * T;
  const scalar_t* start = x.start_of(b);
  double* alpha = w.alpha.data();
  for (int64_t t = 0; t < T; ++t) alpha[t] = static_cast<double>(start[t]) + static_cast<double>(emit[t]);
  for (int64_t i = 1; i < m; ++i) {
    const Matrix& into = trans.into(i, /*forward=*/true);
    for (int64_t t = 0; t < T; ++t) w.emit[t] = static_cast<double>(emit[i * T + t]);
    if (!record_into) {
      forward_step<double>(alpha + (i - 1) * T, into.plain.data(), into.by_column, w.emit.data(), alpha + i * T,
                           w.p.data());
      continue;
    }
    double* lse = w.into.data() + i * T;
    forward_step<double>(alpha + (i - 1) * T, into.plain.data(), into.by_column, w.zeros.data(), lse, w.p.data());
    for (int64_t t = 0; t < T; ++t) alpha[i * T + t] = lse[t] + w.emit[t];
  }
  const scalar_t* end = x.end_of(b);
  for (int64_t t = 0; t < T; ++t) w.end[t] = static_cast<double>(end[t]);
}

// Samples the n rows of sentence b (length m >= 1) with replacement into paths (n, L). shared: the
// (T, T) transitions of every sentence, or null for per-example ones. paths is all -1 on entry;
// only real positions are written.
template <typename scalar_t>
void sample_sentence(const Inputs<scalar_t>& x, int64_t b, const Matrix* shared, Work& w, int64_t* paths) {
  const int64_t T = x.T, L = x.L, n = x.n, m = x.len[b];
  SentenceTransitions<scalar_t> trans(x, b, shared, w.own);
  forward_scores(x, b, trans, w, /*record_into=*/false);
  const double* alpha = w.alpha.data();
  // Every sequence forbidden (log Z = -inf): no row holds a sequence, paths stay -1.
  bool any = false;
  for (int64_t t = 0; t < T; ++t) any |= alpha[(m - 1) * T + t] + w.end[t] > kNegInf;
  if (!any) return;

  // Backward sampling, right to left; row j of the output is paths[j * L ...].
  for (int64_t i = m - 1; i >= 0; --i) {
    const double* a = alpha + i * T;
    const scalar_t* noise = x.noise_at(b, i);
    const Matrix* into = i + 1 < m ? &trans.into(i + 1, /*forward=*/false) : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      // The scores of each tag s at i with the tag to its right: end, or trans_{i+1}[s, y_{i+1}].
      const double* right = into == nullptr ? w.end.data() : into->transposed.data() + w.tags[j] * T;
      const int64_t tag = perturbed_argmax(a, right, noise + j * T, T);
      w.tags[j] = tag;
      paths[j * L + i] = tag;
    }
  }
}

// ---- without replacement ------------------------------------------------------------------------
// A child of a beam: its perturbed value (key), its log-probability (phi) and code = beam * T + tag.
struct Candidate {
  double key, phi;
  int64_t code;
};

// Whether a ranks before b among the children: the larger key, then the smaller code.
inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.key > b.key || (a.key == b.key && a.code < b.code);
}

// key_c > h needs g_c > min(h, max g) - log 2 (the top of this file); below this bound, with a
// margin that no rounding of the values reaches, a child cannot enter the top n.
inline double child_bound(double h, double z) {
  const double base = std::min(h, z);
  return base - 0.7 - 1e-9 * std::fabs(base);
}

// One thread's beams, for one sentence at a time.
struct Beams {
  std::vector<double> key, phi, next_key, next_phi;  // (n,): the live beams, in descending order of key
  std::vector<int64_t> tag, next_tag;                // (n,): each beam's first tag
  std::vector<double> child_phi, g;                  // (n, T): each beam's children
  std::vector<double> z;                             // (n,): each beam's largest g
  std::vector<int64_t> order;                        // (T,): scratch
  std::vector<Candidate> heap;                       // the best children so far, the worst at the front
  std::vector<int64_t> parent, chosen;               // (L, n): at position i, beam k's parent (a beam at
                                                     // i + 1; the root at m - 1) and its tag at i
  Beams(int64_t L, int64_t T, int64_t n)
      : key(n), phi(n), next_key(n), next_phi(n), tag(n), next_tag(n), child_phi(n * T), g(n * T), z(n), order(T),
        parent(std::max<int64_t>(L, 1) * n), chosen(std::max<int64_t>(L, 1) * n) {
    heap.reserve(n);
  }
};

constexpr double kLog2 = 0.6931471805599453;  // crfkit/sampling.py's _log1mexp branch point

// Samples the n distinct rows of sentence b (length m >= 1) into paths (n, L), in descending order
// of their perturbed values (the top of this file). paths is all -1 on entry; only the real
// positions of the rows that hold a sequence are written.
template <typename scalar_t>
void sample_sentence_without_replacement(const Inputs<scalar_t>& x, int64_t b, const Matrix* shared, Work& w,
                                         Beams& beams, int64_t* paths) {
  const int64_t T = x.T, L = x.L, n = x.n, m = x.len[b];
  SentenceTransitions<scalar_t> trans(x, b, shared, w.own);
  forward_scores(x, b, trans, w, /*record_into=*/true);
  const double* alpha = w.alpha.data();
  // log Z as crfkit.reference.safe_logsumexp computes it: log(sum exp(v - max)) + max.
  const double* last = alpha + (m - 1) * T;
  double top = kNegInf;
  for (int64_t t = 0; t < T; ++t) top = std::max(top, last[t] + w.end[t]);
  if (top == kNegInf) return;  // every sequence forbidden: no row holds one
  double sum = 0;
  for (int64_t t = 0; t < T; ++t) sum += std::exp((last[t] + w.end[t]) - top);
  const double log_z = std::log(sum) + top;

  // The root: the empty suffix, log-probability 0, perturbed value 0.
  int64_t live = 1;
  beams.key[0] = beams.phi[0] = 0;
  beams.tag[0] = 0;
  std::vector<Candidate>& heap = beams.heap;
  // Offers a child to the heap of the n best so far; whether it entered.
  double h = kNegInf;  // the worst key in the heap once it holds n children
  auto offer = [&](const Candidate& child) {
    if (static_cast<int64_t>(heap.size()) < n) {
      heap.push_back(child);
      std::push_heap(heap.begin(), heap.end(), ranks_before);
    } else if (ranks_before(child, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), ranks_before);
      heap.back() = child;
      std::push_heap(heap.begin(), heap.end(), ranks_before);
    } else {
      return false;
    }
    if (static_cast<int64_t>(heap.size()) == n) h = heap.front().key;
    return true;
  };
  for (int64_t i = m - 1; i >= 0; --i) {
    const double* a = alpha + i * T;
    const scalar_t* noise = x.noise_at(b, i);
    const Matrix* into = i + 1 < m ? &trans.into(i + 1, /*forward=*/false) : nullptr;
    heap.clear();
    h = kNegInf;
    // Every live beam's children: log-probabilities phi_c and unconditioned perturbed values g_c.
    // The children at a beam's maximum get its key exactly (v = -inf): into the heap at no cost.
    for (int64_t j = 0; j < live; ++j) {
      const double* right;
      double norm;
      if (into == nullptr) {
        right = w.end.data();
        norm = log_z;
      } else {
        const int64_t t = beams.tag[j];
        right = into->transposed.data() + t * T;  // trans_{i+1}[., t]
        norm = w.into[(i + 1) * T + t];
      }
      double* child_phi = beams.child_phi.data() + j * T;
      double* g = beams.g.data() + j * T;
      double z = kNegInf;
      if (norm > kNegInf) {  // (always, for a live beam: its tag has a prefix)
        const double phi = beams.phi[j];
        const scalar_t* gumbel = noise + j * T;
        for (int64_t s = 0; s < T; ++s) {
          child_phi[s] = phi + ((a[s] + right[s]) - norm);
          g[s] = child_phi[s] + static_cast<double>(gumbel[s]);
          z = std::max(z, g[s]);
        }
      }
      beams.z[j] = z;
      if (z == kNegInf) continue;  // no possible child
      for (int64_t s = 0; s < T; ++s) {
        if (g[s] == z) offer(Candidate{beams.key[j], child_phi[s], j * T + s});
      }
    }
    // The other children, each beam's in descending order of g_c, which is the order of their
    // keys (key_c increases with g_c): a beam's scan stops at the first that does not enter.
    for (int64_t j = 0; j < live; ++j) {
      const double key = beams.key[j];
      // Every child of beam j (and of the beams after it) has a key <= key_j: none can enter.
      if (static_cast<int64_t>(heap.size()) == n && key <= h) break;
      const double z = beams.z[j];
      if (z == kNegInf) continue;
      const double* child_phi = beams.child_phi.data() + j * T;
      const double* g = beams.g.data() + j * T;
      int64_t* order = beams.order.data();
      int64_t count = 0;
      const double bound = static_cast<int64_t>(heap.size()) == n ? child_bound(h, z) : kNegInf;
      for (int64_t s = 0; s < T; ++s) {
        if (g[s] < z && g[s] > bound && g[s] > kNegInf) order[count++] = s;
      }
      std::sort(order, order + count,
                [g](int64_t p, int64_t q) { return g[p] > g[q] || (g[p] == g[q] && p < q); });
      for (int64_t k = 0; k < count; ++k) {
        const int64_t s = order[k];
        const double gs = g[s];
        if (static_cast<int64_t>(heap.size()) == n && gs <= child_bound(h, z)) break;
        // key_j conditioned on the maximum of the children being key_j (crfkit/sampling.py's
        // _conditional_gumbels), in its arithmetic.
        const double d = gs - z;
        const double log1mexp = d > -kLog2 ? std::log(-std::expm1(d)) : std::log1p(-std::exp(d));
        const double v = (key - gs) + log1mexp;
        const double softplus = v > 40.0 ? v : std::log1p(std::exp(v));
        if (!offer(Candidate{key - softplus, child_phi[s], j * T + s})) break;
      }
    }
    // The next beams, best first; fewer than n when fewer children are possible.
    std::sort_heap(heap.begin(), heap.end(), ranks_before);
    live = static_cast<int64_t>(heap.size());
    int64_t* parent = beams.parent.data() + i * n;
    int64_t* chosen = beams.chosen.data() + i * n;
    for (int64_t k = 0; k < live; ++k) {
      const Candidate& c = heap[k];
      parent[k] = c.code / T;
      chosen[k] = c.code % T;
      beams.next_key[k] = c.key;
      beams.next_phi[k] = c.phi;
      beams.next_tag[k] = c.code % T;
    }
    std::swap(beams.key, beams.next_key);
    std::swap(beams.phi, beams.next_phi);
    std::swap(beams.tag, beams.next_tag);
  }
  // Row k: the final beam k traced back from position 0 to m - 1.
  for (int64_t k = 0; k < live; ++k) {
    int64_t beam = k;
    for (int64_t i = 0; i < m; ++i) {
      paths[k * L + i] = beams.chosen[i * n + beam];
      beam = beams.parent[i * n + beam];
    }
  }
}

// The body of both ops: paths (B, n, L) for noise (L, B, n, T), parallel over sentences.
template <bool kWithReplacement>
Tensor sample_cpu(const Tensor& emissions_in, const Tensor& transitions_in, const Tensor& noise_in,
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
  CRFKIT_DISPATCH_FLOATING_TYPES(a.emissions.scalar_type(), "crfkit_sample", [&] {
    const Inputs<scalar_t> x(a, noise);
    std::vector<Matrix> shared;  // shared (T, T) transitions: converted once for every sentence
    if (x.Lt == 0) {
      shared.emplace_back(T);
      shared.front().load(x.trans);
    }
    int64_t* out = data<int64_t>(paths);
    parallel_for(0, B, 1, [&](int64_t b_begin, int64_t b_end) {
      Work work(L, T, n, /*with_into=*/!kWithReplacement);
      std::vector<Beams> beams;  // (without replacement)
      if (!kWithReplacement) beams.emplace_back(L, T, n);
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
        if (m == 0) continue;
        const Matrix* matrix = shared.empty() ? nullptr : &shared.front();
        if (kWithReplacement) {
          sample_sentence(x, b, matrix, work, out + b * n * L);
        } else {
          sample_sentence_without_replacement(x, b, matrix, work, beams.front(), out + b * n * L);
        }
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

}  // namespace

// paths (B, n, L) int64 for noise (L, B, n, T): see the top of this file.
Tensor sample_with_replacement_cpu(const Tensor& emissions, const Tensor& transitions, const Tensor& noise,
                                   const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return sample_cpu<true>(emissions, transitions, noise, lengths, start, end);
}

// paths (B, n, L) int64, n distinct rows per sentence, for noise (L, B, n, T): see the top of this file.
Tensor sample_without_replacement_cpu(const Tensor& emissions, const Tensor& transitions, const Tensor& noise,
                                      const Tensor& lengths, const Tensor& start, const Tensor& end) {
  return sample_cpu<false>(emissions, transitions, noise, lengths, start, end);
}

}  // namespace CRFKIT_CPU_ISA
}  // namespace cpu
}  // namespace crfkit
