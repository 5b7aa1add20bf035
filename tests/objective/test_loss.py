"""Tests for gspo_trl.objective.loss.policy_loss (GSPO Eq. 5-7, GSPO-token Eq. 13-14, GRPO per-token)."""

import math

import pytest
import torch

from gspo_trl.objective.loss import AGGREGATIONS, Objective, masked_mean, policy_loss

LEVELS = ("sequence", "sequence_token", "token")
F64 = torch.float64


def leaf(values):
    return torch.tensor(values, dtype=F64, requires_grad=True)


def loss_and_grad(logps, *args, **kwargs):
    logps = logps.detach().clone().requires_grad_(True)
    loss, stats = policy_loss(logps, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.detach(), grad, stats


def random_batch(seed=0, B=6, T=8, scale=1e-3, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = logps + scale * torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if empty_row:
        lengths[-1] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    return logps, old, adv, mask


# Shared hand example: B=2, T=3, row 1 has 2 valid tokens; clip range [0.9, 1.2].
# log-ratios: row 0 = (0.3, 0, 0) -> log s_0 = 0.1;  row 1 = (-0.1, -0.3) -> log s_1 = -0.2.
HAND_LOGPS = [[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]]
HAND_OLD = [[-1.3, -2.0, -0.5], [-0.2, -0.4, 0.0]]
HAND_MASK = [[1, 1, 1], [1, 1, 0]]
HAND_EPS = dict(epsilon=0.1, epsilon_high=0.2)


def hand_inputs():
    return leaf(HAND_LOGPS), torch.tensor(HAND_OLD, dtype=F64), torch.tensor(HAND_MASK, dtype=F64)


def test_sequence_hand_computed():
    logps, old, mask = hand_inputs()
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, stats = policy_loss(logps, old, adv, mask, importance_sampling_level="sequence", **HAND_EPS)
    loss.backward()
    # s_0 = e^0.1 = 1.1052 in [0.9, 1.2], A=+1 -> objective e^0.1.
    # s_1 = e^-0.2 = 0.8187 < 0.9, A=-1 -> min(-0.8187, -0.9) = -0.9 (clipped low, no gradient).
    # loss = -(e^0.1 - 0.9) / 2 = -0.10259
    assert loss.item() == pytest.approx(-(math.exp(0.1) - 0.9) / 2, rel=1e-12)
    # d loss / d logp_0,t = -(1/B) * A_0 * s_0 / |y_0| = -e^0.1 / 6 on each token of row 0.
    g = -math.exp(0.1) / 6
    torch.testing.assert_close(logps.grad, torch.tensor([[g, g, g], [0.0, 0.0, 0.0]], dtype=F64))
    assert stats["clip_fraction_low"].item() == 0.5 and stats["clip_fraction_high"].item() == 0.0
    assert stats["clip_fraction"].item() == 0.5
    assert stats["ratio_mean"].item() == pytest.approx((math.exp(0.1) + math.exp(-0.2)) / 2)
    assert stats["ratio_min"].item() == pytest.approx(math.exp(-0.2))
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.1))
    assert stats["log_ratio_abs_mean"].item() == pytest.approx(0.15)  # (0.1 + 0.2) / 2
    assert stats["kl_mean"].item() == 0.0
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


