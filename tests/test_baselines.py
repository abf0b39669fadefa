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
    torch.testing.assert_close(group_advantages(rewards, normalize_std=False)[0], rewards[0] - 0.5)


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
    assert out.metrics["clip_fraction"] > 0


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
