"""crfkit.calibration: the fitted temperature recovers the one that generated the data (tag
sequences sampled exactly, by enumerating every sequence, from a CRF whose scores were divided by
it), the NLL it minimises, the expected calibration error on hand-computed cases, bad input."""
import itertools
import math
import warnings

import pytest
import torch

import crfkit
from crfkit.calibration import entity_calibration_error, fit_temperature, scaled_nll

pytestmark = pytest.mark.usefixtures("one_thread")


def sample_crf(B, L, T, temperature, seed):
    """Scores theta (emissions (B, L, T), transitions, start, end, lengths) and gold tags sampled
    exactly from the CRF with scores theta / temperature (every sequence enumerated: T**L of them)."""
    g = torch.Generator().manual_seed(seed)
    emissions = torch.randn(B, L, T, generator=g, dtype=torch.float64) * 2
    transitions = torch.randn(T, T, generator=g, dtype=torch.float64)
    transitions[0, 2] = float("-inf")  # a forbidden transition stays forbidden at any temperature
    start, end = torch.randn(T, generator=g, dtype=torch.float64), torch.randn(T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[:3] = torch.tensor([0, 1, L])
    every = torch.tensor(list(itertools.product(range(T), repeat=L)))  # (T**L, L)
    # Positions past a sentence's length are ignored, so each of its sequences appears T**(L - n)
    # times with one score: sampling among the copies is still exact.
    scores = crfkit.sequence_score(emissions / temperature, transitions / temperature,
                                   every.expand(B, *every.shape), lengths, start / temperature, end / temperature)
    choice = torch.multinomial(torch.softmax(scores, 1), 1, generator=g).squeeze(1)
    return emissions, transitions, start, end, lengths, every[choice]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_fit_temperature_recovers_the_sampling_temperature(temperature):
    emissions, transitions, start, end, lengths, tags = sample_crf(3000, 4, 3, temperature, seed=int(temperature * 4))
    fitted = fit_temperature(emissions, transitions, tags, lengths, start, end)
    assert fitted == pytest.approx(temperature, rel=0.06)
    # The minimum of the objective it states, found to the tolerance asked for.
    nll = scaled_nll(fitted, emissions, transitions, tags, lengths, start, end)
    for factor in (0.99, 1.01):
        assert nll <= scaled_nll(fitted * factor, emissions, transitions, tags, lengths, start, end)
    precise = fit_temperature(emissions, transitions, tags, lengths, start, end, tolerance=1e-7)
    assert precise == pytest.approx(fitted, rel=2e-4)


def test_batches_give_what_one_tensor_gives():
    emissions, transitions, start, end, lengths, tags = sample_crf(400, 4, 3, 1.5, seed=9)
    whole = fit_temperature(emissions, transitions, tags, lengths, start, end)
    parts = [slice(0, 150), slice(150, 400)]
    widths = [int(lengths[p].max()) for p in parts]  # batches of different seq_len
    split = fit_temperature([emissions[p, :w] for p, w in zip(parts, widths)], transitions,
                            [tags[p, :w] for p, w in zip(parts, widths)], [lengths[p] for p in parts], start, end)
    assert split == pytest.approx(whole, rel=1e-9)
    # the NLL scaled_nll reports is the one the search minimises: log Z - s(y) at T = 1
    log_z = crfkit.log_partition(emissions, transitions, lengths, start, end)
    gold = crfkit.sequence_score(emissions, transitions, tags, lengths, start, end)
    assert scaled_nll(1.0, emissions, transitions, tags, lengths, start, end) == pytest.approx(
        float((log_z - gold).sum()), rel=1e-12)


def test_a_temperature_outside_the_bounds_warns_at_the_bound():
    emissions, transitions, start, end, lengths, tags = sample_crf(500, 3, 3, 4.0, seed=2)
    with pytest.warns(RuntimeWarning, match="edge of bounds"):
        fitted = fit_temperature(emissions, transitions, tags, lengths, start, end, bounds=(0.5, 2.0))
    assert fitted == pytest.approx(2.0, rel=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_temperature(emissions, transitions, tags, lengths, start, end)


def test_fit_temperature_bad_input():
    emissions, transitions, start, end, lengths, tags = sample_crf(10, 3, 3, 1.0, seed=1)
    forbidden = tags.clone()
    forbidden[3, :2] = torch.tensor([0, 2])  # the forbidden transition 0 -> 2
    lengths = lengths.clone()
    lengths[3] = 3
    with pytest.raises(ValueError, match="gold tag sequence of sentence 3 is forbidden"):
        fit_temperature(emissions, transitions, forbidden, lengths, start, end)
    with pytest.raises(ValueError, match="no word"):
        fit_temperature(emissions, transitions, tags, torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match="tags within the lengths must lie in"):
        fit_temperature(emissions, transitions, tags + 5, lengths)
    with pytest.raises(ValueError, match=r"bounds\[0\] must be a finite positive number"):
        fit_temperature(emissions, transitions, tags, lengths, bounds=(0, 2))
    with pytest.raises(ValueError, match="low < high"):
        fit_temperature(emissions, transitions, tags, lengths, bounds=(2, 1))
    with pytest.raises(TypeError, match="bounds must be a pair"):
        fit_temperature(emissions, transitions, tags, lengths, bounds=3)
    with pytest.raises(ValueError, match="tolerance must be a finite positive number"):
        fit_temperature(emissions, transitions, tags, lengths, tolerance=0)
    with pytest.raises(TypeError, match="tags must be a sequence of 2 tensors"):
        fit_temperature([emissions, emissions], transitions, tags, lengths)
    with pytest.raises(TypeError, match="tags must be a tensor"):
        fit_temperature(emissions, transitions, [tags], lengths)
    with pytest.raises(ValueError, match="holds no batch"):
        fit_temperature([], transitions, [], None)
    with pytest.raises(ValueError, match="temperature must be a finite positive number"):
        scaled_nll(-1.0, emissions, transitions, tags, lengths)


# ------------------------------------------------------------------------- calibration error
def test_ece_by_hand():
    # bins of 0.5: [0, 0.5) holds 0.2, 0.4 (mean 0.3, 1 of 2 correct); [0.5, 1] holds 0.5, 0.9, 1.0
    # (mean 0.8, 3 of 3 correct). ECE = 2/5 * |0.5 - 0.3| + 3/5 * |1 - 0.8| = 0.08 + 0.12.
    ece, table = entity_calibration_error([0.2, 0.4, 0.5, 0.9, 1.0], [True, False, True, True, True], bins=2)
    assert ece == pytest.approx(0.2)
    assert [row["count"] for row in table] == [2, 3]
    assert table[0]["mean_probability"] == pytest.approx(0.3) and table[0]["accuracy"] == 0.5
    assert table[1]["mean_probability"] == pytest.approx(0.8) and table[1]["accuracy"] == 1.0
    assert (table[0]["low"], table[0]["high"], table[1]["low"], table[1]["high"]) == (0.0, 0.5, 0.5, 1.0)


def test_ece_of_a_calibrated_and_an_overconfident_predictor():
    ece, table = entity_calibration_error(torch.tensor([0.75] * 4), torch.tensor([1, 1, 1, 0]))
    assert ece == pytest.approx(0.0, abs=1e-12)
    assert [row["count"] for row in table] == [0] * 7 + [4, 0, 0]
    assert table[0]["mean_probability"] is None and table[0]["accuracy"] is None
    ece, _ = entity_calibration_error([0.95, 0.95, 0.15], [0, 1, 0], bins=10)
    assert ece == pytest.approx(2 / 3 * 0.45 + 1 / 3 * 0.15)
    assert entity_calibration_error([], [])[0] == 0.0
    json_ready = entity_calibration_error([0.3], [1])[1]
    assert all(isinstance(value, (int, float, type(None))) for row in json_ready for value in row.values())
    assert math.isclose(entity_calibration_error([0.3], [1])[0], 0.7)


def test_ece_bad_input():
    with pytest.raises(ValueError, match="same length"):
        entity_calibration_error([0.5, 0.6], [True])
    with pytest.raises(ValueError, match=r"probabilities must lie in \[0, 1\]"):
        entity_calibration_error([1.5], [True])
    with pytest.raises(ValueError, match=r"probabilities must lie in \[0, 1\]"):
        entity_calibration_error([float("nan")], [True])
    with pytest.raises(ValueError, match="correct must hold bools or 0 / 1"):
        entity_calibration_error([0.5], [2])
    with pytest.raises(ValueError, match="bins must be a positive int"):
        entity_calibration_error([0.5], [True], bins=0)
    with pytest.raises(TypeError, match="probabilities must be a 1-D tensor or a sequence"):
        entity_calibration_error(0.5, [True])
    with pytest.raises(ValueError, match="must be 1-D"):
        entity_calibration_error(torch.zeros(2, 2), torch.zeros(2, 2))