def test_token_hand_computed():
    logps, old, mask = hand_inputs()
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, stats = policy_loss(logps, old, adv, mask, importance_sampling_level="token", **HAND_EPS)
    loss.backward()
    # row 0 (A=+1): r = e^0.3 = 1.3499 > 1.2 -> 1.2 (clipped high); r = 1, 1 -> mean (1.2 + 1 + 1) / 3.
    # row 1 (A=-1): r = e^-0.1 = 0.9048 inside -> -0.9048; r = e^-0.3 = 0.7408 < 0.9 -> -0.9 (clipped low).
    row0, row1 = 3.2 / 3, (-math.exp(-0.1) - 0.9) / 2
    assert loss.item() == pytest.approx(-(row0 + row1) / 2, rel=1e-12)
    # gradient -(1/B)(1/|y_i|) A r on unclipped tokens: row 0 -> -1/6; row 1 token 0 -> +e^-0.1 / 4.
    expected = torch.tensor([[0.0, -1 / 6, -1 / 6], [math.exp(-0.1) / 4, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logps.grad, expected)
    # 5 valid tokens: one clipped on each side.
    assert stats["clip_fraction_low"].item() == pytest.approx(0.2)
    assert stats["clip_fraction_high"].item() == pytest.approx(0.2)
    assert stats["clip_fraction"].item() == pytest.approx(0.4)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.3))
    assert stats["ratio_min"].item() == pytest.approx(math.exp(-0.3))
    assert stats["log_ratio_abs_mean"].item() == pytest.approx(0.7 / 5)  # (0.3 + 0 + 0 + 0.1 + 0.3) / 5


def test_sequence_token_hand_computed_per_token_advantages():
    logps, old, mask = hand_inputs()
    adv = torch.tensor([[1.0, -1.0, 2.0], [-1.0, 0.5, float("nan")]], dtype=F64)  # NaN sits on padding
    loss, stats = policy_loss(logps, old, adv, mask, importance_sampling_level="sequence_token", **HAND_EPS)
    loss.backward()
    # s_i,t has the value of s_i. Row 0: s_0 = e^0.1 inside -> mean_t s_0 A_t = s_0 (1 - 1 + 2) / 3.
    # Row 1: s_1 = e^-0.2 = 0.8187 < 0.9; token 0 (A=-1) clipped -> -0.9; token 1 (A=0.5) -> 0.5 s_1 (min picks it).
    row0, row1 = 2 * math.exp(0.1) / 3, (-0.9 + 0.5 * math.exp(-0.2)) / 2
    assert loss.item() == pytest.approx(-(row0 + row1) / 2, rel=1e-12)
    # d/d logp_i,t = -(1/B)(1/|y_i|) s_i A_i,t: only token t's own advantage enters.
    g0 = -math.exp(0.1) / 6
    expected = torch.tensor([[g0, -g0, 2 * g0], [0.0, -0.25 * 0.5 * math.exp(-0.2), 0.0]], dtype=F64)
    torch.testing.assert_close(logps.grad, expected)
    assert stats["clip_fraction_low"].item() == pytest.approx(0.2)  # 1 of 5 valid tokens
    assert stats["clip_fraction_high"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx((3 * math.exp(0.1) + 2 * math.exp(-0.2)) / 5)


def test_clip_boundaries_default_epsilons():
    # Every token of row i has log-ratio delta_i, so log s_i = delta_i. Range [1 - 3e-4, 1 + 4e-4].
    eps, eps_high = 3e-4, 4e-4
    up_in, up_out = math.log1p(eps_high) - 1e-6, math.log1p(eps_high) + 1e-6
    lo_in, lo_out = math.log1p(-eps) + 1e-6, math.log1p(-eps) - 1e-6
    deltas = torch.tensor([up_out, lo_out, up_in, lo_in, lo_out, up_out], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=F64)
    # row 0: A>0, s above 1+eps_high -> clipped high.   row 1: A<0, s below 1-eps -> clipped low.
    # rows 2, 3: just inside -> not clipped.           row 4: A>0, s low -> min keeps s A (not clipped).
    # row 5: A<0, s high -> min keeps s A (not clipped).
    B, T = 6, 4
    logps = -torch.rand(B, T, dtype=F64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=F64)
    mask[2, 3:] = 0
    for level in ("sequence", "sequence_token"):
        _, grad, stats = loss_and_grad(logps, logps - deltas[:, None], adv, mask, importance_sampling_level=level)
        row_has_grad = (grad != 0).any(dim=1).tolist()
        assert row_has_grad == [False, False, True, True, True, True], level
        assert grad[2, 3] == 0  # masked token
    # "sequence": fractions over the 6 valid sequences.
    _, _, stats = loss_and_grad(logps, logps - deltas[:, None], adv, mask)
    assert stats["clip_fraction_low"].item() == pytest.approx(1 / 6)
    assert stats["clip_fraction_high"].item() == pytest.approx(1 / 6)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 6)


