"""Output-level distillation losses (crfkit.distill.output) against explicit per-position loops."""
import math

import pytest
import torch
import torch.nn.functional as F

from crfkit.distill.output import hard_cross_entropy, logit_mse, soft_cross_entropy


pytestmark = pytest.mark.usefixtures("one_thread")


B, L, C = 3, 5, 4


def batch(dtype=torch.float64, seed=0):
    """student, teacher logits (B, L, C), a ragged mask (B, L) (one sentence fully padded),
    labels (B, L); padded positions hold NaN / inf / out-of-range garbage."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, L, C, generator=g, dtype=torch.float64)
    teacher = torch.randn(B, L, C, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, C, (B, L), generator=g)
    lengths = torch.tensor([5, 2, 0])
    mask = torch.arange(L) < lengths[:, None]
    student[~mask] = float("nan")
    teacher[~mask] = float("inf")
    labels[~mask] = 12345  # out of range: must never be read
    return student.to(dtype), teacher.to(dtype), mask, labels


# --- explicit references: one position at a time, plain Python maths ----------------------

def ref_softmax(row, tau=1.0):
    top = max(v / tau for v in row)
    exps = [math.exp(v / tau - top) for v in row]
    total = sum(exps)
    return [e / total for e in exps]


def ref_logit_mse(s, t, scale=1.0):
    return scale * sum((a - b) ** 2 for a, b in zip(s, t))


def ref_soft_ce(s, t, tau, squared=True):
    p_t = ref_softmax(t, tau)
    p_s = ref_softmax(s, tau)
    value = -sum(pt * math.log(ps) for pt, ps in zip(p_t, p_s) if pt > 0)
    return value * (tau ** 2 if squared else 1.0)


def ref_hard_ce(s, label):
    return -math.log(ref_softmax(s)[label])


def per_position(fn, mask, *tensors):
    """(B, L) table of fn over the real positions (0 elsewhere), computed in Python floats."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for i in range(mask.shape[1]):
            if mask[b, i]:
                out[b, i] = fn(*[x[b, i].tolist() for x in tensors])
    return out


def reduced(table, mask, reduction):
    if reduction == "none":
        return table
    total = table.sum()
    return total if reduction == "sum" else total / max(int(mask.sum()), 1)


# --- values --------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_logit_mse_matches_loop(reduction):
    student, teacher, mask, _ = batch()
    expected = per_position(lambda s, t: ref_logit_mse(s, t, 0.5), mask, student, teacher)
    got = logit_mse(student, teacher, mask, reduction=reduction, scale=0.5)
    torch.testing.assert_close(got, reduced(expected, mask, reduction))


def test_logit_mse_relation_to_torch_mse():
    student, teacher, mask, _ = batch()
    torch_mean = F.mse_loss(student[mask], teacher[mask])
    torch.testing.assert_close(logit_mse(student, teacher, mask), C * torch_mean)
    torch.testing.assert_close(logit_mse(student, teacher, mask, scale=1 / C), torch_mean)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("tau,squared", [(1.0, True), (3.0, True), (3.0, False), (0.5, True)])
def test_soft_cross_entropy_matches_loop(reduction, tau, squared):
    student, teacher, mask, _ = batch()
    expected = per_position(lambda s, t: ref_soft_ce(s, t, tau, squared), mask, student, teacher)
    got = soft_cross_entropy(student, teacher, tau, mask, reduction, scale_by_temperature_squared=squared)
    torch.testing.assert_close(got, reduced(expected, mask, reduction))


def test_soft_cross_entropy_gradient_is_tau_times_probability_gap():
    # d l / d z_s = tau^2 * (p_s - p_t) / tau = tau * (p_s - p_t) with the tau^2 factor.
    student, teacher, mask, _ = batch()
    tau = 2.5
    student = student.clone().requires_grad_(True)
    soft_cross_entropy(student, teacher, tau, mask, reduction="sum").backward()
    gap = torch.softmax(student.detach() / tau, -1) - torch.softmax(teacher / tau, -1)
    torch.testing.assert_close(student.grad[mask], tau * gap[mask])
    assert (student.grad[~mask] == 0).all()


def test_soft_cross_entropy_is_kl_plus_teacher_entropy():
    student, teacher, mask, _ = batch()
    tau = 2.0
    p_t = torch.softmax(teacher[mask] / tau, -1)
    kl = F.kl_div(torch.log_softmax(student[mask] / tau, -1), p_t, reduction="sum")
    entropy = -(p_t * p_t.log()).sum()
    torch.testing.assert_close(soft_cross_entropy(student, teacher, tau, mask, "sum"), tau ** 2 * (kl + entropy))


