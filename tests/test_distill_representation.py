"""Representation-level distillation (crfkit.distill.representation): hidden-state MSE with a
learned projection, seed 002's GELU projection loss, attention-score MSE, layer mapping."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from crfkit.distill.representation import (
    GeluProjectionLoss,
    HiddenStateMSE,
    attention_mse,
    layer_transfer_loss,
    uniform_layer_map,
)


pytestmark = pytest.mark.usefixtures("one_thread")


B, L, DS, DT, H = 3, 4, 5, 7, 2


def hidden_batch(seed=0):
    """student (B, L, DS), teacher (B, L, DT) in float64, ragged mask (B, L) with an empty
    sentence; padding holds NaN / inf."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, L, DS, generator=g, dtype=torch.float64)
    teacher = torch.randn(B, L, DT, generator=g, dtype=torch.float64)
    mask = torch.arange(L) < torch.tensor([4, 2, 0])[:, None]
    student[~mask] = float("nan")
    teacher[~mask] = float("-inf")
    return student, teacher, mask


def real_rows(x, mask):
    return x[mask]


# --- HiddenStateMSE --------------------------------------------------------------------------

def test_hidden_mse_equal_widths_has_no_projection():
    loss = HiddenStateMSE(DS, DS)
    assert isinstance(loss.projection, nn.Identity) and len(list(loss.parameters())) == 0
    student, _, mask = hidden_batch()
    teacher = torch.randn(B, L, DS, dtype=torch.float64)
    expected = F.mse_loss(student[mask], teacher[mask])
    torch.testing.assert_close(loss(student, teacher, mask), expected)


@pytest.mark.parametrize("bias", [False, True])
def test_hidden_mse_projects_student_to_teacher_width(bias):
    loss = HiddenStateMSE(DS, DT, bias=bias).double()
    assert loss.projection.weight.shape == (DT, DS)
    assert (loss.projection.bias is not None) == bias
    student, teacher, mask = hidden_batch()
    projected = student[mask] @ loss.projection.weight.T + (loss.projection.bias if bias else 0)
    # Per position the mean over the teacher's features; 'mean' over real positions.
    per_position = ((projected - teacher[mask]) ** 2).mean(-1)
    torch.testing.assert_close(loss(student, teacher, mask), per_position.mean())
    torch.testing.assert_close(loss(student, teacher, mask, "sum"), per_position.sum())
    table = loss(student, teacher, mask, "none")
    assert table.shape == (B, L) and (table[~mask] == 0).all()
    torch.testing.assert_close(table[mask], per_position)


def test_hidden_mse_padding_does_not_reach_projection_gradient():
    loss = HiddenStateMSE(DS, DT).double()
    student, teacher, mask = hidden_batch()
    student.requires_grad_(True)
    loss(student, teacher, mask).backward()
    assert torch.isfinite(loss.projection.weight.grad).all()
    assert torch.isfinite(student.grad).all() and (student.grad[~mask] == 0).all()


def test_hidden_mse_gradcheck():
    loss = HiddenStateMSE(DS, DT, bias=True).double()
    student, teacher, mask = hidden_batch()
    student = torch.nan_to_num(student).requires_grad_(True)
    teacher = torch.nan_to_num(teacher, neginf=0.0).requires_grad_(True)
    # The projection's weight is passed as an input: gradcheck perturbs it in place.
    assert torch.autograd.gradcheck(lambda s, t, w: loss(s, t, mask), (student, teacher, loss.projection.weight))


# --- GeluProjectionLoss ------------------------------------------------------------------------

def ref_gelu(x):
    return 0.5 * x * (1 + math.erf(x / math.sqrt(2)))


def ref_projection(module, row):
    """GELU(W_f h + b_f) for one position, in Python floats."""
    weight, bias = module.projection.weight.tolist(), module.projection.bias.tolist()
    return [ref_gelu(sum(w * h for w, h in zip(weight_row, row)) + b) for weight_row, b in zip(weight, bias)]


def ref_distance(distance, z, t):
    if distance == "mse":
        return sum((a - b) ** 2 for a, b in zip(z, t)) / len(t)
    if distance == "cosine":
        dot = sum(a * b for a, b in zip(z, t))
        return 1 - dot / (math.sqrt(sum(a * a for a in z)) * math.sqrt(sum(b * b for b in t)))
    clip = lambda v: min(max(v, 1e-7), 1.0)  # noqa: E731
    return sum(clip(b) * math.log(clip(b) / clip(a)) for a, b in zip(z, t))