@pytest.mark.parametrize("level", LEVELS)
def test_on_policy_ratio_one_and_sequence_mean_gradient(level):
    logps, _, adv, mask = random_batch(seed=2)
    B = logps.shape[0]
    loss, grad, stats = loss_and_grad(logps, None, adv, mask, importance_sampling_level=level)
    lengths = mask.sum(1)
    # ratio == 1 and unclipped: loss = -(1/B) sum_i A_i over non-empty rows.
    assert loss.item() == pytest.approx(-(adv * (lengths > 0)).sum().item() / B, rel=1e-12)
    expected = torch.where(mask.bool(), -adv[:, None] / (B * lengths.clamp(min=1)[:, None]), 0.0)
    torch.testing.assert_close(grad, expected)
    assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["clip_fraction"].item() == 0.0 and stats["log_ratio_abs_mean"].item() == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_gspo_equals_gspo_token_with_sequence_advantages(beta):
    logps, old, adv, mask = random_batch(seed=3)
    ref = logps + 0.1 * torch.randn(logps.shape, dtype=F64, generator=torch.Generator().manual_seed(4))
    kw = dict(beta=beta, ref_logps=ref, use_bias_correction_kl=False)
    l_seq, g_seq, s_seq = loss_and_grad(logps, old, adv, mask, importance_sampling_level="sequence", **kw)
    l_tok, g_tok, _ = loss_and_grad(logps, old, adv, mask, importance_sampling_level="sequence_token", **kw)
    assert 0 < s_seq["clip_fraction"].item() < 1  # the comparison covers clipped and unclipped rows
    torch.testing.assert_close(l_seq, l_tok)
    torch.testing.assert_close(g_seq, g_tok)


def test_bias_corrected_kl_differs_in_gradient_between_sequence_levels():
    # Documented consequence of a non-detached ratio: s_i spreads kl_t's weight over the whole sequence,
    # s_i,t only over token t. Values agree, gradients do not.
    logps, old, adv, mask = random_batch(seed=5)
    ref = logps + 0.3 * torch.randn(logps.shape, dtype=F64, generator=torch.Generator().manual_seed(6))
    kw = dict(beta=0.1, ref_logps=ref)
    l_seq, g_seq, _ = loss_and_grad(logps, old, adv, mask, importance_sampling_level="sequence", **kw)
    l_tok, g_tok, _ = loss_and_grad(logps, old, adv, mask, importance_sampling_level="sequence_token", **kw)
    torch.testing.assert_close(l_seq, l_tok)
    assert not torch.allclose(g_seq, g_tok)


def test_per_token_advantage_changes_only_its_own_gradient_entry():
    # GSPO-token: d loss / d logp_i,t = -(1/B)(1/|y_i|) s_i A_i,t (unclipped), so bumping A_0,1 by dA changes
    # exactly grad[0, 1], by -(1/B)(1/|y_0|) s_0 dA; the sg[.] keeps it off the rest of the sequence.
    logps, old, adv, mask = random_batch(seed=7)
    B = logps.shape[0]
    adv_tok = adv[:, None].expand_as(logps).clone()
    kw = dict(importance_sampling_level="sequence_token", epsilon=0.2, epsilon_high=0.2)
    l1, g1, _ = loss_and_grad(logps, old, adv_tok, mask, **kw)
    adv_tok[0, 1] += 0.7
    l2, g2, _ = loss_and_grad(logps, old, adv_tok, mask, **kw)
    changed = (g1 - g2).abs() > 1e-15
    assert changed.nonzero().tolist() == [[0, 1]]
    s0 = math.exp(masked_mean(logps - old, mask, dim=1)[0].item())
    n0 = mask[0].sum().item()
    assert (g2 - g1)[0, 1].item() == pytest.approx(-s0 * 0.7 / (B * n0), rel=1e-9)
    assert l2.item() == pytest.approx(l1.item() - s0 * 0.7 / (B * n0), rel=1e-9)


