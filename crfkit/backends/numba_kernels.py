"""numba kernels of the numba backend (crfkit/backends/numba_backend.py holds the torch side).

Every kernel takes NumPy views of the validated tensors: emissions (B, L, T), transitions
(T, T) as [from, to], start / end (T,), lengths (B,) int64, tags (B, N, L) int64. Each
sentence is one sequential scan, as in the C++ kernels (csrc/cpu/*.cpp), whose algorithms these
follow. The batched kernels process sentences first, first + step, first + 2 step, ... and
release the GIL (nogil), so the caller runs one call per thread with first = 0 .. step - 1
(numba_backend._call_over_batch). They are deliberately not numba parallel=True / prange
kernels: those compile about twice as slowly, and numba's OpenMP threading layer (a second
libgomp next to torch's) spin-waits: as soon as another process used a core, every call took a
scheduler time slice (about 8 ms on a 2-core machine, for a 0.3 ms kernel).

- log Z / marginals / backward: forward-backward in log space with per-position normalisation
  (each alpha / beta row is shifted so that its maximum is 0, the shifts are summed in float64),
  a probability-space matrix-vector product per step with an exact log-space fallback when it
  underflows. These kernels take float64 arrays (float32 inputs are converted by the caller,
  exactly): numba then compiles them once, and float32 gets float64 accuracy.
- Viterbi, k-best and sequence scores: computed in the input dtype, accumulated left to right
  as ((score + transition) + emission), exactly like crfkit.reference, so scores and ties agree
  to the last bit. k-best merges the T sorted K-lists of the previous position per tag: a
  smaller predecessor tag wins a tie, then the earlier rank; the final choice prefers the
  smaller last tag.

The kernels raise nothing (they run in worker threads, without the GIL): sentences whose
emissions hold NaN or +inf within their length are flagged in `bad`, and the caller raises.
fastmath stays off: -inf (forbidden) must propagate exactly, and decoded scores must round like
the reference's.
Type discipline for the exact kernels: local scalars are only ever assigned values of the input
dtype (no Python float literals in their arithmetic), so float32 stays float32.
"""
from __future__ import annotations

import math

import numba
import numpy as np

_JIT = dict(cache=True, nogil=True)  # fastmath stays off (the default)

NEG_INF = -np.inf
# The thresholds shared with the C++ / CUDA kernels: csrc/numerics.h, which Python cannot include
# (tests/test_numerics_header.py holds these to its double values). The forward-backward
# kernels compute in float64.
# A probability-space sum at or above this is trusted as it is (trusted_sum_min<double>).
TRUSTED_SUM_MIN = 2.0 ** -960
# Pairwise marginals use exp(w) * p[s] * E[t][s] while w is at most this bound
# (pairwise_fast_bound<double>).
PAIRWISE_FAST_BOUND = 600.0

# Modes of forward_backward.
MODE_LOG_Z = 0          # log Z only, two rolling alpha rows per thread
MODE_LOG_Z_KEEP = 1     # log Z, and keep the normalised alpha rows + offsets for the backward
MODE_BACKWARD = 2       # gradients from rows kept by MODE_LOG_Z_KEEP (no forward pass)
MODE_MARGINALS = 3      # forward + marginals


# ---- argument checks ---------------------------------------------------------------------------
@numba.njit(**_JIT)
def _has_nan_or_posinf(x):
    for v in x:
        if v != v or v == np.inf:
            return True
    return False


@numba.njit(**_JIT)
def check_arguments(transitions, lengths, start, end, max_len):
    """0 when fine; 1 / 2 / 3: transitions / start / end hold NaN or +inf; 4: a length is
    outside [0, max_len]."""
    if _has_nan_or_posinf(transitions.ravel()):
        return 1
    if _has_nan_or_posinf(start):
        return 2
    if _has_nan_or_posinf(end):
        return 3
    for n in lengths:
        if n < 0 or n > max_len:
            return 4
    return 0


@numba.njit(**_JIT)
def _sentence_is_bad(emissions, b, n):
    """emissions[b, :n] holds NaN or +inf."""
    T = emissions.shape[2]
    for i in range(n):
        for t in range(T):
            v = emissions[b, i, t]
            if v != v or v == np.inf:
                return True
    return False


