"""Off-policy GARL, PAFT and RLOO on the enumerable latent model, with rationales drawn from a behaviour policy
π ≠ p_θ (docs/off_policy.md): every expectation is exact (every pool of M samples from π, weighted by its
probability), and compared with the derivation's closed forms."""

import itertools
import math

import numpy as np
import pytest
import torch

from helpers import TINY_RUN
from latent_pools import Pools
from nemo_jq.config import load_config
from nemo_jq.objectives import garl, grpo, paft, rb_rloo, rloo, sft
from nemo_jq.objectives.importance import Correction, Ratios, SampledTokens, k3_kl
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.runtime.monitor import merge_metrics, read_metrics
from nemo_jq.theory import default_model

MODEL = default_model()
#: The behaviour policy: softmax(θ + δ), a sampler with other numerics or an older policy.
BEHAVIOR = (lambda logits: np.exp(logits) / np.exp(logits).sum())(MODEL.prior_logits + np.array([-0.5, 0.7, 0.2]))
RHO = MODEL.prior / BEHAVIOR
PLAIN = Correction("plain")


def expectation(estimator, m: int, behavior=BEHAVIOR, **kwargs) -> np.ndarray:
    return Pools.enumerate(MODEL, m, behavior).expectation(estimator, **kwargs)


def off_policy_leading_bias(q: float, m: int) -> np.ndarray:
    """Thm 4.1's leading term with (w, g) -> (v, h) = (ρw, ρg) under π (docs/off_policy.md, §2.4)."""
    p, g = MODEL.success_probability, MODEL.per_latent_g()
    v, h = RHO * MODEL.weights, RHO[:, None] * g
    var_v = float(BEHAVIOR @ v**2) - p**2
    cov_hv = (BEHAVIOR * v) @ h - (BEHAVIOR @ h) * p
    return q / (m * p ** (q + 1.0)) * (0.5 * (q + 1.0) * MODEL.grad_loss(1.0) * var_v - cov_hv)


@pytest.mark.parametrize("estimator", [garl, rb_rloo, paft])
def test_at_q0_the_corrected_estimators_are_exactly_unbiased_for_every_m(estimator):
    """The ρ on the leave-one-out baseline makes the score term's control variate mean zero under π; PAFT's
    resampling ∝ ρw has off-policy GARL's mean (its resampling averaged out by repetition: exact in expectation)."""
    kwargs = {"q": 0.0} if estimator is not rb_rloo else {}
    for m in (2, 3, 8):
        if estimator is paft:
            pools = Pools.enumerate(MODEL, m, BEHAVIOR)
            torch.manual_seed(0)
            grads = pools.gradients(paft, repeat=300, q=0.0, correction=PLAIN).reshape(len(pools.probs), 300, -1)
            np.testing.assert_allclose(pools.probs @ grads.mean(1), MODEL.grad_loss(0.0), atol=6e-3)
        else:
            np.testing.assert_allclose(expectation(estimator, m, correction=PLAIN, **kwargs), MODEL.grad_loss(0.0), atol=1e-12)
    uncorrected = Pools.enumerate(MODEL, 3, BEHAVIOR)  # the same pools, treated as on-policy: biased
    uncorrected.behavior = None
    assert np.linalg.norm(uncorrected.expectation(garl, q=0.0) - MODEL.grad_loss(0.0)) > 0.05


@pytest.mark.parametrize("q", [0.5, 1.0])
def test_above_q0_the_bias_falls_like_one_over_m_as_derived(q):
    errors = {m: np.linalg.norm(expectation(garl, m, q=q, normalize=False, correction=PLAIN) - MODEL.grad_loss(q))
              for m in (2, 4, 8, 16, 32)}
    assert all(a > b for a, b in zip(errors.values(), list(errors.values())[1:]))
    assert 0.5 < (32 * errors[32]) / (8 * errors[8]) < 1.5  # M x bias levels off
    bias = expectation(garl, 48, q=0.75, normalize=False, correction=PLAIN) - MODEL.grad_loss(0.75)
    leading = off_policy_leading_bias(0.75, 48)
    assert np.linalg.norm(bias - leading) < 0.05 * np.linalg.norm(leading) and np.dot(bias, leading) > 0