@pytest.mark.parametrize("level", LEVELS)
def test_fully_masked_row_contributes_zero(level):
    logps, old, adv, mask = random_batch(seed=8, B=3, T=5, scale=0.1, empty_row=True)
    kw = dict(importance_sampling_level=level, epsilon=0.05, epsilon_high=0.05)
    l3, g3, _ = loss_and_grad(logps, old, adv, mask, **kw)
    l2, g2, _ = loss_and_grad(logps[:2], old[:2], adv[:2], mask[:2], **kw)
    assert l3.item() == pytest.approx(l2.item() * 2 / 3, rel=1e-12)
    torch.testing.assert_close(g3[:2], g2 * 2 / 3)
    assert (g3[2] == 0).all()


@pytest.mark.parametrize("level", LEVELS)
def test_garbage_in_padding_does_not_leak(level):
    logps, old, adv, mask = random_batch(seed=9, scale=0.1)
    ref = logps + 0.2
    pad = ~mask.bool()
    adv_in = adv if level == "sequence" else adv[:, None].expand_as(logps).clone()
    kw = dict(importance_sampling_level=level, beta=0.1, epsilon=0.05, epsilon_high=0.05)
    clean = loss_and_grad(logps, old, adv_in, mask, ref_logps=ref, **kw)
    nan, inf = float("nan"), float("inf")
    dirty_adv = adv_in if level == "sequence" else adv_in.masked_fill(pad, nan)
    dirty = loss_and_grad(
        logps.masked_fill(pad, nan),
        old.masked_fill(pad, -inf),
        dirty_adv,
        mask,
        ref_logps=ref.masked_fill(pad, inf),
        **kw,
    )
    assert torch.isfinite(dirty[0]) and torch.isfinite(dirty[1]).all()
    torch.testing.assert_close(dirty[0], clean[0])
    torch.testing.assert_close(dirty[1], clean[1])
    assert (dirty[1][pad] == 0).all()
    for key in clean[2]:
        torch.testing.assert_close(dirty[2][key], clean[2][key])


@pytest.mark.parametrize("level", LEVELS)
def test_huge_log_ratios_stay_finite(level):
    B, T = 4, 3
    logps = torch.zeros(B, T)
    sign = torch.tensor([[1.0, -1.0, 1.0], [-1.0, -1.0, -1.0], [1.0, 1.0, 1.0], [-1.0, 1.0, 1.0]])
    old, ref = logps - 1e4 * sign, logps + 1e4 * sign
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    loss, grad, stats = loss_and_grad(
        logps, old, adv, torch.ones(B, T), importance_sampling_level=level, beta=0.1, ref_logps=ref
    )
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in stats.values())


def test_all_masked_batch_gives_zero_loss_with_grad_path():
    logps = torch.randn(2, 3, requires_grad=True)
    loss, stats = policy_loss(logps, None, torch.ones(2), torch.zeros(2, 3), beta=0.1, ref_logps=torch.zeros(2, 3))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert (logps.grad == 0).all()
    assert stats["ratio_mean"].item() == 1.0 and stats["clip_fraction"].item() == 0.0