# ---- forward-backward (float64 internally) ----------------------------------------------------
@numba.njit(**_JIT)
def _scaled_transitions(transitions):
    """col_max[t] and col_scaled[s, t] = exp(trans[s, t] - col_max[t]) (forward), row_max[s] and
    row_scaled_t[t, s] = exp(trans[s, t] - row_max[s]) (backward, stored transposed). Both are
    laid out so that the inner loops of the steps run over independent lanes. An all -inf line
    has max -inf and scaled entries 0."""
    T = transitions.shape[0]
    col_max = np.full(T, NEG_INF)
    row_max = np.full(T, NEG_INF)
    col_scaled = np.zeros((T, T))
    row_scaled_t = np.zeros((T, T))
    for s in range(T):
        for t in range(T):
            v = np.float64(transitions[s, t])
            if v > col_max[t]:
                col_max[t] = v
            if v > row_max[s]:
                row_max[s] = v
    for s in range(T):
        for t in range(T):
            v = np.float64(transitions[s, t])
            if col_max[t] != NEG_INF:
                col_scaled[s, t] = math.exp(v - col_max[t])
            if row_max[s] != NEG_INF:
                row_scaled_t[t, s] = math.exp(v - row_max[s])
    return col_max, col_scaled, row_max, row_scaled_t


@numba.njit(**_JIT)
def _normalise(x):
    """Shift x (float64) so that its maximum is 0 and return the shift (-inf, x unchanged, when
    every entry is -inf)."""
    m = NEG_INF
    for v in x:
        if v > m:
            m = v
    if m == NEG_INF:
        return NEG_INF
    for j in range(x.shape[0]):
        x[j] -= m
    return m


@numba.njit(**_JIT)
def _lse_matvec(x, mat, mat_max, mat_scaled, out, p):
    """out[j] = logsumexp_k(x[k] + mat[k, j]), with mat_max[j] = max_k mat[k, j] and
    mat_scaled[k, j] = exp(mat[k, j] - mat_max[j]) precomputed (_scaled_transitions).

    In probability space: out[j] = x_max + mat_max[j] + log(sum_k p[k] mat_scaled[k, j]) with
    p[k] = exp(x[k] - x_max), every factor <= 1; the sums are accumulated across j (lanes)
    for k = 0, 1, ... A sum below TRUSTED_SUM_MIN (underflow) is redone exactly in log space.
    The forward step uses mat = transitions, the backward step mat = transitions.T."""
    T = x.shape[0]
    x_max = NEG_INF
    for k in range(T):
        if x[k] > x_max:
            x_max = x[k]
    if x_max == NEG_INF:
        for j in range(T):
            out[j] = NEG_INF
        return
    for k in range(T):
        p[k] = math.exp(x[k] - x_max)
    for j in range(T):
        out[j] = 0.0
    for k in range(T):
        pk = p[k]
        for j in range(T):
            out[j] += pk * mat_scaled[k, j]
    for j in range(T):
        m_j = mat_max[j]
        total = out[j]
        if m_j == NEG_INF:
            out[j] = NEG_INF
        elif total >= TRUSTED_SUM_MIN:
            out[j] = x_max + m_j + math.log(total)
        else:  # underflow: exactly, in log space
            m = NEG_INF
            for k in range(T):
                v = x[k] + mat[k, j]
                if v > m:
                    m = v
            if m == NEG_INF:
                out[j] = NEG_INF
            else:
                acc = 0.0
                for k in range(T):
                    acc += math.exp(x[k] + mat[k, j] - m)
                out[j] = m + math.log(acc)


@numba.njit(**_JIT)
def _forward_step(prev, transitions, col_max, col_scaled, emissions, b, i, out, p):
    """out[t] = logsumexp_s(prev[s] + trans[s, t]) + emissions[b, i, t]."""
    _lse_matvec(prev, transitions, col_max, col_scaled, out, p)
    for t in range(prev.shape[0]):
        out[t] += emissions[b, i, t]


@numba.njit(**_JIT)
def _backward_step(v, transitions, row_max, row_scaled_t, out, q):
    """out[s] = logsumexp_t(trans[s, t] + v[t])."""
    _lse_matvec(v, transitions.T, row_max, row_scaled_t, out, q)


