"""The roofline's work model (benchmarks/roofline): the counts the benchmark reports divide by.
No probe is built here: the rates are given."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import roofline  # noqa: E402

# round numbers, so that expected times are easy to state
RATES = roofline.Rates(fma_double=1e9, fma_float=2e9, exp_double=1e8, max_plus_float=1e10,
                       copy_bytes=1e12, threads=1)


def test_log_partition_counts_the_scaled_product_and_the_exponentials():
    tokens, T = 1000, 9
    bound = roofline.lower_bound_s("log_partition", tokens, 10, 100, T, None, RATES)
    assert bound["compute_s"] == pytest.approx(tokens * T * T / 1e9 + tokens * T / 1e8)
    assert bound["limit"] == "compute" and bound["bound_s"] == bound["compute_s"]


@pytest.mark.parametrize("K", [1, 5, 15])
def test_kbest_reports_the_merge_count_and_the_minimal_count(K):
    tokens, T = 1000, 37
    bound = roofline.lower_bound_s("kbest", tokens, 10, 100, T, K, RATES)
    log_z_s = tokens * T * T / 1e9 + tokens * T / 1e8
    assert bound["compute_s"] == pytest.approx(log_z_s + K * tokens * T * T / 1e10)
    assert bound["minimal_bound_s"] == pytest.approx(log_z_s + tokens * (T * T + T * (K - 1)) / 1e10)
    if K == 1:  # one list entry per tag: both counts are a Viterbi step
        assert bound["minimal_bound_s"] == pytest.approx(bound["bound_s"])
    else:
        assert bound["minimal_bound_s"] < bound["bound_s"]


def test_memory_bound_when_bandwidth_is_the_limit():
    slow_memory = roofline.Rates(fma_double=1e12, fma_float=1e12, exp_double=1e12, max_plus_float=1e12,
                                 copy_bytes=1e6, threads=1)
    tokens, B, L, T = 1000, 10, 100, 9
    bound = roofline.lower_bound_s("viterbi", tokens, B, L, T, None, slow_memory)
    assert bound["limit"] == "memory"
    assert bound["bound_s"] == pytest.approx((4 * tokens * T + 8 * B * L) / 1e6)


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="no work model"):
        roofline.work("beam_search", 10, 1, 10, 9)