def test_kl_k3_hand_computed():
    # d = ref - logp: row 0 = (0.5, -0.5), row 1 = (1.0, pad). k3(d) = e^d - d - 1.
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    logps = leaf([[-1.0, -2.0], [-0.5, 0.0]])
    ref = torch.tensor([[-0.5, -2.5], [0.5, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=F64)
    beta = 0.1
    # A = 0: the policy term vanishes; on-policy ratio is 1 so the correction does not change the value.
    expected = beta * ((k3(0.5) + k3(-0.5)) / 2 + k3(1.0)) / 2  # 0.1 * (0.12763 + 0.71828) / 2
    for level in LEVELS:
        for correct in (True, False):
            loss, stats = policy_loss(
                logps,
                None,
                torch.zeros(2, dtype=F64),
                mask,
                importance_sampling_level=level,
                beta=beta,
                ref_logps=ref,
                use_bias_correction_kl=correct,
            )
            assert loss.item() == pytest.approx(expected, rel=1e-12)
            assert stats["kl_mean"].item() == pytest.approx((k3(0.5) + k3(-0.5) + k3(1.0)) / 3)
    # Gradient without correction: beta/(B |y_i|) * d k3/d logp = beta/(B |y_i|) * (1 - e^d).
    _, g, _ = loss_and_grad(
        logps, None, torch.zeros(2, dtype=F64), mask, beta=beta, ref_logps=ref, use_bias_correction_kl=False
    )
    w = [[beta / 4, beta / 4], [beta / 2, 0.0]]
    d = [[0.5, -0.5], [1.0, 0.0]]
    expected_g = torch.tensor([[w[i][j] * (1 - math.exp(d[i][j])) for j in range(2)] for i in range(2)], dtype=F64)
    torch.testing.assert_close(g, expected_g)
    # Token level with correction: the ratio is not detached, d(r k3) = r dk3 + k3 dr, r = 1 -> extra + k3.
    _, g, _ = loss_and_grad(
        logps,
        None,
        torch.zeros(2, dtype=F64),
        mask,
        importance_sampling_level="token",
        beta=beta,
        ref_logps=ref,
    )
    expected_g = torch.tensor(
        [[w[i][j] * (1 - math.exp(d[i][j]) + k3(d[i][j])) for j in range(2)] for i in range(2)], dtype=F64
    )
    torch.testing.assert_close(g, expected_g)


@pytest.mark.parametrize("level", LEVELS)
def test_kl_without_bias_correction_ignores_old_logps(level):
    logps, old, _, mask = random_batch(seed=10, scale=0.5)
    ref = logps + 0.3
    zero_adv = torch.zeros(logps.shape[0], dtype=F64)
    kw = dict(importance_sampling_level=level, beta=0.2, ref_logps=ref)
    a = loss_and_grad(logps, old, zero_adv, mask, use_bias_correction_kl=False, **kw)
    b = loss_and_grad(logps, old + 0.7, zero_adv, mask, use_bias_correction_kl=False, **kw)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    c = loss_and_grad(logps, old + 0.7, zero_adv, mask, use_bias_correction_kl=True, **kw)
    assert not torch.allclose(a[0], c[0])


def test_token_level_matches_grpo_reference():
    logps, old, adv, mask = random_batch(seed=11, scale=0.2)
    eps, eps_high = 0.1, 0.15
    loss, grad, stats = loss_and_grad(
        logps, old, adv, mask, importance_sampling_level="token", epsilon=eps, epsilon_high=eps_high
    )
    # Straightforward GRPO: per-token ratio, clip, pessimistic min, per-sequence mean, batch mean.
    ref_logps = logps.detach().clone().requires_grad_(True)
    rows = []
    for i in range(logps.shape[0]):
        n = int(mask[i].sum())
        if n == 0:
            rows.append(torch.zeros((), dtype=F64))
            continue
        r = torch.exp(ref_logps[i, :n] - old[i, :n])
        obj = torch.minimum(r * adv[i], torch.clamp(r, 1 - eps, 1 + eps_high) * adv[i])
        rows.append(-obj.mean())
    ref_loss = torch.stack(rows).mean()
    ref_loss.backward()
    assert stats["clip_fraction"].item() > 0
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(grad, ref_logps.grad)


def test_the_earlier_argument_names_say_the_new_ones():
    with pytest.raises(TypeError, match="ref_per_token_logps is now called ref_logps"):
        policy_loss(torch.zeros(2, 3), None, torch.zeros(2), torch.ones(2, 3), ref_per_token_logps=torch.zeros(2, 3))


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(importance_sampling_level="seq"), "importance_sampling_level"),
        (dict(logps=torch.zeros(4)), "logps"),
        (dict(old_logps=torch.zeros(2, 4)), "old_logps"),
        (dict(completion_mask=torch.ones(3, 3)), "completion_mask"),
        (dict(ref_logps=torch.zeros(2, 2)), "ref_logps"),
        (dict(advantages=torch.zeros(3)), "advantages"),
        (dict(advantages=torch.zeros(2, 3)), "sequence_token"),
        (dict(epsilon=-0.1), r"epsilon must be in \(0, 1\)"),
        (dict(epsilon=0.0), r"epsilon must be in \(0, 1\)"),  # the lower clip bound would be 1 itself
        (dict(epsilon=float("nan")), r"epsilon must be in \(0, 1\)"),
        (dict(epsilon=1.0), r"epsilon must be in \(0, 1\)"),
        (dict(epsilon_high=-0.1), "epsilon_high must be > 0"),
        (dict(epsilon_high=0.0), "epsilon_high must be > 0"),  # for cispo, a cap of 0 zeroes the loss
        (dict(beta=-1.0), "beta"),
        (dict(beta=0.1), "ref_logps"),
    ],
)
def test_invalid_inputs_raise_value_error_naming_the_argument(change, name):
    kwargs = dict(
        logps=torch.zeros(2, 3),
        old_logps=None,
        advantages=torch.zeros(2),
        completion_mask=torch.ones(2, 3),
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=name):
        policy_loss(**kwargs)