@numba.njit(**_JIT)
def _forward_scan(emissions, transitions, start, end, col_max, col_scaled, b, n, rows, offsets, keep, p):
    """Forward pass over sentence b (n >= 1); returns log Z (float64). With `keep`, rows[i] is
    the normalised alpha row of position i and offsets[i] its accumulated shift (alpha =
    rows[i] + offsets[i]); otherwise rows holds two rolling rows."""
    T = emissions.shape[2]
    row = rows[0]
    for t in range(T):
        row[t] = np.float64(start[t]) + np.float64(emissions[b, 0, t])
    off = _normalise(row)
    if keep:
        offsets[0] = off
    for i in range(1, n):
        prev = rows[i - 1] if keep else rows[(i - 1) % 2]
        row = rows[i] if keep else rows[i % 2]
        _forward_step(prev, transitions, col_max, col_scaled, emissions, b, i, row, p)
        off += _normalise(row)
        if keep:
            offsets[i] = off
    if off == NEG_INF:
        return NEG_INF
    m = NEG_INF
    for t in range(T):
        v = row[t] + end[t]
        if v > m:
            m = v
    if m == NEG_INF:
        return NEG_INF
    acc = 0.0
    for t in range(T):
        acc += math.exp(row[t] + end[t] - m)
    return off + m + math.log(acc)


@numba.njit(**_JIT)
def _backward_scan(emissions, transitions, end, col_max, col_scaled, row_max, row_scaled_t, b, n,
                   rows, offsets, log_z, g, pairwise, grad_emissions, grad_trans, grad_start,
                   grad_end, beta, beta_next, v, scratch, pair, lanes):
    """Marginals of sentence b, times g, into grad_emissions[b, :n]; with `pairwise` also the
    transition (float64, grad_trans[b]), start and end gradients. rows / offsets / log_z come
    from _forward_scan(keep=True)."""
    T = emissions.shape[2]
    for t in range(T):
        beta[t] = end[t]
    beta_off = _normalise(beta)
    for i in range(n - 1, -1, -1):
        # Marginals at position i normalised over the tags (they sum to one exactly) rather than
        # shifted by log Z, whose rounding would otherwise reach every probability.
        alpha = rows[i]
        u_max = NEG_INF
        for t in range(T):
            scratch[t] = alpha[t] + beta[t]
            if scratch[t] > u_max:
                u_max = scratch[t]
        if u_max == NEG_INF:  # unreachable when log Z is finite; leave zeros
            for t in range(T):
                scratch[t] = 0.0
        else:
            total = 0.0
            for t in range(T):
                scratch[t] = math.exp(scratch[t] - u_max)
                total += scratch[t]
            scale = g / total
            for t in range(T):
                scratch[t] *= scale
        for t in range(T):
            grad_emissions[b, i, t] = scratch[t]
        if pairwise and i == n - 1:
            for t in range(T):
                grad_end[b, t] = scratch[t]
        if pairwise and i == 0:
            for t in range(T):
                grad_start[b, t] = scratch[t]
        if i == 0:
            break
        for t in range(T):
            v[t] = np.float64(emissions[b, i, t]) + beta[t]
        if pairwise:
            # xi[s, t] = P(y_{i-1} = s, y_i = t) = exp(alpha[i-1][s] + trans[s, t] + v[t] + shift)
            # = coef[t] * exp(prev[s]) * col_scaled[s, t], computed up to a common factor and
            # then divided by its total (the xi sum to one). coef (in beta_next, free until
            # _backward_step) is exp(w) with w bounded; beyond the bound, every xi of the
            # position is computed exactly instead.
            prev = rows[i - 1]
            shift = offsets[i - 1] + beta_off - log_z
            coef = beta_next
            exact = False
            for t in range(T):
                w = col_max[t] + v[t] + shift
                if w == NEG_INF:
                    coef[t] = 0.0
                elif w <= PAIRWISE_FAST_BOUND:
                    coef[t] = math.exp(w)
                else:
                    exact = True
            for t in range(T):
                lanes[t] = 0.0
            if exact:
                for s in range(T):
                    for t in range(T):
                        w = col_max[t] + v[t] + shift
                        x = 0.0 if w == NEG_INF else math.exp(prev[s] + transitions[s, t] + v[t] + shift)
                        pair[s, t] = x
                        lanes[t] += x
            else:
                for s in range(T):
                    e_s = math.exp(prev[s])
                    for t in range(T):
                        x = coef[t] * e_s * col_scaled[s, t]
                        pair[s, t] = x
                        lanes[t] += x
            total = 0.0
            for t in range(T):
                total += lanes[t]
            if total > 0.0:
                scale = g / total
                for s in range(T):
                    for t in range(T):
                        grad_trans[b, s, t] += scale * pair[s, t]
        _backward_step(v, transitions, row_max, row_scaled_t, beta_next, scratch)
        for s in range(T):
            beta[s] = beta_next[s]
        beta_off += _normalise(beta)