@pytest.mark.parametrize("q", [0.0, 0.5, 1.0])
def test_with_the_behaviour_equal_to_the_policy_every_estimator_is_the_on_policy_one(q):
    torch.manual_seed(0)
    rlp, alp = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6) * 3 - 4
    rewards = torch.bernoulli(torch.full((4, 6), 0.4))
    for correction in (PLAIN, Correction("truncate", cap=1.5), Correction("mask", low=0.5, high=2.0)):
        for call in (lambda **k: garl(rlp, alp, q, **k), lambda **k: paft(rlp, alp, q, generator=torch.Generator().manual_seed(3), **k),
                     lambda **k: rloo(rlp, rewards, **k)):
            on, off = call(), call(behavior_logprob=rlp.detach(), correction=correction)
            grad_on = torch.autograd.grad(on.loss, rlp)[0]
            grad_off = torch.autograd.grad(off.loss, rlp)[0]
            assert on.loss.item() == off.loss.item() and torch.equal(grad_on, grad_off)


@pytest.mark.parametrize("cap", [1.5, 1.2])
def test_truncations_bias_at_q0_is_the_derived_formula(cap):
    """ρ̃ = min(ρ, C) in v, in P̂ and on the baseline: bias E_π[(ρ − ρ̃)((w − P̃) s + w a)], whatever M."""
    rho_t = np.minimum(RHO, cap)
    w, s, a = MODEL.weights, MODEL.rationale_score(), MODEL.answer_score()
    p_tilde = float(BEHAVIOR @ (rho_t * w))
    formula = (BEHAVIOR * (RHO - rho_t)) @ ((w - p_tilde)[:, None] * s + w[:, None] * a)
    for m in (2, 5):
        bias = expectation(garl, m, q=0.0, correction=Correction("truncate", cap=cap)) - MODEL.grad_loss(0.0)
        np.testing.assert_allclose(bias, formula, atol=1e-12)


def test_masking_normalised_by_m_is_unbiased_for_the_kept_sets_gradient():
    """ρ̃ = ρ on A = {a <= ρ <= b}, 0 elsewhere, the mean still over M: E = −∇P_A + P_A ∇p_θ(A) at q=0."""
    keep = (RHO >= 0.6) & (RHO <= 1.3)
    p, w = MODEL.prior, MODEL.weights
    s, a = MODEL.rationale_score(), MODEL.answer_score()
    grad_p_a = (keep * p * w) @ (s + a)
    target = -grad_p_a + float((keep * p) @ w) * ((keep * p) @ s)
    for m in (2, 4):
        np.testing.assert_allclose(expectation(garl, m, q=0.0, correction=Correction("mask", low=0.6, high=1.3)), target,
                                   atol=1e-12)


@pytest.mark.parametrize("q", [0.0, 0.5, 1.0])
def test_an_all_masked_group_gives_no_gradient(q):
    rlp, alp = torch.zeros(2, 4, requires_grad=True), torch.full((2, 4), -1.0, requires_grad=True)
    far = torch.full((2, 4), -5.0)  # ρ = e^5, outside [0.5, 2] everywhere
    for out in (garl(rlp, alp, q, behavior_logprob=far, correction=Correction("mask")),
                paft(rlp, alp, q, behavior_logprob=far, correction=Correction("mask"), generator=torch.Generator())):
        grads = torch.autograd.grad(out.loss, (rlp, alp))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        assert out.metrics["is_masked_fraction"] == 1.0
        assert out.metrics["masked_group_fraction"] == 1.0 and "log_p_hat" not in out.metrics


@pytest.mark.parametrize("estimator", ["garl", "paft"])
def test_log_p_hat_is_of_the_groups_a_mask_leaves_a_weight(estimator):
    """One group masked whole: its log w̄ is the floor, -1e30, which made the batch's log P̂ about -5e29 (the collapse
    guard fired on it, an adaptive q held at q_max); it is counted apart, and log P̂ is the other group's."""
    rlp, alp = torch.zeros(2, 4), torch.tensor([[-1.0] * 4, [-2.0] * 4])
    behavior = torch.tensor([[-5.0] * 4, [0.0] * 4])  # the first group's ρ = e^5 everywhere: masked; the second's kept
    options = dict(behavior_logprob=behavior, correction=Correction("mask", low=0.5, high=2.0))
    out = garl(rlp, alp, 1.0, **options) if estimator == "garl" else paft(rlp, alp, 1.0, generator=torch.Generator(), **options)
    assert out.metrics["masked_group_fraction"] == 0.5
    assert out.metrics["log_p_hat"] == pytest.approx(-2.0) and out.metrics["ess"] == pytest.approx(4.0)