# --- turn level (multi-turn GSPO: Eq. 7 per assistant turn) ------------------------------------


def test_turn_hand_computed():
    logps, old, mask = hand_inputs()
    # Row 0: turn 0 = tokens 0-1 (log-ratios 0.3, 0 -> log s = 0.15), turn 1 = token 2 (log s = 0).
    # Row 1: turn 0 = token 0 (log s = -0.1), turn 1 = token 1 (log s = -0.3).
    turn_ids = torch.tensor([[0, 0, 1], [0, 1, 7]])  # 7 sits on padding
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, float("nan")]], dtype=F64)  # per-turn, NaN on padding
    loss, stats = policy_loss(logps, old, adv, mask, importance_sampling_level="turn", turn_ids=turn_ids, **HAND_EPS)
    loss.backward()
    # Row 0: s = e^0.15 = 1.1618 inside [0.9, 1.2] with A=+1 on 2 tokens; s = 1 with A=-1 on 1 token.
    # Row 1: s = e^-0.1 inside with A=-1; s = e^-0.3 = 0.7408 < 0.9 with A=+2: the min keeps the ratio term.
    row0 = (2 * math.exp(0.15) - 1) / 3
    row1 = (-math.exp(-0.1) + 2 * math.exp(-0.3)) / 2
    assert loss.item() == pytest.approx(-(row0 + row1) / 2, rel=1e-12)
    # d/d logp_t = -(1/B)(1/|y_i|) A_k s_k for every token t of turn k: each token weighs 1/|y_i|, as in Eq. 7.
    expected = torch.tensor(
        [
            [-math.exp(0.15) / 6, -math.exp(0.15) / 6, 1 / 6],
            [math.exp(-0.1) / 4, -2 * math.exp(-0.3) / 4, 0.0],
        ],
        dtype=F64,
    )
    torch.testing.assert_close(logps.grad, expected)
    assert stats["clip_fraction"].item() == 0.0
    # Statistics are over tokens at the turn level.
    assert stats["ratio_mean"].item() == pytest.approx((2 * math.exp(0.15) + 1 + math.exp(-0.1) + math.exp(-0.3)) / 5)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.15))
    assert stats["ratio_min"].item() == pytest.approx(math.exp(-0.3))