@numba.njit(**_JIT)
def _forward_backward_sentence(emissions, transitions, lengths, start, end, grad_log_z, mode,
                               rows_all, offsets_all, log_z, grad_emissions, grad_trans,
                               grad_start, grad_end, bad, col_max, col_scaled, row_max, row_scaled_t, b):
    T = emissions.shape[2]
    n = lengths[b]
    if mode != MODE_BACKWARD:
        if _sentence_is_bad(emissions, b, n):
            bad[b] = True
            return
        if n == 0:  # the empty sequence: log Z = 0, nothing to differentiate
            log_z[b] = 0.0
            return
        p = np.empty(T)
        if mode == MODE_LOG_Z:
            rows = np.empty((2, T))
            offsets = np.empty(1)
        elif mode == MODE_LOG_Z_KEEP:
            rows = rows_all[b]
            offsets = offsets_all[b]
        else:
            rows = np.empty((n, T))
            offsets = np.empty(n)
        log_z[b] = _forward_scan(emissions, transitions, start, end, col_max, col_scaled, b, n,
                                 rows, offsets, mode != MODE_LOG_Z, p)
        if mode != MODE_MARGINALS:
            return
        g = 1.0
    else:
        g = grad_log_z[b]
        if n == 0 or g == 0.0:
            return
        rows = rows_all[b]
        offsets = offsets_all[b]
    # Every sequence forbidden: log Z = -inf and all gradients / marginals stay 0.
    if log_z[b] == NEG_INF:
        return
    beta = np.empty(T)
    beta_next = np.empty(T)
    v = np.empty(T)
    scratch = np.empty(T)
    pair = np.empty((T, T))
    lanes = np.empty(T)
    _backward_scan(emissions, transitions, end, col_max, col_scaled, row_max, row_scaled_t, b, n,
                   rows, offsets, log_z[b], g, mode == MODE_BACKWARD, grad_emissions, grad_trans,
                   grad_start, grad_end, beta, beta_next, v, scratch, pair, lanes)


@numba.njit(**_JIT)
def forward_backward(emissions, transitions, lengths, start, end, grad_log_z, mode, rows_all,
                     offsets_all, log_z, grad_emissions, grad_trans, grad_start, grad_end, bad,
                     first, step):
    """One driver for log Z, the rows kept for the backward, the backward and the marginals
    (see MODE_*); every array is float64 (lengths int64, bad bool). log_z (B,) is written by
    the forward modes and read by MODE_BACKWARD; rows_all (B, L, T) / offsets_all (B, L) are
    used by MODE_LOG_Z_KEEP and MODE_BACKWARD (dummies otherwise). grad_emissions (B, L, T)
    must be zeros (the marginals for MODE_MARGINALS); grad_trans (B, T, T), grad_start,
    grad_end (B, T) zeros are the per-sentence parameter gradients of MODE_BACKWARD."""
    col_max, col_scaled, row_max, row_scaled_t = _scaled_transitions(transitions)
    for b in range(first, emissions.shape[0], step):
        _forward_backward_sentence(emissions, transitions, lengths, start, end, grad_log_z, mode,
                                   rows_all, offsets_all, log_z, grad_emissions, grad_trans,
                                   grad_start, grad_end, bad, col_max, col_scaled, row_max,
                                   row_scaled_t, b)