@pytest.mark.parametrize("distance", ["mse", "cosine", "keras_kld"])
def test_gelu_projection_matches_loop(distance):
    module = GeluProjectionLoss(DS, DT, distance=distance).double()
    student, teacher, mask = hidden_batch()
    if distance == "keras_kld":
        teacher = teacher.abs() / 3  # partly inside (0, 1], so the clipping is not everything
    expected = []
    for b in range(B):
        for i in range(L):
            if mask[b, i]:
                expected.append(ref_distance(distance, ref_projection(module, student[b, i].tolist()),
                                             teacher[b, i].tolist()))
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(module(student, teacher, mask), expected.mean())
    torch.testing.assert_close(module(student, teacher, mask, "sum"), expected.sum())
    table = module(student, teacher, mask, "none")
    assert (table[~mask] == 0).all()
    torch.testing.assert_close(table[mask], expected)


def test_gelu_projection_exists_for_equal_widths_and_learns():
    module = GeluProjectionLoss(DT, DT)
    assert isinstance(module.projection, nn.Linear)
    student, teacher, mask = hidden_batch()
    student = torch.randn(B, L, DT)
    teacher = teacher.float()
    module(student, teacher, mask).backward()
    assert torch.isfinite(module.projection.weight.grad).all()
    assert module.projection.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("distance", ["mse", "cosine"])
def test_gelu_projection_gradcheck(distance):
    module = GeluProjectionLoss(DS, DT, distance=distance).double()
    student, teacher, mask = hidden_batch()
    student = torch.nan_to_num(student).requires_grad_(True)
    teacher = torch.nan_to_num(teacher, neginf=0.0)
    # The projection's weight is passed as an input: gradcheck perturbs it in place.
    assert torch.autograd.gradcheck(lambda s, w: module(s, teacher, mask), (student, module.projection.weight))


# --- attention_mse -----------------------------------------------------------------------------

def score_batch(seed=0, fill=float("-inf")):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, H, L, L, generator=g, dtype=torch.float64)
    teacher = torch.randn(B, H, L, L, generator=g, dtype=torch.float64)
    mask = torch.arange(L) < torch.tensor([4, 2, 0])[:, None]
    pair = mask[:, None, :, None] & mask[:, None, None, :]
    # HF-style: padded keys get a huge negative score; padded queries hold anything.
    student = student.masked_fill(~pair, fill)
    teacher = teacher.masked_fill(~pair, torch.finfo(torch.float64).min)
    return student, teacher, mask


def ref_attention(student, teacher, pair):
    """(1/H) sum_h MSE_h, each head's MSE over the counted (b, q, k) entries of the batch."""
    per_head = []
    for h in range(student.shape[1]):
        errors = [(student[b, h, q, k].item() - teacher[b, h, q, k].item()) ** 2
                  for b in range(student.shape[0]) for q in range(student.shape[2]) for k in range(student.shape[3])
                  if pair[b, q, k]]
        per_head.append(sum(errors) / len(errors))
    return sum(per_head) / len(per_head)


@pytest.mark.parametrize("fill", [float("-inf"), -10000.0, float("nan")])
def test_attention_mse_matches_per_head_loop(fill):
    student, teacher, mask = score_batch(fill=fill)
    pair = mask[:, :, None] & mask[:, None, :]
    expected = ref_attention(student, teacher, pair)
    assert attention_mse(student, teacher, mask).item() == pytest.approx(expected, rel=1e-12)
    table = attention_mse(student, teacher, mask, "none")
    assert table.shape == (B, H, L, L) and torch.isfinite(table).all()
    assert (table[~pair[:, None].expand_as(table)] == 0).all()
    torch.testing.assert_close(attention_mse(student, teacher, mask, "sum"), table.sum())


def test_attention_mse_pair_mask_and_no_mask():
    student = torch.randn(B, H, L, L, dtype=torch.float64)
    teacher = torch.randn(B, H, L, L, dtype=torch.float64)
    torch.testing.assert_close(attention_mse(student, teacher), F.mse_loss(student, teacher))
    causal = torch.ones(L, L, dtype=torch.bool).tril().expand(B, L, L)
    assert attention_mse(student, teacher, causal).item() == pytest.approx(ref_attention(student, teacher, causal))


def test_attention_mse_gradients():
    student, teacher, mask = score_batch()
    student.requires_grad_(True)
    attention_mse(student, teacher, mask).backward()
    pair = (mask[:, :, None] & mask[:, None, :])[:, None].expand_as(student)
    assert torch.isfinite(student.grad).all() and (student.grad[~pair] == 0).all()
    clean_student = torch.where(pair, student.detach(), 0.0).requires_grad_(True)
    clean_teacher = torch.where(pair, teacher, 0.0).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s, t: attention_mse(s, t, mask), (clean_student, clean_teacher))


def test_attention_mse_fully_masked_is_zero():
    student, teacher, mask = score_batch()
    assert attention_mse(student, teacher, torch.zeros_like(mask)).item() == 0.0


# --- uniform_layer_map and layer_transfer_loss ---------------------------------------------------

