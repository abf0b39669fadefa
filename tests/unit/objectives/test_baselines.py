"""GRPO, RLOO and SFT on the same footing as GARL/PAFT."""

import pytest
import torch

from nemo_jq.objectives import grpo, rloo, sft
from nemo_jq.objectives.grpo import group_advantages


def _grpo_inputs(seed=0, b=2, m=4, t=5):
    gen = torch.Generator().manual_seed(seed)
    logprob = (-torch.rand(b, m, t, generator=gen, dtype=torch.float64)).requires_grad_()
    rewards = torch.randint(0, 2, (b, m), generator=gen).double()
    mask = (torch.rand(b, m, t, generator=gen) > 0.3).double()
    return logprob, rewards, mask


def test_group_advantages_are_normalised_per_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    adv = group_advantages(rewards)
    torch.testing.assert_close(adv[0], (rewards[0] - 0.5) / (rewards[0].std() + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4))
    torch.testing.assert_close(group_advantages(rewards, scale_rewards="none")[0], rewards[0] - 0.5)


def _trl_advantages(rewards, group, scale_rewards, eps=1e-4):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, written out over flat rewards."""
    flat = rewards.reshape(-1)
    mean = flat.view(-1, group).mean(dim=1).repeat_interleave(group)
    if scale_rewards == "batch":
        std = flat.std().expand_as(flat)
    else:
        std = flat.view(-1, group).std(dim=1).repeat_interleave(group)
    advantages = flat - mean
    if scale_rewards != "none":
        advantages = advantages / (std + eps)
    return advantages.view_as(rewards)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("aggregation, loss_type", [("token_mean", "dapo"), ("sequence_mean", "grpo")])
def test_grpo_reproduces_trl_losses_and_scalings(scale_rewards, aggregation, loss_type):
    logprob, rewards, mask = _grpo_inputs(seed=3, b=3, m=4)
    rewards = rewards + torch.arange(3, dtype=torch.float64)[:, None]  # batch std differs from group std
    out = grpo(logprob, rewards, mask, scale_rewards=scale_rewards, eps=1e-4, aggregation=aggregation)
    out.loss.backward()
    # TRL's on-policy per-token loss is -A * ratio with ratio = 1, reduced by loss_type.
    trl_logprob = logprob.detach().clone().requires_grad_()
    per_token = -torch.exp(trl_logprob - trl_logprob.detach()) * _trl_advantages(rewards, 4, scale_rewards)[..., None]
    flat_loss, flat_mask = per_token.view(12, -1), mask.view(12, -1)
    if loss_type == "dapo":  # normalised by the number of completion tokens in the whole batch
        trl_loss = (flat_loss * flat_mask).sum() / flat_mask.sum()
    else:
        trl_loss = ((flat_loss * flat_mask).sum(-1) / flat_mask.sum(-1).clamp(min=1.0)).mean()
    trl_loss.backward()
    torch.testing.assert_close(logprob.grad, trl_logprob.grad)


def test_grpo_batch_scaling_uses_the_whole_batch_under_micro_batching():
    logprob, rewards, mask = _grpo_inputs(seed=4, b=4, m=4)
    rewards = rewards * torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.float64)
    whole = group_advantages(rewards, scale_rewards="batch")
    halves = torch.cat([group_advantages(rewards[i : i + 2], scale_rewards="batch", batch_rewards=rewards) for i in (0, 2)])
    torch.testing.assert_close(whole, halves)
    alone = group_advantages(rewards[:2], scale_rewards="batch")
    assert not torch.allclose(alone, whole[:2])  # without batch_rewards a micro-batch would scale by its own std
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, scale_rewards="global")


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_grpo_on_policy_gradient_is_exact(aggregation):
    logprob, rewards, mask = _grpo_inputs()
    grpo(logprob, rewards, mask, aggregation=aggregation).loss.backward()
    adv = group_advantages(rewards).unsqueeze(-1)
    if aggregation == "token_mean":
        expected = -adv * mask / mask.sum()
    else:
        expected = -adv * mask / mask.sum(-1, keepdim=True).clamp(min=1) / (rewards.numel())
    torch.testing.assert_close(logprob.grad, expected)


def test_grpo_clips_ratios_outside_the_trust_region():
    logprob, rewards, mask = _grpo_inputs(seed=1)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    old = logprob.detach() - 0.5  # ratio e^0.5 > 1.2 everywhere
    out = grpo(logprob, rewards, mask, old_logprob=old)
    out.loss.backward()
    positive = (group_advantages(rewards) > 0).unsqueeze(-1).expand_as(mask)
    assert torch.all(logprob.grad[positive] == 0)  # clipped: no push further up
    assert torch.all(logprob.grad[~positive & (mask > 0)] != 0)  # negative advantages still pull down
    active = positive & (mask > 0)  # e^0.5 > 1.2 with A > 0: the clip taken; with A < 0 the ratio stays in the loss
    assert out.metrics["clip_fraction"] == pytest.approx((active.sum() / mask.sum()).item())


def test_a_group_of_equal_fractional_rewards_has_no_advantage():
    """12 rewards of 0.97 in fp32: the mean's rounding (1.8e-7) over a std of the same size gave every sample -0.15,
    pushing each of the group's completions down."""
    rewards = torch.full((1, 12), 0.97)
    assert torch.equal(group_advantages(rewards), torch.zeros(1, 12))
    logprob, _, mask = _grpo_inputs(m=12)
    out = grpo(logprob[:1], rewards.double(), mask[:1])
    out.loss.backward()
    assert torch.equal(logprob.grad, torch.zeros_like(logprob))


def test_padding_s_old_logprobs_give_no_nan_gradient():
    """``old_logprob`` of -inf (or -1e4) on padding made its ratio inf there: a finite loss, a NaN gradient."""
    logprob, rewards, mask = _grpo_inputs(seed=2)
    old = torch.where(mask > 0, logprob.detach() - 0.1, float("-inf"))
    grpo(logprob, rewards, mask, old_logprob=old).loss.backward()
    assert torch.isfinite(logprob.grad).all() and torch.equal(logprob.grad[mask == 0], torch.zeros_like(logprob.grad[mask == 0]))


def test_grpo_shape_errors_name_the_tensors():
    logprob, rewards, mask = _grpo_inputs()
    with pytest.raises(ValueError, match="old_logprob"):
        grpo(logprob, rewards, mask, old_logprob=logprob.detach()[:, :, :3])
    with pytest.raises(ValueError, match="mask"):
        grpo(logprob, rewards[:, :3], mask)
    with pytest.raises(ValueError, match="aggregation"):
        grpo(logprob, rewards, mask, aggregation="sum")


def test_rloo_gradient_is_leave_one_out():
    lp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    rloo(lp, rewards).loss.backward()
    loo = (rewards.sum(1, keepdim=True) - rewards) / 3
    torch.testing.assert_close(lp.grad, -(rewards - loo) / (4 * 3))
    assert torch.equal(lp.grad[2], torch.zeros(4))  # no success, no signal


def test_sft_reductions():
    lp = -torch.rand(2, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    seq = sft(lp, mask)
    torch.testing.assert_close(seq.per_example, -(lp * mask).sum(1))
    tok = sft(lp, mask, reduction="token")
    torch.testing.assert_close(tok.per_example, -(lp * mask).sum(1) / mask.sum(1))
    with pytest.raises(ValueError, match="reduction"):
        sft(lp, mask, reduction="mean")