# ---- decoding (input dtype, exact) ------------------------------------------------------------
@numba.njit(**_JIT)
def viterbi(emissions, transitions, lengths, start, end, paths, scores, bad, first, step):
    """paths (B, L) int64 filled with -1 and scores (B,) are written for every sentence."""
    B, L, T = emissions.shape
    for b in range(first, B, step):
        n = lengths[b]
        if _sentence_is_bad(emissions, b, n):
            bad[b] = True
            continue
        if n == 0:  # the empty sequence, score 0
            scores[b] = 0
            continue
        delta = np.empty_like(start)
        delta_next = np.empty_like(start)
        backpointers = np.empty((n, T), dtype=np.int32)
        for t in range(T):
            delta[t] = start[t] + emissions[b, 0, t]
        for i in range(1, n):
            for t in range(T):
                best = delta[0] + transitions[0, t]
                arg = 0
                for s in range(1, T):
                    cand = delta[s] + transitions[s, t]
                    if cand > best:  # strict: the smaller predecessor wins a tie
                        best = cand
                        arg = s
                delta_next[t] = best + emissions[b, i, t]
                backpointers[i, t] = arg
            for t in range(T):
                delta[t] = delta_next[t]
        best = delta[0] + end[0]
        tag = 0
        for t in range(1, T):
            cand = delta[t] + end[t]
            if cand > best:  # strict: the smaller last tag wins a tie
                best = cand
                tag = t
        scores[b] = best
        if best == NEG_INF:  # every sequence forbidden: the path stays -1
            continue
        for i in range(n - 1, -1, -1):
            paths[b, i] = tag
            if i > 0:
                tag = backpointers[i, tag]


@numba.njit(**_JIT)
def _kbest_step(lists, transitions, emissions, b, i, out, backpointers, heads_values, heads, best,
                best_s):
    """One k-best step, position i-1 -> i: for every tag t, the K best of lists[s, r] +
    trans[s, t] over predecessors s and ranks r (each list is sorted), plus emissions[b, i, t].
    The T merges run side by side, the inner loops across t (independent lanes that LLVM can
    vectorise), as in csrc/cpu/kbest.cpp."""
    T, K = lists.shape
    for s in range(T):
        for t in range(T):
            heads_values[s, t] = lists[s, 0] + transitions[s, t]
            heads[s, t] = 0
    for r in range(K):
        for t in range(T):
            best[t] = heads_values[0, t]
            best_s[t] = 0
        for s in range(1, T):
            for t in range(T):
                v = heads_values[s, t]
                better = v > best[t]  # strict: the smaller predecessor wins a tie
                best[t] = v if better else best[t]
                best_s[t] = s if better else best_s[t]
        for t in range(T):
            out[t, r] = best[t] + emissions[b, i, t]
            if best[t] == NEG_INF:  # no sequence left for this slot
                continue
            s = best_s[t]
            rank = heads[s, t]
            heads[s, t] = rank + 1
            backpointers[t, r] = s * K + rank
            if rank + 1 < K:
                heads_values[s, t] = lists[s, rank + 1] + transitions[s, t]
            else:
                heads_values[s, t] = NEG_INF