def test_soft_cross_entropy_teacher_zero_probabilities():
    # Teacher -inf (probability 0, e.g. log of CRF marginals) where the student is -inf too:
    # 0 * log 0 = 0, no NaN in the loss or the gradient.
    student = torch.tensor([[0.3, float("-inf"), 1.0]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[0.0, float("-inf"), 0.5]], dtype=torch.float64)
    loss = soft_cross_entropy(student, teacher)
    expected = ref_soft_ce([0.3, -1e300, 1.0], [0.0, -1e300, 0.5], 1.0)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert torch.isfinite(student.grad).all()
    assert student.grad[0, 1] == 0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_hard_cross_entropy_matches_loop_and_torch(reduction):
    student, _, mask, labels = batch()
    labels = labels.clone()
    labels[0, 3] = -100  # ignored at a real position
    counted = mask & (labels != -100)
    expected = per_position(lambda s, y: ref_hard_ce(s, y), counted, student, labels)
    got = hard_cross_entropy(student, labels, mask, reduction=reduction)
    torch.testing.assert_close(got, reduced(expected, counted, reduction))
    if reduction == "mean":
        torch.testing.assert_close(got, F.cross_entropy(student[mask], labels[mask], ignore_index=-100))


def test_hard_cross_entropy_custom_ignore_index_without_mask():
    student, _, _, labels = batch()
    student = torch.nan_to_num(student, nan=0.25)
    labels = labels.clamp(max=C - 1)
    labels[1, :] = 7
    labels[1, 2] = 7
    got = hard_cross_entropy(student.reshape(-1, C), labels.reshape(-1), ignore_index=7)
    keep = labels.reshape(-1) != 7
    torch.testing.assert_close(got, F.cross_entropy(student.reshape(-1, C)[keep], labels.reshape(-1)[keep]))


def test_flat_positions_equal_batched():
    student, teacher, mask, labels = batch()
    flat_student, flat_teacher = student.reshape(-1, C), teacher.reshape(-1, C)
    flat_mask, flat_labels = mask.reshape(-1), labels.reshape(-1)
    torch.testing.assert_close(logit_mse(flat_student, flat_teacher, flat_mask), logit_mse(student, teacher, mask))
    torch.testing.assert_close(soft_cross_entropy(flat_student, flat_teacher, 2.0, flat_mask),
                               soft_cross_entropy(student, teacher, 2.0, mask))
    torch.testing.assert_close(hard_cross_entropy(flat_student, flat_labels, flat_mask),
                               hard_cross_entropy(student, labels, mask))
    assert logit_mse(flat_student, flat_teacher, flat_mask, reduction="none").shape == (B * L,)


# --- masking ---------------------------------------------------------------------------------

LOSSES = {
    "logit_mse": lambda s, t, m, y, r: logit_mse(s, t, m, r),
    "soft_cross_entropy": lambda s, t, m, y, r: soft_cross_entropy(s, t, 2.0, m, r),
    "hard_cross_entropy": lambda s, t, m, y, r: hard_cross_entropy(s, y, m, reduction=r),
}


@pytest.mark.parametrize("name", LOSSES)
def test_padding_garbage_does_not_leak(name):
    student, teacher, mask, labels = batch()
    student = student.clone().requires_grad_(True)
    teacher = teacher.clone().requires_grad_(True)
    per_pos = LOSSES[name](student, teacher, mask, labels, "none")
    assert per_pos.shape == (B, L)
    assert torch.isfinite(per_pos).all() and (per_pos[~mask] == 0).all()
    LOSSES[name](student, teacher, mask, labels, "mean").backward()
    for x in (student, teacher):
        if x.grad is not None:
            assert torch.isfinite(x.grad).all()
            assert (x.grad[~mask] == 0).all()
    # The real positions' values do not depend on what the padding holds.
    clean_student = torch.where(mask[..., None], student.detach(), 0.0)
    clean_teacher = torch.where(mask[..., None], teacher.detach(), 0.0)
    torch.testing.assert_close(LOSSES[name](clean_student, clean_teacher, mask, labels, "sum"),
                               LOSSES[name](student.detach(), teacher.detach(), mask, labels, "sum"))


@pytest.mark.parametrize("name", LOSSES)
def test_fully_masked_batch_gives_zero(name):
    student, teacher, mask, labels = batch()
    student = student.clone().requires_grad_(True)
    nothing = torch.zeros_like(mask)
    loss = LOSSES[name](student, teacher, nothing, labels, "mean")
    assert loss.item() == 0.0
    loss.backward()
    assert (student.grad == 0).all()
    assert LOSSES[name](student, teacher, nothing, labels, "sum").item() == 0.0