def _merged_over(splits, estimate):
    """The step's record from micro-batches of ``splits`` prompts each, as the trainer merges them."""
    pairs, first = [], 0
    for size in splits:
        pairs.append((size, estimate(slice(first, first + size)).metrics))
        first += size
    return merge_metrics(pairs)


@pytest.mark.parametrize("splits", [(3,), (2, 1), (1, 2), (1, 1, 1)])
def test_a_step_s_metrics_are_the_same_whatever_its_micro_batches(splits):
    """A group masked whole, targets and completions of unlike lengths: log P̂ and ESS are means over the groups left a
    weight, the masked share over every group, ``nll_per_token``, ``clip_fraction`` and the ratios' shares over
    tokens. Merged by prompts over the micro-batches that reported them, they moved with ``train.micro_batch_size``
    and the replicas (masked_group_fraction 1/3, 1/2 or 1 for one step; log P̂ -23.3954 or -23.3942)."""
    gen = torch.Generator().manual_seed(0)
    rlp, alp = -torch.rand(3, 4, generator=gen) * 5, -torch.rand(3, 4, generator=gen) * 3
    behavior = torch.cat([rlp[:1] - 5.0, rlp[1:] + 0.3 * torch.randn(2, 4, generator=gen)])  # the first group masked
    options = dict(correction=Correction("mask", low=0.5, high=2.0))
    garl_metrics = _merged_over(splits, lambda rows: garl(rlp[rows], alp[rows], 0.5, behavior_logprob=behavior[rows],
                                                            **options))
    assert garl_metrics == pytest.approx(garl(rlp, alp, 0.5, behavior_logprob=behavior, **options).metrics, rel=1e-6)
    assert garl_metrics["masked_group_fraction"] == pytest.approx(1 / 3)
    truncated = dict(correction=Correction("truncate", cap=1.1))  # the ratios' mass cut, a share of a sum: Σ(ρ − ρ̃)/Σρ
    assert _merged_over(splits, lambda rows: garl(rlp[rows], alp[rows], 0.5, behavior_logprob=behavior[rows], **truncated)) \
        == pytest.approx(garl(rlp, alp, 0.5, behavior_logprob=behavior, **truncated).metrics, rel=1e-6)
    targets = torch.arange(9)[None] < torch.tensor([[2], [9], [5]])  # 2, 9 and 5 target tokens
    nll = -torch.rand(3, 9, generator=gen)
    assert _merged_over(splits, lambda rows: sft(nll[rows], targets[rows])) == pytest.approx(sft(nll, targets).metrics)
    logprob, old = -torch.rand(3, 2, 9, generator=gen), -torch.rand(3, 2, 9, generator=gen)
    rewards, completions = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), targets[:, None].expand(3, 2, 9)
    assert _merged_over(splits, lambda rows: grpo(logprob[rows], rewards[rows], completions[rows], old_logprob=old[rows])) \
        == pytest.approx(grpo(logprob, rewards, completions, old_logprob=old).metrics)


def test_a_step_whose_means_are_over_nothing_merges_as_before():
    """Every micro-batch's completions empty: each counted mean is 0 over 0 tokens (a ZeroDivisionError in the merge)."""
    assert merge_metrics([(2, {"clip_fraction": 0.0, "completion_tokens": 0}), (1, {"clip_fraction": 0.0,
                                                                                   "completion_tokens": 0})]) == \
        {"clip_fraction": 0.0, "completion_tokens": 0}


def test_rloos_sequence_ratio_makes_it_unbiased_for_the_expected_reward():
    """RLOO over sampled completions z ~ π with reward r(z): with ρ on the whole advantage, E[ĝ] = −∇E_p[r]."""
    rewards = MODEL.weights  # a reward per latent, as a sampled answer's
    for m in (2, 4):
        pools = Pools.enumerate(MODEL, m, BEHAVIOR)
        rlp = torch.tensor(np.log(MODEL.prior)[pools.latents], dtype=torch.float64, requires_grad=True)
        out = rloo(rlp, torch.tensor(rewards[pools.latents]), behavior_logprob=torch.tensor(np.log(BEHAVIOR)[pools.latents]),
                   correction=PLAIN)
        out.per_example.sum().backward()
        grads = np.einsum("cm,cmp->cp", rlp.grad.numpy(), MODEL.rationale_score()[pools.latents])
        np.testing.assert_allclose(pools.probs @ grads, -(MODEL.prior * rewards) @ MODEL.rationale_score(), atol=1e-12)