def test_turn_clips_each_turn_on_its_own():
    # One row, two turns: turn 0 drifted above the range (clipped, no gradient), turn 1 is on-policy.
    logps = leaf([[-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.5, -1.5, -1.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    turn_ids = torch.tensor([[0, 0, 1]])
    adv = torch.ones(1, 3, dtype=F64)
    loss, stats = policy_loss(logps, old, adv, mask, importance_sampling_level="turn", turn_ids=turn_ids, **HAND_EPS)
    loss.backward()
    assert loss.item() == pytest.approx(-(2 * 1.2 + 1.0) / 3, rel=1e-12)
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0, -1 / 3]], dtype=F64))
    assert stats["clip_fraction_high"].item() == pytest.approx(2 / 3)  # 2 of 3 tokens sit in a clipped turn
    # The sequence level would average the two turns (log s = 1/3 -> clipped too) and give no gradient at all.
    seq_logps = logps.detach().clone().requires_grad_(True)
    policy_loss(seq_logps, old, adv[:, 0], mask, importance_sampling_level="sequence", **HAND_EPS)[0].backward()
    assert seq_logps.grad.abs().sum().item() == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_turn_with_one_turn_equals_sequence(beta):
    logps, old, adv, mask = random_batch(seed=11, scale=5e-4)
    ref = logps + 0.1 * torch.randn(logps.shape, dtype=F64, generator=torch.Generator().manual_seed(12))
    kw = dict(beta=beta, ref_logps=ref)
    l_seq, g_seq, s_seq = loss_and_grad(logps, old, adv, mask, importance_sampling_level="sequence", **kw)
    assert 0 < s_seq["clip_fraction"].item() < 1  # the comparison covers clipped and unclipped rows
    for turn_ids in (torch.zeros(logps.shape, dtype=torch.long), None):
        l_turn, g_turn, _ = loss_and_grad(
            logps, old, adv, mask, importance_sampling_level="turn", turn_ids=turn_ids, **kw
        )
        torch.testing.assert_close(l_turn, l_seq, rtol=1e-13, atol=0)
        torch.testing.assert_close(g_turn, g_seq, rtol=1e-12, atol=1e-16)


def test_turn_equals_sequence_level_on_each_turn_as_its_own_row():
    # With a token-sum aggregation ("luspo": sum_t l_t per row), a row of K turns contributes exactly what its K
    # turns would as K separate sequences at the sequence level (Eq. 7 on each), in loss and gradient.
    g = torch.Generator().manual_seed(5)
    B, T = 4, 9
    logps = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = logps + 5e-4 * torch.randn(B, T, generator=g, dtype=F64)
    turn_ids = torch.tensor(
        [
            [0, 0, 0, 1, 1, 2, 2, 2, 2],
            [0, 1, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 1, 1, 1, 1, 2, 2, 2],
        ]
    )
    mask = torch.ones(B, T, dtype=F64)
    mask[3, 4] = 0  # an environment token inside turn 1 of row 3: out of the ratio and the loss
    per_turn_adv = torch.randn(B, 3, generator=g, dtype=F64)
    adv = per_turn_adv.gather(1, turn_ids)
    kw = dict(loss_type="luspo", epsilon=3e-4, epsilon_high=4e-4)
    loss, grad, stats = loss_and_grad(logps, old, adv, mask, importance_sampling_level="turn", turn_ids=turn_ids, **kw)
    assert 0 < stats["clip_fraction"].item() < 1

    # The same tokens, one row per (row, turn), right-padded.
    pieces = [(i, k) for i in range(B) for k in range(3) if bool((turn_ids[i] == k).any())]
    split_logps = torch.zeros(len(pieces), T, dtype=F64)
    split_old, split_mask = torch.zeros_like(split_logps), torch.zeros_like(split_logps)
    for r, (i, k) in enumerate(pieces):
        cols = (turn_ids[i] == k).nonzero().flatten()
        split_logps[r, : len(cols)], split_old[r, : len(cols)] = logps[i, cols], old[i, cols]
        split_mask[r, : len(cols)] = mask[i, cols]
    split_adv = torch.stack([per_turn_adv[i, k] for i, k in pieces])
    split_loss, split_grad, _ = loss_and_grad(
        split_logps, split_old, split_adv, split_mask, importance_sampling_level="sequence", **kw
    )
    # luspo averages row sums over rows: rescale to the same number of rows.
    torch.testing.assert_close(loss * B, split_loss * len(pieces))
    regathered = torch.zeros_like(grad)
    for r, (i, k) in enumerate(pieces):
        cols = (turn_ids[i] == k).nonzero().flatten()
        regathered[i, cols] = split_grad[r, : len(cols)] * len(pieces) / B
    torch.testing.assert_close(grad, regathered)