def test_empty_batch_mean_is_zero():
    empty = torch.zeros(0, C)
    assert logit_mse(empty, empty).item() == 0.0
    assert soft_cross_entropy(empty, empty).item() == 0.0
    assert hard_cross_entropy(empty, torch.zeros(0, dtype=torch.long)).item() == 0.0


# --- gradients ---------------------------------------------------------------------------------

def test_gradcheck_float64():
    student, teacher, mask, labels = (x[:2, :3] for x in batch())  # one full and one short sentence
    student = torch.where(mask[..., None], student, 0.0).requires_grad_(True)
    teacher = torch.where(mask[..., None], teacher, 0.0).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s, t: logit_mse(s, t, mask, scale=0.5), (student, teacher))
    assert torch.autograd.gradcheck(lambda s, t: soft_cross_entropy(s, t, 1.7, mask, "sum"), (student, teacher))
    assert torch.autograd.gradcheck(lambda s: hard_cross_entropy(s, labels, mask, reduction="none"), (student,))


def test_half_precision_is_computed_in_float32():
    student, teacher, mask, labels = batch()
    student = torch.nan_to_num(student).half()
    teacher = torch.nan_to_num(teacher, posinf=0.0).bfloat16()
    for loss in (logit_mse(student, teacher, mask), soft_cross_entropy(student, teacher, 2.0, mask),
                 hard_cross_entropy(student, labels, mask)):
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
    expected = logit_mse(student.double(), teacher.double(), mask)
    torch.testing.assert_close(logit_mse(student, teacher, mask).double(), expected)


# --- bad arguments -----------------------------------------------------------------------------

def _good():
    student, teacher, mask, labels = batch(torch.float32)
    return student, teacher, mask, labels


BAD = [
    ("reduction", lambda s, t, m, y: logit_mse(s, t, m, reduction="average"), ValueError, "reduction must be one of"),
    ("student list", lambda s, t, m, y: logit_mse(s.tolist(), t, m), TypeError,
     "student_logits must be a torch.Tensor"),
    ("student int", lambda s, t, m, y: soft_cross_entropy(y, t, mask=m), TypeError,
     "student_logits must be a floating-point"),
    ("student 4-d", lambda s, t, m, y: logit_mse(s[None], t[None]), ValueError,
     "student_logits must have 2 or 3 dimensions"),
    ("shape mismatch", lambda s, t, m, y: logit_mse(s, t[..., :2], m), ValueError, "must have the same shape"),
    ("mask dtype", lambda s, t, m, y: logit_mse(s, t, m.long()), TypeError, "mask must be a bool tensor"),
    ("mask shape", lambda s, t, m, y: soft_cross_entropy(s, t, mask=m[:, :2]), ValueError, "mask must have shape"),
    ("mask type", lambda s, t, m, y: logit_mse(s, t, m.tolist()), TypeError, "mask must be a bool torch.Tensor"),
    ("temperature 0", lambda s, t, m, y: soft_cross_entropy(s, t, 0.0, m), ValueError,
     "temperature must be a finite positive"),
    ("temperature nan", lambda s, t, m, y: soft_cross_entropy(s, t, float("nan"), m), ValueError, "temperature"),
    ("temperature str", lambda s, t, m, y: soft_cross_entropy(s, t, "2", m), TypeError,
     "temperature must be a real number"),
    ("scale flag", lambda s, t, m, y: soft_cross_entropy(s, t, 2.0, m, scale_by_temperature_squared=1), TypeError,
     "scale_by_temperature_squared must be a bool"),
    ("scale negative", lambda s, t, m, y: logit_mse(s, t, m, scale=-1.0), ValueError,
     "scale must be a finite non-negative"),
    ("labels float", lambda s, t, m, y: hard_cross_entropy(s, y.float(), m), TypeError, "labels must be an integer"),
    ("labels shape", lambda s, t, m, y: hard_cross_entropy(s, y[:, :2], m), ValueError, "labels must have shape"),
    ("labels range", lambda s, t, m, y: hard_cross_entropy(s, y.clamp(max=0) + C, m), ValueError,
     "labels at counted positions"),
    ("labels negative", lambda s, t, m, y: hard_cross_entropy(s, y.clamp(max=0) - 1, m), ValueError,
     "labels at counted positions"),
    ("ignore_index", lambda s, t, m, y: hard_cross_entropy(s, y, m, ignore_index=1.5), TypeError,
     "ignore_index must be an int"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_arguments(case):
    _, call, exception, pattern = case
    with pytest.raises(exception, match=pattern):
        call(*_good())
