"""crfkit.deferred_errors / crfkit.check_errors without a GPU: the mode switch and the messages.
The CUDA side (kernels recording into the persistent words, CUDA-graph capture) is tested in
tests/test_cuda.py, on a GPU or the CPU emulator."""
import pytest

import crfkit
from crfkit.backends import deferred_errors as de


@pytest.fixture(autouse=True)
def _checked_mode():
    crfkit.deferred_errors(False)
    yield
    crfkit.deferred_errors(False)


def test_a_call_switches_and_a_block_restores():
    assert not de.is_deferred()
    crfkit.deferred_errors()
    assert de.is_deferred()
    with crfkit.deferred_errors(False):
        assert not de.is_deferred()
        with crfkit.deferred_errors():
            assert de.is_deferred()
        assert not de.is_deferred()
    assert de.is_deferred()
    with pytest.raises(RuntimeError, match="boom"), crfkit.deferred_errors(False):
        raise RuntimeError("boom")  # the block's exception passes through, the mode is restored
    assert de.is_deferred()


def test_enabled_must_be_a_bool():
    with pytest.raises(TypeError, match="enabled must be a bool, got int"):
        crfkit.deferred_errors(1)
    assert not de.is_deferred()


def test_check_errors_without_cuda_ops_has_nothing_to_raise():
    crfkit.check_errors()


CLEAR = de._CLEAR


@pytest.mark.parametrize("words, pattern", [
    ([3, 0, CLEAR, CLEAR, CLEAR, 1, 0], r"lengths\[3\] was outside \[0, seq_len\]"),  # lengths first
    ([CLEAR, 7, CLEAR, CLEAR, CLEAR, CLEAR, CLEAR], r"transitions contained NaN or \+inf"),
    ([CLEAR, CLEAR, 0, CLEAR, CLEAR, CLEAR, CLEAR], r"start contained NaN or \+inf"),
    ([CLEAR, CLEAR, CLEAR, 2, CLEAR, CLEAR, CLEAR], r"end contained NaN or \+inf"),
    ([CLEAR, CLEAR, CLEAR, CLEAR, 41, CLEAR, CLEAR],
     r"a tag was not a tag index in \[0, num_tags\) \(flat index 41 of tags\)"),
    ([CLEAR, CLEAR, CLEAR, CLEAR, CLEAR, 5, 2], r"emissions\[5\] contained NaN or \+inf within its length"),
    ([CLEAR, CLEAR, CLEAR, CLEAR, CLEAR, CLEAR, 2], r"noise\[:, 2\] contained NaN or \+-inf"),
])
def test_the_first_recorded_error_is_named(words, pattern):
    message = de._message(words, 0)
    assert message.startswith("crfkit: a CUDA op on cuda:0 since the last check_errors() was given bad input: ")
    assert __import__("re").search(pattern, message)
    assert "CPU emulator" in de._message(words, -1)