def test_uniform_layer_map_values():
    assert uniform_layer_map(6, 12) == [2, 4, 6, 8, 10, 12]
    assert uniform_layer_map(4, 12) == [3, 6, 9, 12]
    assert uniform_layer_map(12, 12) == list(range(1, 13))
    assert uniform_layer_map(1, 12) == [12]
    assert uniform_layer_map(6, 12, include_embeddings=True) == [0, 2, 4, 6, 8, 10, 12]
    assert uniform_layer_map(4, 6, allow_uneven=True) == [1, 3, 4, 6]
    uneven = uniform_layer_map(5, 12, allow_uneven=True)
    assert uneven[-1] == 12 and all(a < b for a, b in zip(uneven, uneven[1:]))


@pytest.mark.parametrize("args,exception,pattern", [
    ((5, 12), ValueError, "not a multiple"),
    ((13, 12), ValueError, "exceeds num_teacher_layers"),
    ((0, 12), ValueError, "num_student_layers must be a positive int, got 0"),
    ((2, 0), ValueError, "num_teacher_layers must be a positive int, got 0"),
    ((2.0, 12), TypeError, "num_student_layers must be an int"),
    ((True, 12), TypeError, "num_student_layers must be an int"),
])
def test_uniform_layer_map_bad_arguments(args, exception, pattern):
    with pytest.raises(exception, match=pattern):
        uniform_layer_map(*args)


def test_layer_transfer_loss_sums_mapped_layers():
    # Hugging Face layout: hidden_states[0] = embeddings, attentions[j - 1] = layer j.
    M, N = 2, 4
    student_hidden = [torch.randn(B, L, DS, dtype=torch.float64) for _ in range(M + 1)]
    teacher_hidden = [torch.randn(B, L, DT, dtype=torch.float64) for _ in range(N + 1)]
    student_scores = [torch.randn(B, H, L, L, dtype=torch.float64) for _ in range(M)]
    teacher_scores = [torch.randn(B, H, L, L, dtype=torch.float64) for _ in range(N)]
    mask = torch.arange(L) < torch.tensor([4, 2, 1])[:, None]
    hidden = HiddenStateMSE(DS, DT).double()
    layer_map = uniform_layer_map(M, N)
    got = layer_transfer_loss(student_hidden, teacher_hidden, layer_map, hidden, student_scores, teacher_scores, mask)
    expected = (hidden(student_hidden[1], teacher_hidden[2], mask)
                + attention_mse(student_scores[0], teacher_scores[1], mask)
                + hidden(student_hidden[2], teacher_hidden[4], mask)
                + attention_mse(student_scores[1], teacher_scores[3], mask))
    torch.testing.assert_close(got, expected)
    with_embeddings = layer_transfer_loss(student_hidden, teacher_hidden,
                                          uniform_layer_map(M, N, include_embeddings=True),
                                          hidden, student_scores, teacher_scores, mask)
    torch.testing.assert_close(with_embeddings, expected + hidden(student_hidden[0], teacher_hidden[0], mask))
    with pytest.raises(ValueError, match="layer_map has 3 entries"):
        layer_transfer_loss(student_hidden[:2], teacher_hidden, layer_map + [4], hidden)
    with pytest.raises(ValueError, match="pass both"):
        layer_transfer_loss(student_hidden, teacher_hidden, layer_map, hidden, student_scores)


# --- bad arguments -------------------------------------------------------------------------------

def test_representation_bad_arguments():
    student, teacher, mask = hidden_batch()
    module = HiddenStateMSE(DS, DT).double()
    with pytest.raises(ValueError, match="student_hidden must have width student_width = 5"):
        module(teacher, teacher, mask)
    with pytest.raises(ValueError, match="teacher_hidden must have width teacher_width = 7"):
        module(student, student, mask)
    with pytest.raises(ValueError, match="must cover the same positions"):
        module(student, teacher[:, :2], mask)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        module(student, teacher, mask.float())
    with pytest.raises(ValueError, match="reduction must be one of"):
        module(student, teacher, mask, "mean_over_batch")
    with pytest.raises(TypeError, match="student_width must be an int"):
        HiddenStateMSE(5.0, 7)
    with pytest.raises(ValueError, match="teacher_width must be a positive int, got 0"):
        GeluProjectionLoss(5, 0)
    with pytest.raises(ValueError, match="distance must be one of"):
        GeluProjectionLoss(5, 7, distance="kl")
    with pytest.raises(ValueError, match="approximate must be"):
        GeluProjectionLoss(5, 7, approximate="fast")
    scores, other, _ = score_batch()
    with pytest.raises(ValueError, match="same shape \\(same number of heads\\)"):
        attention_mse(scores, other[:, :1])
    with pytest.raises(ValueError, match="student_scores must have 4 dimensions"):
        attention_mse(scores[0], other[0])
    with pytest.raises(ValueError, match="mask must have shape"):
        attention_mse(scores, other, mask[:, :2])
    with pytest.raises(TypeError, match="teacher_scores must be a floating-point"):
        attention_mse(scores, other.long())