def test_turn_ids_shape_is_checked():
    with pytest.raises(ValueError, match="turn_ids"):
        policy_loss(
            torch.zeros(2, 3),
            None,
            torch.zeros(2),
            torch.ones(2, 3),
            importance_sampling_level="turn",
            turn_ids=torch.zeros(2, 4, dtype=torch.long),
        )


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "bnpo", "dr_grpo", "dapo", "cispo", "vespo"])
@pytest.mark.parametrize("level", ["sequence", "token"])
def test_row_slices_given_the_whole_batch_counts_add_up_to_its_loss_and_gradient(loss_type, level):
    # A training pass scores a row slice of a micro-batch: with the micro-batch's rows and tokens, the slices'
    # losses (and gradients) add up to the micro-batch's for every way the loss averages, KL and entropy included.
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    logps = (-torch.rand(5, 4, generator=generator)).requires_grad_()
    old = logps.detach() - 0.05 * torch.rand(5, 4, generator=generator)
    ref = logps.detach() - 0.1
    entropy = torch.rand(5, 4, generator=generator).requires_grad_()
    advantages = torch.tensor([1.0, -0.5, 0.25, 0.0, -0.75])
    options = dict(
        objective=Objective(
            loss_type=loss_type,
            importance_sampling_level=level,
            epsilon=0.02,
            epsilon_high=0.02,
            beta=0.04,
            max_completion_length=4,
        ),
        token_normalizer=30.0,
        entropy_coef=0.01,
        entropy_normalizer=mask.sum(),
    )

    def loss_of(rows, **whole):
        return policy_loss(
            logps[rows],
            old[rows],
            advantages[rows],
            mask[rows],
            ref_logps=ref[rows],
            per_token_entropy=entropy[rows],
            **options,
            **whole,
        )[0]

    everything = loss_of(torch.arange(5))
    slices = [torch.tensor([0, 3]), torch.tensor([4]), torch.tensor([1, 2])]
    parts = sum(loss_of(rows, num_sequences=5, num_tokens=mask.sum()) for rows in slices)
    torch.testing.assert_close(parts, everything, atol=1e-7, rtol=1e-6)
    whole_grads = torch.autograd.grad(everything, (logps, entropy))
    part_grads = torch.autograd.grad(parts, (logps, entropy))
    for part, whole in zip(part_grads, whole_grads):
        torch.testing.assert_close(part, whole, atol=1e-7, rtol=1e-6)
    if AGGREGATIONS[loss_type] != "global_token_mean":  # those divide by the step's tokens anyway
        alone = loss_of(slices[0]).item()  # a slice averaged on its own is not its share
        assert alone != pytest.approx(loss_of(slices[0], num_sequences=5, num_tokens=mask.sum()).item())
