"""Tests for gspo_trl.objective.objectives and the loss types of gspo_trl.objective.loss: hand-computed values, the
limits
the papers state, and parity with TRL 1.16's `GRPOTrainer._compute_loss` on identical inputs."""

import math
import warnings

import pytest
import torch

from gspo_trl.objective.loss import Objective, policy_loss
from gspo_trl.objective.loss_masks import high_entropy_token_mask, off_policy_sequence_mask
from gspo_trl.objective.objectives import vespo_weight

F64 = torch.float64


def grad_of(loss, leaf):
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def one_token(logp, old, advantage, **objective):
    """Loss and d loss / d logp for a single sequence of a single token."""
    logps = torch.tensor([[logp]], dtype=F64, requires_grad=True)
    loss, stats = policy_loss(
        logps, torch.tensor([[old]], dtype=F64), torch.tensor([advantage], dtype=F64), torch.ones(1, 1), **objective
    )
    return loss.item(), grad_of(loss, logps).item(), stats


# --- hand-computed values ------------------------------------------------------------------------


@pytest.mark.parametrize("advantage, temperature", [(2.0, 1.0), (-1.5, 1.05)])
def test_sapo_hand_computed(advantage, temperature):
    # w = e^0.5; f(w) = 4/tau sigmoid(tau (w - 1)); loss = -f(w) A; d loss/d logp = -4 s (1 - s) w A.
    w = math.exp(0.5)
    s = 1 / (1 + math.exp(-temperature * (w - 1)))
    loss, grad, stats = one_token(-1.0, -1.5, advantage, loss_type="sapo", importance_sampling_level="token")
    assert loss == pytest.approx(-4 / temperature * s * advantage, rel=1e-12)
    assert grad == pytest.approx(-4 * s * (1 - s) * w * advantage, rel=1e-12)
    assert stats["sapo_gate_weight"].item() == pytest.approx(4 * s * (1 - s), rel=1e-12)


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_sapo_gate_weight_is_one_on_policy_and_decays_smoothly(level):
    _, grad_on, stats = one_token(-1.0, -1.0, 1.0, loss_type="sapo", importance_sampling_level=level)
    assert grad_on == pytest.approx(-1.0)  # the same gradient as GSPO/GRPO at ratio 1
    assert stats["sapo_gate_weight"].item() == pytest.approx(1.0)
    weights = [
        abs(one_token(-1.0 + d, -1.0, 1.0, loss_type="sapo", importance_sampling_level=level)[1]) / math.exp(d)
        for d in (0.0, 0.5, 1.0, 2.0, 3.0)
    ]
    assert all(a > b > 0 for a, b in zip(weights, weights[1:]))  # strictly decreasing, never exactly zero


def test_cispo_hand_computed_and_never_zeroes_a_gradient():
    # w = e^1 > eps_max = 2: the weight is capped at 2 and detached: loss = -2 A logp, d/d logp = -2 A.
    loss, grad, stats = one_token(
        -1.0, -2.0, 0.5, loss_type="cispo", epsilon_high=2.0, importance_sampling_level="token"
    )
    assert loss == pytest.approx(-2.0 * 0.5 * -1.0)
    assert grad == pytest.approx(-2.0 * 0.5)
    assert stats["cispo_clip_fraction"].item() == 1.0
    # Where GSPO's clip zeroes the gradient (w far above 1 + eps_high with A > 0), CISPO keeps one.
    _, clipped_grad, _ = one_token(-1.0, -2.0, 0.5, importance_sampling_level="token")
    assert clipped_grad == 0.0
    for d in (-5.0, -1.0, 0.0, 1.0, 5.0):
        assert one_token(-1.0 + d, -1.0, 1.0, loss_type="cispo", epsilon_high=5.0)[1] != 0.0