def test_the_per_token_k3_estimates_kl_from_the_behaviour_to_the_policy():
    """Two-token sequences, every one enumerated: E_π[Σ_t k3_t] with r = p/π is KL(π ‖ p) exactly."""
    generator = torch.Generator().manual_seed(0)
    p1, pi1 = torch.softmax(torch.randn(3, generator=generator), 0), torch.softmax(torch.randn(3, generator=generator), 0)
    p2, pi2 = torch.softmax(torch.randn(3, 3, generator=generator), 1), torch.softmax(torch.randn(3, 3, generator=generator), 1)
    kl, expected_k3 = 0.0, 0.0
    for i in range(3):
        for j in range(3):
            weight = float(pi1[i] * pi2[i, j])
            policy = torch.log(torch.stack([p1[i], p2[i, j]]))[None]
            behavior = torch.log(torch.stack([pi1[i], pi2[i, j]]))[None]
            expected_k3 += weight * 2 * float(k3_kl(policy, behavior, torch.ones(1, 2, dtype=torch.bool)))  # sum = 2 x mean
            kl += weight * float(behavior.sum() - policy.sum())
    assert expected_k3 == pytest.approx(kl, rel=1e-5)


def test_every_estimator_refuses_behaviour_log_probs_of_another_shape_or_missing_where_they_count():
    """One check, in :meth:`Correction.ratios`, for all of them: a shape mismatch, or NaN/+inf on a sampled token
    (the engine reported none); NaN outside the sampled tokens (GRPO's mask) is fine."""
    rationale, answer, rewards = torch.zeros(2, 3), torch.full((2, 3), -1.0), torch.tensor([[1.0, 0, 0], [0, 1, 0]])
    for bad in (torch.zeros(2, 2), torch.tensor([[0.0, float("nan"), 0], [0, 0, 0]]),
                torch.tensor([[0.0, float("inf"), 0], [0, 0, 0]])):
        for call in (lambda b: garl(rationale, answer, 0.5, behavior_logprob=b), lambda b: rb_rloo(rationale, answer, behavior_logprob=b),
                     lambda b: paft(rationale, answer, 0.5, behavior_logprob=b), lambda b: rloo(rationale, rewards, behavior_logprob=b)):
            with pytest.raises(ValueError, match="shape mismatch|NaN or \\+inf where it counts"):
                call(bad)
    logprob, mask = torch.full((2, 3, 4), -1.0), torch.ones(2, 3, 4)
    mask[..., -1] = 0
    behavior = torch.full((2, 3, 4), -1.0)
    behavior[..., -1] = float("nan")  # not sampled: no log-prob, and none needed
    assert grpo(logprob, rewards, mask, behavior_logprob=behavior).metrics["is_ratio_mean"] == pytest.approx(1.0)
    behavior[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or \\+inf where it counts"):
        grpo(logprob, rewards, mask, behavior_logprob=behavior)


# Long rationales: the per-token forms (docs/off_policy.md, §11).

def long_rationale_mismatch(groups: int, samples: int, tokens: int, spread: float, seed: int = 0) -> SampledTokens:
    """Rationales of ``tokens`` tokens from an engine whose per-token log-ratio is N(−σ²/2, σ²) (so E_π[r_t] = 1),
    σ = spread/√tokens: the sequence ratio's log has standard deviation ``spread``, a bf16 engine's over ~3k tokens."""
    generator = torch.Generator().manual_seed(seed)
    sigma = spread / tokens**0.5
    policy = -2 * torch.rand(groups, samples, tokens, generator=generator)
    log_ratio = sigma * torch.randn(groups, samples, tokens, generator=generator) - sigma**2 / 2
    return SampledTokens(policy, policy - log_ratio, torch.ones(groups, samples, tokens, dtype=torch.bool))


def test_over_long_rationales_sequence_truncation_puts_the_weight_on_few_samples_and_the_per_token_forms_do_not():
    tokens = long_rationale_mismatch(groups=64, samples=8, tokens=3000, spread=2.0)
    rationale, answer = tokens.policy_logprob.sum(-1), torch.full((64, 8), -1.0)
    sequence_behavior = tokens.behavior_logprob.sum(-1)
    assert 1.8 < float((rationale - sequence_behavior).std()) < 2.2  # sequence ratios over e^±2
    ess = {}
    for mode in ("truncate", "token_truncate", "geometric"):
        behavior = tokens if mode != "truncate" else sequence_behavior
        for estimator in (garl, rloo):
            second = answer if estimator is garl else torch.ones(64, 8)
            metrics = estimator(rationale, second, *([0.5] if estimator is garl else []), behavior_logprob=behavior,
                                correction=Correction(mode)).metrics
            ess[mode] = (metrics["is_ess_fraction"], metrics["min_is_ess_fraction"])
    assert ess["truncate"][0] < 0.5 and ess["truncate"][1] < 0.25  # a group's weight on two or three of its eight
    for mode in ("token_truncate", "geometric"):
        assert min(ess[mode]) > 0.99, mode


#: One prompt, two rationales: three tokens with log-ratios (ln 2, ln 2, 0), and two with (−ln 2, 0); w = (1/2, 1/4).
HAND_RATIOS = torch.tensor([[[math.log(2), math.log(2), 0.0], [-math.log(2), 0.0, 0.0]]], dtype=torch.float64)
HAND_MASK = torch.tensor([[[True, True, True], [True, True, False]]])
HAND_W = (0.5, 0.25)
#: By hand, at q = 0 (Alg. 1, M = 2: c_m = v_m − ρ̃_m v_other, each token's coefficient −c_m/2 times its own weight,
#: the answer's −v_m/2; P̂ = v̄), with cap 1.5 (per token, geometric) or 2 (the sequence, ρ = (4, 1/2)).
_GEO = (1.5, 2 ** -0.5)  # exp(mean log r): 2^(2/3) truncated at 1.5; 2^(−1/2)
HAND = {
    "truncate": dict(cap=2.0, v=(2 * 0.5, 0.5 * 0.25), rho=(2.0, 0.5), token_weight=((1, 1, 1), (1, 1, 0)),
                     ess=(2.0 + 0.5) ** 2 / (4.0 + 0.25) / 2),
    "geometric": dict(cap=1.5, v=(_GEO[0] * 0.5, _GEO[1] * 0.25), rho=_GEO, token_weight=((1, 1, 1), (1, 1, 0)),
                      ess=sum(_GEO) ** 2 / (_GEO[0] ** 2 + _GEO[1] ** 2) / 2),
    "token_truncate": dict(cap=1.5, v=HAND_W, rho=(1.0, 1.0), token_weight=((1.5, 1.5, 1.0), (0.5, 1.0, 0.0)),
                           ess=(4 / 3 + 3 / 4) ** 2 / ((4 / 3) ** 2 + (3 / 4) ** 2) / 2),  # means of the tokens' weights
}


def check_the_hand_computed_case(mode: str, correction: Correction) -> None:
    """GARL at q = 0 and RLOO on :data:`HAND_RATIOS` against the values worked out by hand in :data:`HAND`."""
    hand = HAND[mode]
    policy = torch.full((1, 2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    answer = torch.tensor([HAND_W], dtype=torch.float64).log().requires_grad_()
    tokens = SampledTokens(policy, policy.detach() - HAND_RATIOS, HAND_MASK)
    rationale = (policy * HAND_MASK).sum(-1)
    out = garl(rationale, answer, 0.0, behavior_logprob=tokens, correction=correction)
    token_grad, answer_grad = torch.autograd.grad(out.loss, (policy, answer))
    v, rho, weight = hand["v"], hand["rho"], torch.tensor(hand["token_weight"], dtype=torch.float64)
    centred = torch.tensor([v[0] - rho[0] * v[1], v[1] - rho[1] * v[0]], dtype=torch.float64)
    torch.testing.assert_close(token_grad[0], -centred[:, None] * weight / 2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(answer_grad[0], -torch.tensor(v, dtype=torch.float64) / 2, rtol=1e-12, atol=1e-12)
    assert out.loss.item() == pytest.approx(1 - sum(v) / 2, rel=1e-12)  # ℓ_0 = 1 − P̂
    assert out.metrics["is_ess_fraction"] == pytest.approx(hand["ess"], rel=1e-12)
    # RLOO with rewards (1, 0): advantages (1, −1) times ρ̃_m, each token's term times its own weight.
    out = rloo((policy * HAND_MASK).sum(-1), torch.tensor([[1.0, 0.0]], dtype=torch.float64), behavior_logprob=tokens,
               correction=correction)
    (token_grad,) = torch.autograd.grad(out.loss, policy)
    advantage = torch.tensor([rho[0], -rho[1]], dtype=torch.float64)
    torch.testing.assert_close(token_grad[0], -advantage[:, None] * weight / 2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", list(HAND))
def test_each_form_on_a_hand_computed_case(mode):
    check_the_hand_computed_case(mode, Correction(mode, cap=HAND[mode]["cap"]))


def test_the_truncated_mass_is_the_share_of_the_ratios_the_cap_took_off():
    """docs/off_policy.md §6 asks for Σ(ρ − ρ̃)/Σρ beside the truncated fraction: one ratio of 100 capped at 2 is a
    quarter of four samples but nearly all their mass. Masked ratios count in Σρ, not in what was cut."""
    rho = torch.tensor([[1.0, 100.0, 0.5, 3.0]], dtype=torch.float64)
    metrics = Correction("truncate", cap=2.0).ratios(rho.log(), torch.zeros_like(rho)).metrics()
    assert metrics["is_truncated_fraction"] == 0.5
    assert metrics["is_truncated_mass"] == pytest.approx((98 + 1) / 104.5, rel=1e-12)
    masked = Correction("mask", low=0.6, high=2.0).ratios(rho.log(), torch.zeros_like(rho)).metrics()
    assert (masked["is_truncated_mass"], masked["is_masked_fraction"]) == (0.0, 0.75)
    tokens = torch.tensor([[[2.0, 8.0, 1.0]]], dtype=torch.float64)  # per token, the third not sampled
    where = torch.tensor([[[True, True, False]]])
    per_token = Correction("token_truncate", cap=4.0).ratios(tokens.log(), torch.zeros_like(tokens), where).metrics()
    assert per_token["is_truncated_mass"] == pytest.approx(4 / 10, rel=1e-12)


class SumForTheGeometricMean(Correction):
    """Broken: the geometric form takes the sequence ratio (the tokens' sum, not their mean)."""

    def per_sample(self, tokens):
        return Ratios(tokens.log_ratio.sum(-1), *self.corrected(tokens.log_ratio.sum(-1)))


class UntruncatedTokens(Correction):
    """Broken: no cap (every per-token ratio as is)."""

    def corrected(self, log_ratio):
        return log_ratio, torch.ones_like(log_ratio)


class TokenCapOnTheProduct(Correction):
    """Broken: token truncation as the product of the truncated token ratios, one weight per sample."""

    def for_samples(self, logprob, behavior):
        truncated = (behavior.policy_logprob - behavior.behavior_logprob).clamp(max=math.log(self.cap))
        return Correction("plain").for_samples(logprob, logprob.detach() - truncated.masked_fill(~behavior.mask, 0).sum(-1))


def ess_of_the_raw_ratio(self):
    """Broken ESS: of the ratios before they were corrected."""
    return self.log_ratio if self.where is None else self.log_ratio.mean(-1)


@pytest.mark.parametrize(("mode", "broken"), [
    ("geometric", SumForTheGeometricMean("geometric", cap=1.5)), ("geometric", UntruncatedTokens("geometric", cap=1.5)),
    ("token_truncate", UntruncatedTokens("token_truncate", cap=1.5)),
    ("token_truncate", TokenCapOnTheProduct("token_truncate", cap=1.5)), ("truncate", ess_of_the_raw_ratio),
    ("token_truncate", ess_of_the_raw_ratio)])
def test_the_hand_computed_case_fails_on_a_broken_copy(monkeypatch, mode, broken):
    correction = broken
    if callable(broken) and not isinstance(broken, Correction):
        monkeypatch.setattr(Ratios, "sample_log_weight", broken)
        correction = Correction(mode, cap=HAND[mode]["cap"])
    with pytest.raises(AssertionError):
        check_the_hand_computed_case(mode, correction)


def test_grpo_and_paft_apply_each_per_token_form():
    """GRPO: token_truncate is its (per-token) truncate; geometric gives a completion's every token the truncated
    geometric mean of its ratios. PAFT: each resampled rationale token's term carries its own weight."""
    rewards = torch.tensor([[1.0, 0.0]])
    logprob = torch.full((1, 2, 3), -1.0, requires_grad=True)
    behavior = logprob.detach() - HAND_RATIOS.float()
    grads = {}
    for mode in ("truncate", "token_truncate", "geometric"):
        out = grpo(logprob, rewards, HAND_MASK.float(), behavior_logprob=behavior, correction=Correction(mode, cap=1.5),
                   aggregation="sequence_mean")
        grads[mode] = torch.autograd.grad(out.loss, logprob)[0]
    assert torch.equal(grads["truncate"], grads["token_truncate"])
    on_policy = torch.autograd.grad(grpo(logprob, rewards, HAND_MASK.float(), aggregation="sequence_mean").loss, logprob)[0]
    torch.testing.assert_close(grads["geometric"], on_policy * torch.tensor(_GEO).view(1, 2, 1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads["token_truncate"], on_policy * torch.tensor(HAND["token_truncate"]["token_weight"]))
    answer = torch.tensor([HAND_W]).log().requires_grad_()
    for mode in ("token_truncate", "geometric"):
        out = paft((logprob * HAND_MASK).sum(-1), answer, 0.5, num_resamples=64, generator=torch.Generator().manual_seed(0),
                   behavior_logprob=SampledTokens(logprob, behavior, HAND_MASK), correction=Correction(mode, cap=1.5))
        token_grad, answer_grad = torch.autograd.grad(out.loss, (logprob, answer))
        weight = torch.tensor(HAND[mode]["token_weight"], dtype=torch.float32)
        torch.testing.assert_close(token_grad[0], answer_grad[0][:, None] * weight)  # each resampled token × its ρ̃_t
        v = torch.tensor(HAND[mode]["v"])
        assert out.metrics["p_hat"] == pytest.approx(float(v.mean()), rel=1e-6)  # P̂ = v̄ (w̄ for token_truncate)


def test_a_per_token_form_refuses_the_sequence_sums():
    with pytest.raises(ValueError, match="'geometric' works from the per-token ratios: pass the sampled tokens"):
        garl(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, behavior_logprob=torch.zeros(1, 2), correction=Correction("geometric"))


class TwoTokenModel:
    """Rationales of two tokens, each of three values: p(z1) = softmax(θ1), p(z2|z1) = softmax(θ2[z1]); the answer's
    w(z) = sigmoid(φ[z1, z2]); the behaviour π shifts both logits. Its nine rationales are enumerated exactly; the
    parameters are (θ1, θ2, φ), 21 of them."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        theta1, theta2, phi = rng.normal(size=3), rng.normal(size=(3, 3)), rng.normal(size=(3, 3)) - 0.5
        shift1, shift2 = 0.6 * rng.normal(size=3), 0.6 * rng.normal(size=(3, 3))
        softmax = lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True)  # noqa: E731
        p1, p2, pi1, pi2 = softmax(theta1), softmax(theta2), softmax(theta1 + shift1), softmax(theta2 + shift2)
        self.sequences = [(i, j) for i in range(3) for j in range(3)]
        self.token_logprob = np.log([[p1[i], p2[i, j]] for i, j in self.sequences])  # [9, 2]
        self.behavior_token_logprob = np.log([[pi1[i], pi2[i, j]] for i, j in self.sequences])
        self.w = 1 / (1 + np.exp(-np.array([phi[i, j] for i, j in self.sequences])))
        self.token_score = np.zeros((9, 2, 21))  # ∇ log p(z_t | z_<t)
        self.answer_score = np.zeros((9, 21))  # ∇ log w
        for n, (i, j) in enumerate(self.sequences):
            self.token_score[n, 0, :3] = np.eye(3)[i] - p1
            self.token_score[n, 1, 3 + 3 * i:6 + 3 * i] = np.eye(3)[j] - p2[i]
            self.answer_score[n, 12 + 3 * i + j] = 1 - self.w[n]
        self.p, self.pi = np.exp(self.token_logprob.sum(1)), np.exp(self.behavior_token_logprob.sum(1))
        self.rho = self.p / self.pi
        self.grad_loss0 = -(self.p * self.w) @ (self.token_score.sum(1) + self.answer_score)  # ∇ℓ_0 = −∇P

    def expectation(self, correction: Correction, samples: int) -> np.ndarray:
        """E_π of GARL's q = 0 gradient over every ordered pool of ``samples`` rationales."""
        pools = np.array(list(itertools.product(range(9), repeat=samples)))
        probs = self.pi[pools].prod(1)
        policy = torch.tensor(self.token_logprob[pools], requires_grad=True)
        answer = torch.tensor(np.log(self.w)[pools], requires_grad=True)
        tokens = SampledTokens(policy, torch.tensor(self.behavior_token_logprob[pools]), torch.ones_like(policy, dtype=torch.bool))
        out = garl(policy.sum(-1), answer, 0.0, behavior_logprob=tokens, correction=correction)
        out.per_example.sum().backward()
        grads = (np.einsum("cmt,cmtp->cp", policy.grad.numpy(), self.token_score[pools])
                 + np.einsum("cm,cmp->cp", answer.grad.numpy(), self.answer_score[pools]))
        return probs @ grads


@pytest.mark.parametrize("cap", [1e9, 1.2])
def test_token_truncations_bias_at_q0_is_the_derived_formula(cap):
    """§11: E_π[w Σ_t (ρ − ρ̃_t) s_t + (ρ − 1) w a] + P_π E_π[Σ_t ρ̃_t s_t], whatever M; the last term is 0 untruncated."""
    model = TwoTokenModel()
    r_tilde = np.minimum(np.exp(model.token_logprob - model.behavior_token_logprob), cap)
    w, rho, pi, s, a = model.w, model.rho, model.pi, model.token_score, model.answer_score
    weighted_score = np.einsum("nt,ntp->np", r_tilde, s)
    baseline_term = float(pi @ w) * (pi @ weighted_score)
    formula = (pi * w) @ (rho[:, None] * s.sum(1) - weighted_score) + (pi * (rho - 1) * w) @ a + baseline_term
    for samples in (2, 3):
        np.testing.assert_allclose(model.expectation(Correction("token_truncate", cap=cap), samples) - model.grad_loss0,
                                   formula, atol=1e-12)
    assert np.linalg.norm(formula) > 0.05 * np.linalg.norm(model.grad_loss0)  # biased
    assert (np.linalg.norm(baseline_term) < 1e-12) == (cap > 100)


@pytest.mark.parametrize("cap", [1e9, 1.2])
def test_the_geometric_means_bias_at_q0_is_the_truncation_formula_with_its_ratio(cap):
    """§11: ρ̃ = min(ρ^(1/T), C) is a function of z, so §3.1's E_π[(ρ − ρ̃)((w − P̃) s + w a)] holds, whatever M."""
    model = TwoTokenModel()
    w, rho, pi = model.w, model.rho, model.pi
    rho_tilde = np.minimum(rho ** 0.5, cap)
    p_tilde = float(pi @ (rho_tilde * w))
    formula = (pi * (rho - rho_tilde)) @ ((w - p_tilde)[:, None] * model.token_score.sum(1) + w[:, None] * model.answer_score)
    for samples in (2, 3):
        np.testing.assert_allclose(model.expectation(Correction("geometric", cap=cap), samples) - model.grad_loss0,
                                   formula, atol=1e-12)
    assert np.linalg.norm(formula) > 0.05 * np.linalg.norm(model.grad_loss0)
    np.testing.assert_allclose(model.expectation(Correction("plain"), 2), model.grad_loss0, atol=1e-12)  # ρ: unbiased


@pytest.mark.parametrize("mode", ["truncate", "token_truncate", "geometric"])
@pytest.mark.slow
def test_a_training_step_logs_the_effective_sample_size_of_the_corrected_weights(tmp_path, mode):
    """With objective.importance set, the step's record says how evenly each group's corrected weights spread."""
    trainer = Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'run'}", f"objective.importance={mode}",
                                         "train.max_steps=1", "eval.every=100", "train.save_every=100"]))
    trainer.fit()
    [record] = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    samples = trainer.config.rollout.num_samples
    assert 1 / samples <= record["min_is_ess_fraction"] <= record["is_ess_fraction"] <= 1.0
