"""crfkit.sampling.sample against brute-force enumeration of all T**n tag sequences.

Frequencies of many seeded draws are compared with the exact probabilities by a chi-square
goodness-of-fit statistic, bounded at p = 1e-4 of the chi-square distribution (each test also
shows that the bound rejects a wrong distribution, so it can fail). With replacement the draws
must follow P(y); without replacement the n rows must be distinct, allowed, and distributed as n
sequential draws without replacement (Plackett-Luce): the ordered rows, each sequence's inclusion
probability and the first row are checked against probabilities enumerated from P.

The without-replacement tests and the edge cases run twice (the `sampler` fixture): on the PyTorch
path and on the compiled backend's C++ CPU kernels (csrc/cpu/sampling.cpp), which draw their noise
from the same generator; tests/test_sampling_kernels.py compares the two row for row.
"""
import functools
import itertools
import math
from statistics import NormalDist

import pytest
import torch
from torch.overrides import TorchFunctionMode

import brute_force
from crfkit import reference
from crfkit.sampling import missing_rows, sample

pytestmark = pytest.mark.usefixtures("one_thread")

P_VALUE = 1e-4
N = 20000  # draws per sentence


# ---- statistics ---------------------------------------------------------------------------------
def chi2_survival(x: float, df: int) -> float:
    """P(X > x) for X chi-square with df degrees of freedom, in closed form (integer df):
    exp(-x/2) sum_{j<k} (x/2)^j / j! for df = 2k, and erfc(sqrt(x/2)) plus
    exp(-x/2) sum_{j<k} (x/2)^(j+1/2) / Gamma(j+3/2) for df = 2k+1."""
    h = x / 2
    if df % 2 == 0:
        terms = (j * math.log(h) - math.lgamma(j + 1) for j in range(df // 2))
        return sum(math.exp(t - h) for t in terms)
    terms = ((j + 0.5) * math.log(h) - math.lgamma(j + 1.5) for j in range(df // 2))
    return math.erfc(math.sqrt(h)) + sum(math.exp(t - h) for t in terms)


@functools.lru_cache(maxsize=None)
def chi2_critical(df: int, p: float = P_VALUE) -> float:
    """The (1 - p) quantile of the chi-square distribution with df degrees of freedom, by bisection
    of chi2_survival (exact; no scipy needed). Started from the Wilson-Hilferty approximation,
    which overestimates this far in the tail (7% at df = 1, 2% at df = 5)."""
    z = NormalDist().inv_cdf(1 - p)
    c = 2 / (9 * df)
    high = 2 * df * (1 - c + z * math.sqrt(c)) ** 3
    low = 0.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if chi2_survival(mid, df) > p else (low, mid)
    return (low + high) / 2


def chi2_test(counts: dict, probs: dict):
    """(statistic, critical value at P_VALUE) of observed counts {outcome: count} against the
    probabilities {outcome: p}. Cells expected below 5 are pooled into one; an outcome of
    probability 0 that was observed gives an infinite statistic."""
    total = sum(counts.values())
    if any(outcome not in probs or probs[outcome] == 0 for outcome in counts):
        return math.inf, 0.0
    cells, pooled_observed, pooled_expected = [], 0, 0.0
    for outcome, p in probs.items():
        observed, expected = counts.get(outcome, 0), total * p
        if expected >= 5:
            cells.append((observed, expected))
        else:
            pooled_observed, pooled_expected = pooled_observed + observed, pooled_expected + expected
    if pooled_expected > 0:
        cells.append((pooled_observed, pooled_expected))
    assert len(cells) >= 2, "nothing to test: every outcome in one cell"
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    return statistic, chi2_critical(len(cells) - 1)


def test_chi2_critical_value():
    # Known quantiles at p = 1e-4 (and scipy's, where it is installed).
    for df, exact in ((1, 15.1367052), (2, 18.4206807), (5, 25.7448320), (20, 52.3859733), (100, 161.3186570)):
        assert chi2_critical(df) == pytest.approx(exact, rel=1e-7)
    assert chi2_critical(2) == pytest.approx(-2 * math.log(P_VALUE), rel=1e-12)
    try:
        from scipy.stats import chi2
    except ImportError:
        return
    for df in (1, 3, 4, 7, 30, 379):
        assert chi2_critical(df) == pytest.approx(chi2.ppf(1 - P_VALUE, df), rel=1e-9)


# ---- tiny CRFs and their exact distributions -------------------------------------------------------
def tiny_crf(T, lengths, seed, dtype=torch.float64, forbid=True, per_example=None):
    """emissions (B, L, T), transitions, lengths, start, end with some -inf entries.
    per_example: None (transitions (T, T), start / end (T,)), "sentence" ((B, 1, T, T)) or
    "position" ((B, L, T, T)); both with start / end (B, T)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    B, L = len(lengths), int(lengths.max())

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    emissions = draw(B, L, T)
    if per_example is None:
        transitions, start, end = draw(T, T), draw(T), draw(T)
    else:
        transitions = draw(B, 1 if per_example == "sentence" else L, T, T)
        start, end = draw(B, T), draw(B, T)
    if forbid and T == 2:
        transitions[..., 1, 1] = -math.inf
    elif forbid and T > 2:
        transitions[..., 0, 2] = -math.inf
        start[..., 2] = -math.inf
        end[..., 2] = -math.inf
        if L > 1:
            emissions[0, 1, 0] = -math.inf
    return [x.to(dtype) if x.is_floating_point() else x for x in (emissions, transitions, lengths, start, end)]


def enumerate_sentence(crf, b):
    """[(sequence, probability)] of every allowed sequence of sentence b, by brute force."""
    emissions, transitions, lengths, start, end = (x.double() if x.is_floating_point() else x for x in crf)
    tr = transitions
    if tr.dim() == 4:
        tr = tr[b, 0] if tr.shape[1] == 1 else tr[b]  # (T, T) or per position (L, T, T)
    st, en = (x[b] if x.dim() == 2 else x for x in (start, end))
    seqs = brute_force.all_sequences(emissions[b], tr, st, en, int(lengths[b]))
    log_z = brute_force.log_partition(seqs)
    return [(seq, math.exp(score - log_z)) for score, seq in seqs]


def row_counts(paths_b, n_b):
    """{sequence: count} of the rows (N, L) of one sentence, read over its n_b positions."""
    if n_b == 0:
        return {(): paths_b.shape[0]}
    values, counts = torch.unique(paths_b[:, :n_b], dim=0, return_counts=True)
    return {tuple(v): int(c) for v, c in zip(values.tolist(), counts.tolist())}


def check_rows(paths, crf):
    """Every row of sentence b is -1 after its length, and allowed (or missing, all -1)."""
    lengths = crf[2]
    for b in range(paths.shape[0]):
        n_b = int(lengths[b])
        assert (paths[b, :, n_b:] == -1).all()
        allowed = {seq for seq, _ in enumerate_sentence(crf, b)}
        for row in row_counts(paths[b], n_b):
            assert row in allowed or (n_b > 0 and all(t == -1 for t in row)), (b, row)


def check_frequencies(paths, crf, wrong=None):
    """Chi-square of each sentence's rows against P; with `wrong` (a function b -> {seq: p}) also
    that the same counts are rejected against that wrong distribution."""
    lengths = crf[2]
    tested = 0
    for b in range(paths.shape[0]):
        n_b = int(lengths[b])
        probs = dict(enumerate_sentence(crf, b))
        counts = row_counts(paths[b], n_b)
        if n_b == 0 or not probs:
            assert counts == {(-1,) * n_b: paths.shape[1]}  # the empty sequence, or no sequence at all
            continue
        assert sum(counts.values()) == paths.shape[1]
        if len(probs) == 1:
            assert counts == {next(iter(probs)): paths.shape[1]}
            continue
        statistic, critical = chi2_test(counts, probs)
        assert statistic < critical, (b, statistic, critical)
        if wrong is not None:
            wrong_statistic, wrong_critical = chi2_test(counts, wrong(b))
            assert wrong_statistic > wrong_critical, (b, wrong_statistic, wrong_critical)
        tested += 1
    assert tested >= 1


def uniform_over_allowed(crf):
    return lambda b: {seq: 1 / len(enumerate_sentence(crf, b)) for seq, _ in enumerate_sentence(crf, b)}


def transitions_ignored(crf):
    """P with every allowed transition scored 0 (same support, different distribution)."""
    emissions, transitions, lengths, start, end = crf
    flat = torch.where(transitions == -math.inf, transitions, torch.zeros_like(transitions))
    return lambda b: dict(enumerate_sentence((emissions, flat, lengths, start, end), b))


def generator(seed):
    return torch.Generator().manual_seed(seed)


def kernel_sample(emissions, transitions, n, lengths, start, end, *, replacement=True, generator=None):
    """crfkit.sampling.sample's signature, through the compiled backend's samplers: the C++ CPU
    kernels (csrc/cpu/sampling.cpp), with the noise drawn from generator in the same order."""
    from crfkit.backends import compiled

    name = "sample_with_replacement" if replacement else "sample_without_replacement"
    assert compiled._has_kernel(name, emissions)
    return getattr(compiled, name)(emissions, transitions, n, lengths, start, end, generator)


@pytest.fixture(params=["pytorch", "kernel"])
def sampler(request):
    """The sampler under test: the PyTorch path (crfkit.sampling.sample) or the C++ kernels
    (skipped where the compiled extension is not built). The frequency tests with replacement and
    the without-replacement tests below run on both: the chi-square bounds, the exact
    Plackett-Luce orders and inclusion probabilities hold for each."""
    if request.param == "pytorch":
        return sample
    import crfkit

    if "compiled" not in crfkit.backends.available():
        pytest.skip("extension not built")
    return kernel_sample


# ---- with replacement ---------------------------------------------------------------------------
@pytest.mark.parametrize("T,lengths,seed", [(2, [3, 0, 1, 2], 1), (3, [3, 1, 0, 2], 2), (3, [2, 2, 1], 3),
                                            (2, [1], 4)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_with_replacement_frequencies_match_brute_force(T, lengths, seed, dtype, sampler):
    crf = tiny_crf(T, lengths, seed, dtype)
    paths = sampler(*crf[:2], N, *crf[2:], generator=generator(seed))
    assert paths.shape == (len(lengths), N, max(lengths)) and paths.dtype == torch.int64
    check_rows(paths, crf)
    check_frequencies(paths, crf, wrong=uniform_over_allowed(crf))


def test_chi_square_rejects_a_sampler_that_ignores_transitions(sampler):
    # The test can fail: the same draws are rejected against P without its transition scores,
    # and draws made with the transitions zeroed are rejected against P.
    crf = tiny_crf(3, [3, 2], 5)
    paths = sampler(*crf[:2], N, *crf[2:], generator=generator(5))
    check_frequencies(paths, crf, wrong=transitions_ignored(crf))
    emissions, transitions, lengths, start, end = crf
    flat = torch.where(transitions == -math.inf, transitions, torch.zeros_like(transitions))
    wrong_paths = sampler(emissions, flat, N, lengths, start, end, generator=generator(5))
    statistic, critical = chi2_test(row_counts(wrong_paths[0], 3), dict(enumerate_sentence(crf, 0)))
    assert statistic > critical


@pytest.mark.parametrize("per_example", ["sentence", "position"])
def test_per_example_transitions_start_and_end(per_example, sampler):
    crf = tiny_crf(3, [3, 2, 1, 0], 6, per_example=per_example)
    paths = sampler(*crf[:2], N, *crf[2:], generator=generator(6))
    check_rows(paths, crf)
    check_frequencies(paths, crf, wrong=uniform_over_allowed(crf))
    # Sentence 0 with sentence 1's parameters is another distribution: the sampler does read
    # each example's own transitions, start and end.
    emissions, transitions, lengths, start, end = crf
    swapped = [x[[1, 0, 2, 3]] for x in (transitions, start, end)]
    other = dict(enumerate_sentence((emissions, swapped[0], lengths, swapped[1], swapped[2]), 0))
    statistic, critical = chi2_test(row_counts(paths[0], 3), other)
    assert statistic > critical


# ---- without replacement ---------------------------------------------------------------------------
def ordered_draws(probs, n):
    """{(seq_1, ..., seq_r): probability} of r = min(n, m) sequential draws without replacement
    from the m sequences of probs {seq: p} (Plackett-Luce), by enumeration."""
    seqs = list(probs)
    out = {}
    for order in itertools.permutations(seqs, min(n, len(seqs))):
        p, left = 1.0, 1.0
        for seq in order:
            p *= probs[seq] / left
            left -= probs[seq]
        out[order] = p
    return out


def inclusion_probabilities(probs, n):
    inclusion = dict.fromkeys(probs, 0.0)
    for order, p in ordered_draws(probs, n).items():
        for seq in order:
            inclusion[seq] += p
    return inclusion


def repeated(crf, copies):
    """The batch with every sentence repeated `copies` times (sentence b: rows b*copies ...)."""
    emissions, transitions, lengths, start, end = crf
    transitions = transitions.repeat_interleave(copies, 0) if transitions.dim() == 4 else transitions
    start, end = (x.repeat_interleave(copies, 0) if x.dim() == 2 else x for x in (start, end))
    return [emissions.repeat_interleave(copies, 0), transitions, lengths.repeat_interleave(copies, 0), start, end]


def z_bound(cells: int) -> float:
    """|z| bound of `cells` binomial counts, Bonferroni-corrected to P_VALUE overall."""
    return NormalDist().inv_cdf(1 - P_VALUE / (2 * cells))


def inclusion_z(counts: dict, inclusion: dict, draws: int) -> float:
    """The largest |z| of the inclusion counts of each sequence against its probability."""
    worst = 0.0
    for seq, pi in inclusion.items():
        observed = counts.get(seq, 0)
        if pi > 1 - 1e-12:
            assert observed == draws
            continue
        worst = max(worst, abs(observed - draws * pi) / math.sqrt(draws * pi * (1 - pi)))
    return worst


WITHOUT_CRFS = [(3, [3, 2, 1], 11), (2, [3, 1, 2], 12), (3, [2], 13)]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("T,lengths,seed", WITHOUT_CRFS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_without_replacement_matches_sequential_draws(T, lengths, seed, n, dtype, sampler):
    copies = 10000
    crf = tiny_crf(T, lengths, seed, dtype)
    paths = sampler(*repeated(crf, copies)[:2], n, *repeated(crf, copies)[2:], replacement=False,
                    generator=generator(seed + n))
    assert paths.shape == (len(lengths) * copies, n, max(lengths))
    for b, n_b in enumerate(lengths):
        probs = dict(enumerate_sentence(crf, b))
        rows = paths[b * copies:(b + 1) * copies, :, :n_b]  # (copies, n, n_b)
        assert (paths[b * copies:(b + 1) * copies, :, n_b:] == -1).all()
        r = min(n, len(probs))
        assert (rows[:, r:] == -1).all()  # rows after the last allowed sequence are missing
        taken = rows[:, :r]
        # (a) every row allowed, the rows of a draw distinct.
        draws = [tuple(map(tuple, draw)) for draw in taken.tolist()]
        assert all(seq in probs for draw in draws for seq in draw)
        assert all(len(set(draw)) == r for draw in draws)
        # The ordered rows follow Plackett-Luce (sequential drawing, in that order).
        order_counts = {}
        for draw in draws:
            order_counts[draw] = order_counts.get(draw, 0) + 1
        exact_orders = ordered_draws(probs, n)
        statistic, critical = chi2_test(order_counts, exact_orders)
        assert statistic < critical, (b, statistic, critical)
        # (b) inclusion frequencies (test_inclusion_check_rejects_sampling_with_replacement: can fail).
        inclusion = inclusion_probabilities(probs, n)
        included = {}
        for draw in draws:
            for seq in draw:
                included[seq] = included.get(seq, 0) + 1
        assert inclusion_z(included, inclusion, copies) < z_bound(len(inclusion))
        # (c) the first row alone is distributed as P.
        statistic, critical = chi2_test(row_counts(taken[:, 0], n_b), probs)
        assert statistic < critical, (b, statistic, critical)
        # The checks can fail: the rows in reverse order are not Plackett-Luce, nor is the
        # second row distributed as P.
        if len(probs) > n:
            reversed_counts = {tuple(reversed(draw)): c for draw, c in order_counts.items()}
            statistic, critical = chi2_test(reversed_counts, exact_orders)
            assert statistic > critical
            statistic, critical = chi2_test(row_counts(taken[:, 1], n_b), probs)
            assert statistic > critical


def test_inclusion_check_rejects_sampling_with_replacement(sampler):
    # n draws WITH replacement include each sequence with probability 1 - (1 - p)^n, not the
    # Plackett-Luce inclusion: with distinct rows forced, the bound still tells them apart.
    crf = tiny_crf(3, [2], 21, forbid=False)
    probs = dict(enumerate_sentence(crf, 0))
    n, copies = 3, 20000
    with_replacement = 1 - (1 - torch.tensor(list(probs.values()))) ** n
    wrong = dict(zip(probs, with_replacement.tolist()))
    paths = sampler(*repeated(crf, copies)[:2], n, *repeated(crf, copies)[2:], replacement=False,
                    generator=generator(21))
    included = {}
    for draw in paths[:, :, :2].tolist():
        for seq in map(tuple, draw):
            included[seq] = included.get(seq, 0) + 1
    assert inclusion_z(included, inclusion_probabilities(probs, n), copies) < z_bound(len(probs))
    assert inclusion_z(included, wrong, copies) > z_bound(len(probs))


def test_without_replacement_on_longer_sentences(sampler):
    # 5 and 4 positions (up to 3**5 sequences, most of them pruned at every position by a beam of
    # n = 2): the ordered pairs and each sequence's inclusion against Plackett-Luce.
    copies = 20000
    crf = tiny_crf(3, [5, 4], 81)
    big = repeated(crf, copies)
    paths = sampler(*big[:2], 2, *big[2:], replacement=False, generator=generator(81))
    for b, n_b in enumerate([5, 4]):
        probs = dict(enumerate_sentence(crf, b))
        assert len(probs) > 20
        draws = [tuple(map(tuple, draw)) for draw in paths[b * copies:(b + 1) * copies, :, :n_b].tolist()]
        assert all(len(set(draw)) == 2 and all(seq in probs for seq in draw) for draw in draws)
        order_counts, included = {}, {}
        for draw in draws:
            order_counts[draw] = order_counts.get(draw, 0) + 1
            for seq in draw:
                included[seq] = included.get(seq, 0) + 1
        statistic, critical = chi2_test(order_counts, ordered_draws(probs, 2))
        assert statistic < critical, (b, statistic, critical)
        assert inclusion_z(included, inclusion_probabilities(probs, 2), copies) < z_bound(len(probs))


@pytest.mark.parametrize("per_example", [None, "sentence", "position"])
def test_without_replacement_returns_every_allowed_sequence_when_n_is_large(per_example, sampler):
    # (d) n >= the number of allowed sequences: all of them, distinct, then -1 rows.
    crf = tiny_crf(3, [3, 2, 1, 0], 31, per_example=per_example)
    enumerations = [enumerate_sentence(crf, b) for b in range(4)]
    n = max(len(e) for e in enumerations) + 2
    paths = sampler(*crf[:2], n, *crf[2:], replacement=False, generator=generator(31))
    for b, seqs in enumerate(enumerations):
        n_b = int(crf[2][b])
        m = len(seqs) if n_b else 1  # a length-0 sentence: the empty sequence, row 0
        got = [tuple(row[:n_b]) for row in paths[b, :m].tolist()]
        assert sorted(got) == sorted(seq for seq, _ in seqs)
        assert (paths[b, m:] == -1).all() and (paths[b, :, n_b:] == -1).all()
        assert missing_rows(paths, crf[2], replacement=False)[b].tolist() == [j >= m for j in range(n)]


@pytest.mark.parametrize("per_example", ["sentence", "position"])
def test_without_replacement_per_example_transitions(per_example, sampler):
    copies = 8000
    crf = tiny_crf(3, [3, 2], 41, per_example=per_example)
    big = repeated(crf, copies)
    paths = sampler(*big[:2], 2, *big[2:], replacement=False, generator=generator(41))
    for b, n_b in enumerate([3, 2]):
        probs = dict(enumerate_sentence(crf, b))
        rows = paths[b * copies:(b + 1) * copies, :, :n_b]
        order_counts = {}
        for draw in rows.tolist():
            key = tuple(map(tuple, draw))
            order_counts[key] = order_counts.get(key, 0) + 1
        statistic, critical = chi2_test(order_counts, ordered_draws(probs, 2))
        assert statistic < critical, (b, statistic, critical)


# ---- edge cases ---------------------------------------------------------------------------------
@pytest.mark.parametrize("replacement", [True, False])
def test_determinism_with_a_generator(replacement, sampler):
    crf = tiny_crf(3, [3, 0, 2, 1], 51)
    first = sampler(*crf[:2], 50, *crf[2:], replacement=replacement, generator=generator(7))
    state = torch.get_rng_state()
    again = sampler(*crf[:2], 50, *crf[2:], replacement=replacement, generator=generator(7))
    assert torch.equal(torch.get_rng_state(), state)  # every random number came from the generator
    assert torch.equal(first, again)
    other = sampler(*crf[:2], 50, *crf[2:], replacement=replacement, generator=generator(8))
    assert not torch.equal(first, other)


class NaNWatch(TorchFunctionMode):
    """Records every torch call whose floating-point result holds a NaN (except the allocations
    of uninitialised memory, which may hold anything before they are filled)."""

    UNINITIALISED = ("empty", "new_empty", "empty_like")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in self.UNINITIALISED:
            return out
        results = out if isinstance(out, (tuple, list)) else (out,)
        for x in results:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and bool(torch.isnan(x).any()):
                self.calls.append(getattr(func, "__name__", str(func)))
        return out


def test_the_nan_watch_sees_nan():
    with NaNWatch() as watch:
        x = torch.tensor([-math.inf, 1.0])
        x.sub(x.clone()).exp_()  # -inf - -inf = NaN, through a method call
        torch.zeros(2).log_()  # -inf, no NaN
    assert watch.calls == ["sub"] or watch.calls[0] == "sub"


@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forbidden_scores_all_forbidden_and_empty_sentences(replacement, dtype, sampler):
    T, L = 3, 4
    g = torch.Generator().manual_seed(61)
    emissions = torch.randn(6, L, T, generator=g, dtype=dtype)
    transitions = torch.randn(T, T, generator=g, dtype=dtype)
    start, end = torch.randn(T, generator=g, dtype=dtype), torch.randn(T, generator=g, dtype=dtype)
    transitions[:, 2] = -math.inf  # tag 2 only at position 0
    transitions[1, 0] = -math.inf
    end[0] = -math.inf
    emissions[0, :, 0] = -math.inf  # sentence 0: tag 0 never
    emissions[1, 2, :] = -math.inf  # sentence 1: nothing allowed at position 2
    emissions[2, 0, :2] = -math.inf  # sentence 2: length 1, only tag 2 ... which end allows
    emissions[4, 1, 0] = emissions[4, 1, 1] = -math.inf  # sentence 4: position 1 needs tag 2: forbidden
    lengths = torch.tensor([4, 3, 1, 0, 3, 2])
    n = 40
    with NaNWatch() as watch:
        paths = sampler(emissions, transitions, n, lengths, start, end, replacement=replacement,
                        generator=generator(61))
    assert watch.calls == []  # no NaN in any intermediate result
    crf = (emissions, transitions, lengths, start, end)
    check_rows(paths, crf)
    assert not (paths[0] == 0).any()
    assert not (paths[:, :, 1:] == 2).any()
    assert (paths[1] == -1).all() and (paths[4] == -1).all()  # every sequence forbidden
    assert (paths[3] == -1).all()  # the empty sequence
    assert (paths[2, 0] == torch.tensor([2, -1, -1, -1])).all()
    missing = missing_rows(paths, lengths, replacement)
    assert missing[1].all() and missing[4].all()
    assert missing[3].tolist() == ([False] * n if replacement else [False] + [True] * (n - 1))
    # The wrapper's log-probabilities, sequence_score - log_partition: finite where a row holds
    # a sequence (so no forbidden score was sampled), 0 for the empty sequence.
    log_probs = (reference.sequence_score(emissions, transitions, paths.clamp(min=0), lengths, start, end)
                 - reference.log_partition(emissions, transitions, lengths, start, end).unsqueeze(1))
    assert torch.isfinite(log_probs[~missing]).all()
    assert (log_probs[3, 0] == 0).all()


def test_only_one_tag_and_single_sequences(sampler):
    emissions = torch.randn(3, 2, 1, dtype=torch.float64)
    transitions = torch.zeros(1, 1, dtype=torch.float64)
    zeros = torch.zeros(1, dtype=torch.float64)
    lengths = torch.tensor([2, 1, 0])
    paths = sampler(emissions, transitions, 5, lengths, zeros, zeros, generator=generator(0))
    assert paths.tolist() == [[[0, 0]] * 5, [[0, -1]] * 5, [[-1, -1]] * 5]
    paths = sampler(emissions, transitions, 5, lengths, zeros, zeros, replacement=False, generator=generator(0))
    assert paths[:, 0].tolist() == [[0, 0], [0, -1], [-1, -1]] and (paths[:, 1:] == -1).all()


@pytest.mark.parametrize("replacement", [True, False])
def test_empty_shapes(replacement, sampler):
    zeros = torch.zeros(3, dtype=torch.float64)
    for B, L in ((0, 4), (2, 0), (0, 0)):
        paths = sampler(torch.zeros(B, L, 3, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64), 4,
                        torch.full((B,), L), zeros, zeros, replacement=replacement)
        assert paths.shape == (B, 4, L) and paths.dtype == torch.int64
        assert (paths == -1).all()


def test_bad_n_and_replacement():
    crf = tiny_crf(2, [2], 0)
    for bad, error in ((0, ValueError), (-3, ValueError), (True, TypeError), (2.0, TypeError), ("3", TypeError),
                       (None, TypeError)):
        with pytest.raises(error, match="n must be"):
            sample(*crf[:2], bad, *crf[2:])
    with pytest.raises(TypeError, match="replacement must be a bool"):
        sample(*crf[:2], 2, *crf[2:], replacement=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("replacement", [True, False])
def test_on_cuda(replacement):
    crf = tiny_crf(3, [3, 2, 1, 0], 71)
    cuda = [x.cuda() for x in crf]
    g = torch.Generator(device="cuda").manual_seed(71)
    if replacement:
        paths = sample(*cuda[:2], N, *cuda[2:], generator=g)
        assert paths.device.type == "cuda"
        check_frequencies(paths.cpu(), crf, wrong=uniform_over_allowed(crf))
    else:
        copies = 10000
        big = repeated(cuda, copies)
        paths = sample(*big[:2], 2, *big[2:], replacement=False, generator=g).cpu()
        for b, n_b in enumerate([3, 2, 1]):
            rows = paths[b * copies:(b + 1) * copies, 0, :n_b]
            statistic, critical = chi2_test(row_counts(rows, n_b), dict(enumerate_sentence(crf, b)))
            assert statistic < critical
    again = sample(*cuda[:2], 7, *cuda[2:], replacement=replacement, generator=torch.Generator("cuda").manual_seed(3))
    assert torch.equal(again, sample(*cuda[:2], 7, *cuda[2:], replacement=replacement,
                                     generator=torch.Generator("cuda").manual_seed(3)))


# ---- the public op: crfkit.sample (arguments checked, mask / allowed, log-probabilities) -------
def test_public_sample_log_probs_are_the_sequences_log_probabilities(backend):
    import crfkit

    crf = tiny_crf(3, [3, 0, 2, 1], 5)
    emissions, transitions, lengths, start, end = crf
    for replacement in (True, False):
        em = emissions.clone().requires_grad_()
        drawn = crfkit.sample(em, transitions, 4, lengths, start, end, replacement=replacement,
                              generator=generator(1))
        found = drawn.log_probs > -math.inf
        expected = crfkit.LinearChainCRF(emissions, transitions, lengths, start, end).log_prob(drawn.paths.clamp(min=0))
        torch.testing.assert_close(drawn.log_probs[found], expected[found])
        assert bool(found[1, 0]) and (replacement or not bool(found[1, 1:].any()))  # the empty sentence
        drawn.log_probs[found].sum().backward()  # differentiable
        assert bool(torch.isfinite(em.grad).all()) and float(em.grad.abs().sum()) > 0


def test_public_sample_with_a_mask_and_allowed_tags():
    import crfkit

    crf = tiny_crf(3, [4, 4, 4], 6, forbid=False)
    emissions, transitions, _, start, end = crf
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    allowed = torch.ones(3, 4, 3, dtype=torch.bool)
    allowed[:, :, 2] = False
    allowed[2, 1] = torch.tensor([False, True, False])  # position 1 of sentence 2 forced to tag 1
    paths = crfkit.sample(emissions, transitions, 2000, start=start, end=end, mask=mask, allowed=allowed,
                          generator=generator(2)).paths
    assert bool((paths[:, :, :][~mask.unsqueeze(1).expand_as(paths)] == -1).all())
    real = paths[mask.unsqueeze(1).expand_as(paths)]
    assert bool(((real == 0) | (real == 1)).all()) and bool((paths[2, :, 1] == 1).all())
    # Sentence 1's two real positions are distributed as the sentence without its masked ones.
    compact = (emissions[1:2, 2:].masked_fill(~allowed[1:2, 2:], -math.inf), transitions, torch.tensor([2]),
               start, end)
    check_frequencies(paths[1:2, :, 2:], compact)


def test_public_sample_bad_arguments():
    import crfkit

    emissions, transitions, lengths, start, end = tiny_crf(2, [2, 1], 7)
    with pytest.raises(ValueError, match="n must be"):
        crfkit.sample(emissions, transitions, 0, lengths)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        crfkit.sample(emissions, transitions, 2, lengths, generator=0)
    with pytest.raises(ValueError, match=r"transitions must have shape"):
        crfkit.sample(emissions, transitions[0], 2, lengths)