def test_vespo_weight_hand_computed_and_one_at_ratio_one():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    log_ratio = torch.tensor([[0.2, 0.1, 9.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    advantages = torch.tensor([[1.0], [-2.0], [3.0]], dtype=F64)
    phi = vespo_weight(log_ratio, advantages, mask, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    # Row 0: W = e^0.3 (padding ignored), A >= 0: phi = e^3 W^2 e^(-3W). Row 1: W = e^-0.5, A < 0: e^2 W^3 e^(-2W).
    w0, w1 = math.exp(0.3), math.exp(-0.5)
    expected = [math.exp(3) * w0**2 * math.exp(-3 * w0), math.exp(2) * w1**3 * math.exp(-2 * w1), 1.0]
    torch.testing.assert_close(phi.squeeze(1), torch.tensor(expected, dtype=F64))


def test_vespo_loss_is_detached_weight_times_reinforce():
    logps = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, -2.2]], dtype=F64)  # W = e^0.3
    loss, stats = policy_loss(
        logps,
        old,
        torch.tensor([1.5], dtype=F64),
        torch.ones(1, 2),
        loss_type="vespo",
        importance_sampling_level="token",
    )
    w = math.exp(0.3)
    phi = math.exp(3) * w**2 * math.exp(-3 * w)
    assert loss.item() == pytest.approx(-phi * 1.5 * (-3.0) / 2)  # token sum over 2 tokens
    torch.testing.assert_close(grad_of(loss, logps), torch.full((1, 2), -phi * 1.5 / 2, dtype=F64))
    assert stats["vespo_weight_mean"].item() == pytest.approx(phi)


def test_delta_caps_the_unclipped_term_for_negative_advantages():
    # A < 0 and w = e^1 above delta = 2: GSPO's min keeps w A (unbounded); delta caps it at 2 A, no gradient.
    loss, grad, _ = one_token(
        -1.0, -2.0, -1.0, importance_sampling_level="token", epsilon=0.2, epsilon_high=0.2, delta=2.0
    )
    assert loss == pytest.approx(2.0) and grad == 0.0
    loss, grad, _ = one_token(-1.0, -2.0, -1.0, importance_sampling_level="token", epsilon=0.2, epsilon_high=0.2)
    assert loss == pytest.approx(math.e) and grad == pytest.approx(math.e)


def test_luspo_weighs_each_sequence_by_its_length():
    logps = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)
    advantages = torch.tensor([1.0, 1.0], dtype=F64)
    luspo, _ = policy_loss(logps, None, advantages, mask, loss_type="luspo")
    gspo, _ = policy_loss(logps, None, advantages, mask)
    assert luspo.item() == pytest.approx(-(3 + 1) / 2)  # on-policy ratio 1: -(|y_0| A_0 + |y_1| A_1) / B
    assert gspo.item() == pytest.approx(-1.0)


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("bnpo", -(3 * 1 + 1 * 2) / 4),  # token mean of the batch
        ("dr_grpo", -(3 * 1 + 1 * 2) / (2 * 5)),  # B * max_completion_length
        ("dapo", -(3 * 1 + 1 * 2) / 10),  # the given token normalizer
    ],
)
def test_token_aggregations(loss_type, expected):
    logps = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)
    loss, _ = policy_loss(
        logps,
        None,
        torch.tensor([1.0, 2.0], dtype=F64),
        mask,
        loss_type=loss_type,
        max_completion_length=5,
        token_normalizer=10.0,
    )
    assert loss.item() == pytest.approx(expected)


def test_off_policy_mask_drops_only_negative_advantage_sequences_that_drifted():
    logps = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=F64)
    sampling = torch.tensor(
        [[-0.2, -0.2], [-0.2, -0.2], [-0.9, -1.0], [5.0, 0.0]], dtype=F64
    )  # drift 0.8, 0.8, 0.05, 3
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]], dtype=F64)
    advantages = torch.tensor([[1.0], [-1.0], [-1.0], [-1.0]], dtype=F64)
    keep = off_policy_sequence_mask(advantages, logps, sampling, mask, threshold=0.5)
    assert keep.squeeze(1).tolist() == [1.0, 0.0, 1.0, 0.0]


def test_high_entropy_mask_keeps_the_top_quantile_of_valid_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # the 7.0 is padding and must not count
    keep = high_entropy_token_mask(entropy, mask, top_quantile=0.3)
    # Valid entropies (7), sorted: 0.1 0.2 0.3 0.5 0.7 0.8 0.9; the 0.7 quantile is 0.72: 0.8 and 0.9 stay.
    assert keep.tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]


