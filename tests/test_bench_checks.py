"""The benchmarks' correctness checks (benchmarks/cases.py), which decide whether a peer is timed
or reported WRONG: for Viterbi a different path of the same exact score is right, a different
path of a lower score is not; without replacement a few sentences may order their rows
differently (the float32 reference's rounding), more may not."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cases  # noqa: E402


def _two_sentences(second_tag_emission):
    """B = 2, L = 2, T = 2, zero transitions / start / end. Sentence 0: tag 0 wins everywhere.
    Sentence 1: its last position scores (0, second_tag_emission)."""
    emissions = torch.tensor([[[1.0, 0.0], [1.0, 0.0]],
                              [[1.0, 0.0], [0.0, second_tag_emission]]])
    zeros = torch.zeros(2)
    x = cases.Inputs(emissions, torch.zeros(2, 2), torch.tensor([2, 2]), zeros, zeros)
    crfkit_result = (torch.tensor([[0, 0], [0, 0]]), torch.tensor([2.0, 1.0]))
    return x, crfkit_result


def test_a_different_path_of_equal_score_is_right():
    x, want = _two_sentences(0.0)  # sentence 1: paths (0, 0) and (0, 1) both score 1
    got = (torch.tensor([[0, 0], [0, 1]]), torch.tensor([2.0, 1.0]))
    assert cases._check_viterbi(got, want, x) is None
    assert cases._check_viterbi(want, want, x) is None


def test_a_different_path_of_lower_score_is_wrong():
    x, want = _two_sentences(-0.5)  # sentence 1: (0, 1) scores 0.5, below the best 1
    got = (torch.tensor([[0, 0], [0, 1]]), torch.tensor([2.0, 1.0]))  # right score, wrong path
    error = cases._check_viterbi(got, want, x)
    assert error is not None and "1 of 2 sentences" in error and "b=1" in error and "-0.5" in error


def test_a_wrong_score_is_reported_first():
    x, want = _two_sentences(0.0)
    got = (want[0], torch.tensor([2.0, 1.5]))
    assert "viterbi score" in cases._check_viterbi(got, want, x)


def test_the_without_replacement_check_counts_sentences():
    # (B, n, L) = (40, 3, 2): one sentence whose rows differ passes (a near tie decided in float32
    # by the reference, in double by the kernel); three (7.5% of the sentences) do not.
    x, _ = _two_sentences(0.0)
    paths = torch.zeros(40, 3, 2, dtype=torch.long)
    paths[:, 1, 1] = 1
    paths[:, 2] = -1
    log_probs = torch.full((40, 3), -1.0)
    want = (paths, log_probs)
    one = paths.clone()
    one[5, [0, 1]] = one[5, [1, 0]]
    assert cases._check_sample_without((one, log_probs), want, x) is None
    three = paths.clone()
    three[:3, [0, 1]] = three[:3, [1, 0]]
    assert "7.50% of the sentences" in cases._check_sample_without((three, log_probs), want, x)
    wrong_log_probs = log_probs.clone()
    wrong_log_probs[9, 0] = 0.0
    assert "log-probabilities" in cases._check_sample_without((one, wrong_log_probs), want, x)