@numba.njit(**_JIT)
def kbest_viterbi(emissions, transitions, lengths, start, end, K, paths, scores, bad, first, step):
    """The K best distinct sequences per sentence. paths (B, k, L) int64 filled with -1 and
    scores (B, k) filled with -inf (k >= K: rows beyond the number of sequences a sentence can
    have stay missing) are written for the rows that hold a sequence."""
    B, L, T = emissions.shape
    for b in range(first, B, step):
        n = lengths[b]
        if _sentence_is_bad(emissions, b, n):
            bad[b] = True
            continue
        if n == 0:  # exactly one sequence, the empty one, of score 0
            scores[b, 0] = 0
            continue
        lists = np.empty((T, K), dtype=start.dtype)  # lists[t, r]: r-th best prefix ending in t
        lists_next = np.empty((T, K), dtype=start.dtype)
        # heads_values[s, t]: the next candidate of predecessor s's list for tag t; heads[s, t]
        # its rank. The final merge uses row 0 only (over last tags s).
        heads_values = np.empty((T, T), dtype=start.dtype)
        heads = np.empty((T, T), dtype=np.int64)
        best = np.empty_like(start)
        best_s = np.empty(T, dtype=np.int64)
        backpointers = np.empty((n, T, K), dtype=np.int32)  # code = predecessor * K + rank
        for t in range(T):
            lists[t, 0] = start[t] + emissions[b, 0, t]
            for r in range(1, K):
                lists[t, r] = NEG_INF
        for i in range(1, n):
            _kbest_step(lists, transitions, emissions, b, i, lists_next, backpointers[i],
                        heads_values, heads, best, best_s)
            lists, lists_next = lists_next, lists
        # The final choice over last tags: the same merge with end[t] added, smaller tag first.
        for s in range(T):
            heads[s, 0] = 0
            heads_values[s, 0] = lists[s, 0] + end[s]
        for r in range(K):
            top = heads_values[0, 0]
            top_s = 0
            for s in range(1, T):
                if heads_values[s, 0] > top:
                    top = heads_values[s, 0]
                    top_s = s
            if top == NEG_INF:  # fewer than K sequences exist
                break
            scores[b, r] = top
            rank = heads[top_s, 0]
            heads[top_s, 0] = rank + 1
            if rank + 1 < K:
                heads_values[top_s, 0] = lists[top_s, rank + 1] + end[top_s]
            else:
                heads_values[top_s, 0] = NEG_INF
            tag = top_s
            for i in range(n - 1, -1, -1):
                paths[b, r, i] = tag
                if i > 0:
                    code = backpointers[i, tag, rank]
                    tag = code // K
                    rank = code % K


# ---- scores of given sequences and their gradient --------------------------------------------
@numba.njit(**_JIT)
def _first_bad_tag(tags, b, n, T):
    """1 + (j * L + i) of the first tag of sentence b within its length outside [0, T), or 0."""
    N, L = tags.shape[1], tags.shape[2]
    for j in range(N):
        for i in range(n):
            y = tags[b, j, i]
            if y < 0 or y >= T:
                return 1 + j * L + i
    return 0


@numba.njit(**_JIT)
def sequence_score(emissions, transitions, lengths, start, end, tags, scores, bad, bad_tag, first, step):
    """scores (B, N) of tags (B, N, L); 0 for a length-0 sentence."""
    B, L, T = emissions.shape
    N = tags.shape[1]
    for b in range(first, B, step):
        n = lengths[b]
        bad_tag[b] = _first_bad_tag(tags, b, n, T)
        if bad_tag[b] != 0:
            continue
        if _sentence_is_bad(emissions, b, n):
            bad[b] = True
            continue
        for j in range(N):
            if n == 0:
                scores[b, j] = 0
                continue
            y = tags[b, j]
            score = start[y[0]] + emissions[b, 0, y[0]]
            for i in range(1, n):
                score = (score + transitions[y[i - 1], y[i]]) + emissions[b, i, y[i]]
            scores[b, j] = score + end[y[n - 1]]


@numba.njit(**_JIT)
def scatter_path_scores(grad_scores, lengths, tags, grad_emissions, grad_trans, grad_start,
                        grad_end, bad_tag):
    """Gradient of sum_{b, j} grad_scores[b, j] * score(tags[b, j]): ones at the emissions,
    transitions, start and end that each sequence uses. Rows whose first tag is -1 (k-best rows
    holding no sequence) contribute nothing. grad_* are zeros, per sentence: (B, L, T),
    (B, T, T), (B, T), (B, T). Always float64 (compiled once), and serial: the work is
    O(B N L), small next to the decoding that produced the paths."""
    B, L, T = grad_emissions.shape
    N = tags.shape[1]
    for b in range(B):
        n = lengths[b]
        if n == 0:
            continue
        for j in range(N):
            y = tags[b, j]
            w = grad_scores[b, j]
            if y[0] == -1 or w == 0:
                continue
            for i in range(n):
                if y[i] < 0 or y[i] >= T:
                    bad_tag[b] = 1 + j * L + i
            if bad_tag[b] != 0:
                break
            grad_start[b, y[0]] += w
            grad_end[b, y[n - 1]] += w
            for i in range(n):
                grad_emissions[b, i, y[i]] += w
            for i in range(1, n):
                grad_trans[b, y[i - 1], y[i]] += w