def test_entropy_bonus_is_minus_coef_times_mean_entropy():
    logps = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    entropy = torch.tensor([[1.0, 3.0]], dtype=F64, requires_grad=True)
    base, _ = policy_loss(logps, None, torch.tensor([0.0], dtype=F64), torch.ones(1, 2))
    loss, _ = policy_loss(
        logps, None, torch.tensor([0.0], dtype=F64), torch.ones(1, 2), per_token_entropy=entropy, entropy_coef=0.1
    )
    assert (loss - base).item() == pytest.approx(-0.1 * 2.0)
    torch.testing.assert_close(grad_of(loss, entropy), torch.full((1, 2), -0.05, dtype=F64))


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(loss_type="ppo"), "loss_type"),
        (dict(delta=0.9), "delta"),
        (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg"),
        (dict(vespo_k_pos=-1.0), "vespo_k_pos"),
        (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
    ],
)
def test_invalid_objectives_raise_naming_the_field(change, name):
    with pytest.raises(ValueError, match=name):
        Objective(**change)


def test_vespo_refuses_per_token_advantages():
    with pytest.raises(ValueError, match="vespo"):
        policy_loss(
            torch.zeros(2, 3),
            None,
            torch.zeros(2, 3),
            torch.ones(2, 3),
            loss_type="vespo",
            importance_sampling_level="token",
        )


# --- parity with TRL 1.16's GRPOTrainer._compute_loss ------------------------------------------------

GSPO = dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)
TRL_CASES = {  # name: the options, set identically on GRPOConfig and on our Objective / policy_loss
    "grpo token": dict(loss_type="grpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28),
    "gspo sequence": GSPO,
    "gspo + delta": dict(GSPO, delta=1.001),
    "grpo + delta": dict(loss_type="grpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.2, delta=1.3),
    "sapo token": dict(loss_type="sapo", importance_sampling_level="token"),
    "sapo sequence": dict(
        loss_type="sapo", importance_sampling_level="sequence", sapo_temperature_pos=2.0, sapo_temperature_neg=3.0
    ),
    "cispo token": dict(loss_type="cispo", importance_sampling_level="token", epsilon_high=1.2),
    "cispo sequence": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.05),
    "vespo": dict(loss_type="vespo", importance_sampling_level="token"),
    "vespo custom": dict(
        loss_type="vespo",
        importance_sampling_level="token",
        vespo_k_pos=1.0,
        vespo_lambda_pos=1.5,
        vespo_k_neg=2.0,
        vespo_lambda_neg=4.0,
    ),
    "luspo": dict(GSPO, loss_type="luspo"),
    "bnpo": dict(loss_type="bnpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.2),
    "dr_grpo": dict(loss_type="dr_grpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.2),
    "dapo": dict(loss_type="dapo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28),
    "gspo + KL": dict(GSPO, beta=0.04),
    "sapo + KL, no bias correction": dict(
        loss_type="sapo", importance_sampling_level="token", beta=0.1, use_bias_correction_kl=False
    ),
    "gspo + off-policy mask": dict(GSPO, off_policy_mask_threshold=0.05),
    "cispo + off-policy mask": dict(
        loss_type="cispo", importance_sampling_level="token", epsilon_high=5.0, off_policy_mask_threshold=0.02
    ),
    "gspo + top entropy": dict(GSPO, top_entropy_quantile=0.4),
    "gspo + entropy bonus": dict(GSPO, entropy_coef=0.05),
    "dapo + top entropy + bonus": dict(
        loss_type="dapo",
        importance_sampling_level="token",
        epsilon=0.2,
        epsilon_high=0.28,
        top_entropy_quantile=0.5,
        entropy_coef=0.02,
    ),
}
CALL_OPTIONS = ("top_entropy_quantile", "entropy_coef")  # not Objective fields: the trainer applies them per call
MAX_COMPLETION_LENGTH = 7


def parity_batch(seed, off_policy):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, MAX_COMPLETION_LENGTH
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + (0.15 * torch.randn(B, T, generator=g) if off_policy else 0.0)
    ref = logps + 0.2 * torch.randn(B, T, generator=g)
    lengths = torch.tensor([7, 5, 3, 1, 6, 4])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    advantages = torch.randn(B, generator=g)
    entropy = torch.rand(B, T, generator=g) * 4
    return logps, (old if off_policy else None), ref, advantages, mask, entropy


def trl_trainer(tmp_path, model_dir, options):
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=6,
            num_generations=3,
            max_completion_length=MAX_COMPLETION_LENGTH,
            use_cpu=True,
            report_to="none",
            **options,
        )
        trainer = GRPOTrainer(
            AutoModelForCausalLM.from_pretrained(model_dir),
            lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=__import__("helpers").text_dataset(),
        )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def trl_loss(trainer, logps, old, ref, advantages, mask, entropy, **extra_inputs):
    """TRL's loss and its gradients with respect to the log-probs and the entropies it is handed."""
    logps = logps.clone().requires_grad_(True)
    entropy = entropy.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropy, None)
    B, T = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
        **extra_inputs,
    }
    loss = trainer._compute_loss(trainer.model, inputs)
    grads = torch.autograd.grad(loss, (logps, entropy), allow_unused=True)
    return loss.detach(), grads[0], grads[1]


def our_loss(options, logps, old, ref, advantages, mask, entropy):
    logps = logps.clone().requires_grad_(True)
    entropy = entropy.clone().requires_grad_(True)
    objective = Objective(
        max_completion_length=MAX_COMPLETION_LENGTH, **{k: v for k, v in options.items() if k not in CALL_OPTIONS}
    )
    quantile = options.get("top_entropy_quantile", 1.0)
    keep = high_entropy_token_mask(entropy, mask, quantile) if quantile < 1.0 else None
    loss, _ = policy_loss(
        logps,
        old,
        advantages,
        mask,
        objective=objective,
        ref_logps=ref,
        policy_token_mask=keep,
        token_normalizer=mask.sum(),
        per_token_entropy=entropy,
        entropy_coef=options.get("entropy_coef", 0.0),
    )
    grads = torch.autograd.grad(loss, (logps, entropy), allow_unused=True)
    return loss.detach(), grads[0], grads[1]


@pytest.mark.parametrize("case", list(TRL_CASES))
def test_loss_and_gradient_match_trl(tmp_path, tiny_model_dir, case):
    options = TRL_CASES[case]
    trainer = trl_trainer(tmp_path, tiny_model_dir, options)
    for seed, off_policy in ((0, False), (1, True), (2, True)):
        batch = parity_batch(seed, off_policy)
        theirs, ours = trl_loss(trainer, *batch), our_loss(options, *batch)
        torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=1e-6, msg=f"{case} loss, seed {seed}")
        mask = batch[4].bool()
        torch.testing.assert_close(
            ours[1] * mask, theirs[1] * mask, atol=1e-6, rtol=1e-6, msg=f"{case} d/d logps, seed {seed}"
        )
        if theirs[2] is not None:
            torch.testing.assert_close(
                ours[2] * mask, theirs[2] * mask, atol=1e-6, rtol=1e-6, msg=f"{case} d/d entropy, seed {seed}"
            )


CORRECTED_CASES = (
    "gspo sequence",
    "grpo token",
    "gspo + KL",
    "dapo",
    "sapo token",
    "cispo token",
    "vespo",
    "gspo + off-policy mask",
)


@pytest.mark.parametrize("case", CORRECTED_CASES)
def test_sampling_correction_weights_match_trl(tmp_path, tiny_model_dir, case):
    # The same (B, T) token-level correction weights handed to TRL's vLLM path and to ours.
    options = TRL_CASES[case]
    trainer = trl_trainer(tmp_path, tiny_model_dir, options)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    logps, old, ref, advantages, mask, entropy = parity_batch(3, off_policy=True)
    g = torch.Generator().manual_seed(4)
    weights = (torch.rand(mask.shape, generator=g) * 2.5).masked_fill(torch.rand(mask.shape, generator=g) < 0.2, 0.0)
    weights = torch.where(mask.bool(), weights, 1.0)  # TRL's weights are exp(0) on padding

    def our_call():
        logps_leaf = logps.clone().requires_grad_(True)
        objective = Objective(max_completion_length=MAX_COMPLETION_LENGTH, **options)
        loss, _ = policy_loss(
            logps_leaf,
            old,
            advantages,
            mask,
            objective=objective,
            ref_logps=ref,
            token_normalizer=mask.sum(),
            sampling_weights=weights,
        )
        return loss.detach(), torch.autograd.grad(loss, logps_leaf)[0]

    theirs = trl_loss(
        trainer,
        logps,
        old,
        ref,
        advantages,
        mask,
        entropy,
        importance_sampling_ratio=weights,
        sampling_per_token_logps=old,
    )
    ours = our_call()
    uncorrected, _ = policy_loss(
        logps,
        old,
        advantages,
        mask,
        objective=Objective(max_completion_length=MAX_COMPLETION_LENGTH, **options),
        ref_logps=ref,
        token_normalizer=mask.sum(),
    )
    assert not torch.allclose(ours[0], uncorrected)  # the weights do change the loss
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours[1] * mask, theirs[1] * mask, atol=1e-6, rtol=1e-6)
