"""Issue 33's estimators: the two GARL ablations (no pathwise term; PAFT's pathwise term) and the verifier-free
baselines (RLPR's reward, length-normalised GARL, MaxRL's advantage), each against exact enumeration on the latent
model (nemo_jq.theory.latent) or a plain-torch reference written here, each caught when broken, each trained
through the real Trainer and CLI as docs/estimators.md shows."""

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import TINY_RUN, run_cli
from latent_pools import Pools
from nemo_jq.config import load_config
from nemo_jq.objectives import (
    Need,
    ObjectiveOutput,
    garl,
    garl_length_normalized,
    garl_resampled_pathwise,
    garl_score_only,
    get_objective,
    maxrl,
    resample_indices,
    rlpr,
)
from nemo_jq.objectives.weights import weight_stats
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.runtime.monitor import read_metrics
from nemo_jq.theory import default_model
from nemo_jq.theory.latent import LatentModel, count_vector_probabilities, pools_from_counts, sample_count_vectors
from nemo_jq.typed import ConfigError

MODEL = default_model()
DOC = Path(__file__).resolve().parents[3] / "docs" / "estimators.md"
NEW = ("garl_score_only", "garl_resampled_pathwise", "rlpr", "garl_length_normalized", "maxrl")


def dropped_pathwise_term(pools: Pools, q: float) -> np.ndarray:
    """``E[(1/M) Σ_m (w_m/w̄^q) ∇log p(y*|x,z_m)]`` over ``pools``, in numpy: GARL's pathwise term, loss sign +."""
    w = pools.model.weights[pools.latents]  # [C, M]
    coefficient = w / w.mean(1, keepdims=True) ** q
    per_pool = np.einsum("cm,cmp->cp", coefficient, pools.model.answer_score()[pools.latents]) / w.shape[1]
    return pools.probs @ per_pool


def answer_gets_zeros(estimator):
    """``estimator`` with a zero gradient on log p(y*|x,z) where it leaves it none (Pools maps both gradients)."""
    def connected(rlp, alp, *args, **options):
        out = estimator(rlp, alp, *args, **options)
        per_example = out.per_example + 0.0 * alp.sum(-1)
        return ObjectiveOutput(per_example.mean(), per_example, out.metrics)
    return connected


# ---------------------------------------------------------------- GARL without its pathwise term


def check_score_only(estimator):
    """At q=0 the expectation is ∇ℓ_0 + E_z[∇p(y*|x,z)] exactly (GARL's is ∇ℓ_0); at q>0 it is GARL's plus the dropped
    term. Only p(z|x) moves."""
    estimator = answer_gets_zeros(estimator)
    expected = MODEL.grad_loss(0.0) + MODEL.prior @ (MODEL.weights[:, None] * MODEL.answer_score())
    for m in (2, 5):
        pools = Pools.enumerate(MODEL, m)
        np.testing.assert_allclose(pools.expectation(estimator, q=0.0), expected, atol=1e-12)
        for q in (0.5, 1.0):
            shift = pools.expectation(estimator, q=q, normalize=False) - pools.expectation(garl, q=q, normalize=False)
            np.testing.assert_allclose(shift, dropped_pathwise_term(pools, q), atol=1e-12)
    assert np.all(Pools.enumerate(MODEL, 4).gradients(estimator, q=0.5)[:, MODEL.num_latents:] == 0)


def test_garl_without_its_pathwise_term_is_biased_by_exactly_that_term():
    check_score_only(garl_score_only)
    expected = MODEL.grad_loss(0.0) + MODEL.prior @ (MODEL.weights[:, None] * MODEL.answer_score())
    assert np.linalg.norm(expected - MODEL.grad_loss(0.0)) > 0.3 * np.linalg.norm(MODEL.grad_loss(0.0))  # not small


def test_a_score_only_copy_that_keeps_the_pathwise_term_fails():
    with pytest.raises(AssertionError):
        check_score_only(garl)


# ---------------------------------------------------------------- GARL with PAFT's pathwise term


def resampled_pathwise_reference(rlp, alp, q, num_resamples, seed):
    """Gradients with respect to (rlp, alp), by hand: GARL's centred score coefficients, and each resampled index's
    pathwise coefficient ``w̄^{1-q} / (M^q K)`` (the indices drawn as PAFT draws them)."""
    w = alp.exp()
    samples = w.shape[1]
    mean = w.mean(1, keepdim=True)
    leave_one_out = (w.sum(1, keepdim=True) - w) / (samples - 1)
    centred = w / mean**q - leave_one_out ** (1 - q)
    picks = resample_indices(alp, num_resamples, torch.Generator().manual_seed(seed))
    counts = torch.zeros_like(w).scatter_add_(1, picks, torch.ones_like(picks, dtype=w.dtype))
    scale = samples**-q / samples / len(w)  # Alg. 1's 1/M^q, the mean over M and the loss's mean over B
    return -scale * centred, -counts * mean ** (1 - q) * samples**-q / num_resamples / len(w)


def check_resampled_pathwise(estimator):
    gen = torch.Generator().manual_seed(3)
    rlp = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    alp = (torch.randn(3, 5, generator=gen, dtype=torch.float64) - 2).requires_grad_()
    for q in (0.0, 0.6, 1.0):
        rlp.grad = alp.grad = None
        estimator(rlp, alp, q, num_resamples=4, generator=torch.Generator().manual_seed(9)).loss.backward()
        want_rationale, want_answer = resampled_pathwise_reference(rlp.detach(), alp.detach(), q, 4, 9)
        torch.testing.assert_close(rlp.grad, want_rationale)
        torch.testing.assert_close(alp.grad, want_answer)


def test_garl_with_pafts_pathwise_term_matches_a_plain_torch_reference():
    check_resampled_pathwise(garl_resampled_pathwise)


def test_a_resampled_pathwise_copy_that_is_plain_garl_fails():
    with pytest.raises(AssertionError):
        check_resampled_pathwise(lambda rlp, alp, q, num_resamples, generator: garl(rlp, alp, q))


def test_pafts_pathwise_term_inside_garl_keeps_garls_mean_and_adds_variance():
    """Given each pool, the mean over resamples is GARL's gradient (Monte Carlo within 5 standard errors, against
    GARL's exact per-pool gradient); so at q=0 the expectation is ∇ℓ_0. The spread is larger than GARL's."""
    q, m, repeats = 0.5, 5, 300
    pools = Pools.enumerate(MODEL, m)
    torch.manual_seed(0)
    grads = pools.gradients(garl_resampled_pathwise, repeat=repeats, q=q, num_resamples=2)
    grads = grads.reshape(len(pools.probs), repeats, -1)
    exact = pools.gradients(garl, q=q)
    stderr = grads.std(1) / np.sqrt(repeats)
    assert np.all(np.abs(grads.mean(1) - exact) <= 5 * stderr + 1e-9)
    assert np.all(grads.std(1)[:, MODEL.num_latents:].max(1) > 0)  # the pathwise term does vary between resamples
    spread = float(pools.probs @ ((grads - pools.probs @ grads.mean(1)) ** 2).sum(2).mean(1))
    assert spread > 1.2 * pools.variance(garl, q=q)
    at_q0 = pools.probs @ pools.gradients(garl_resampled_pathwise, repeat=repeats, q=0.0).reshape(
        len(pools.probs), repeats, -1).mean(1)
    np.testing.assert_allclose(at_q0, MODEL.grad_loss(0.0), atol=0.02)


# ---------------------------------------------------------------- RLPR's reward


def one_token_rlpr(**options):
    """RLPR on the latent model, whose y* is one token: its mean per-token probability is w_z."""
    @answer_gets_zeros
    def estimator(rlp, alp):
        return rlpr(rlp, alp.unsqueeze(-1), torch.ones_like(alp, dtype=torch.bool).unsqueeze(-1), **options)
    return estimator


def check_rlpr(estimator_with):
    """With the mean baseline alone, E[ĝ] = -(1 - 1/M) Σ_z p(z) r̂_z ∇log p(z|x), r̂_z = clip(w_z - r', 0, 1)."""
    for m in (2, 4):
        pools = Pools.enumerate(MODEL, m)
        for no_reasoning in (0.0, 0.3):
            estimator = estimator_with(scale_rewards="none",
                                       no_reasoning_reward=torch.full((len(pools.probs),), no_reasoning))
            debiased = np.clip(MODEL.weights - no_reasoning, 0.0, 1.0)
            want = -(1 - 1 / m) * MODEL.prior @ (debiased[:, None] * MODEL.rationale_score())
            np.testing.assert_allclose(pools.expectation(estimator), want, atol=1e-12)


def test_rlprs_reward_with_a_mean_baseline_has_the_exact_expectation():
    check_rlpr(one_token_rlpr)


def test_an_rlpr_copy_without_the_clip_fails():
    def unclipped(scale_rewards, no_reasoning_reward):
        @answer_gets_zeros
        def estimator(rlp, alp):
            reward = alp.detach().exp() - no_reasoning_reward[:, None]
            per_example = -((reward - reward.mean(1, keepdim=True)) * rlp).mean(1)
            return ObjectiveOutput(per_example.sum(), per_example)
        return estimator

    with pytest.raises(AssertionError):
        check_rlpr(unclipped)


def test_rlpr_matches_a_plain_torch_reference_on_tokens():
    """Several answer tokens (padding masked out), GRPO's group normalisation, r' and the std filter, by hand."""
    gen = torch.Generator().manual_seed(4)
    tokens = -torch.rand(3, 4, 5, generator=gen, dtype=torch.float64) * 2
    mask = torch.ones(3, 4, 5, dtype=torch.bool)
    mask[:, :, 3:] = False
    mask[1, 2, 2] = False
    tokens[2] = tokens[2, :1]  # the last group's samples agree: its std is 0, the filter drops it
    rlp = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    no_reasoning = torch.tensor([0.2, 0.9, 0.1], dtype=torch.float64)
    out = rlpr(rlp, tokens, mask, no_reasoning_reward=no_reasoning, min_reward_std=1e-3)
    out.loss.backward()
    reward = torch.stack([torch.stack([tokens[b, m][mask[b, m]].exp().mean() for m in range(4)]) for b in range(3)])
    debiased = torch.clamp(reward - no_reasoning[:, None], min=0.0, max=1.0)
    advantage = (debiased - debiased.mean(1, keepdim=True)) / (debiased.std(1, keepdim=True) + 1e-6)
    advantage[2] = 0.0
    torch.testing.assert_close(rlp.grad, -advantage / 4 / 3)
    assert out.metrics["filtered_fraction"] == pytest.approx(2 / 3)  # the last group, and the second: r' > every r
    assert out.metrics["probability_reward"] == pytest.approx(reward.mean().item())


# ---------------------------------------------------------------- length-normalised GARL


@dataclass(frozen=True)
class TokensModel(LatentModel):
    """The latent model with y* of ``tokens`` tokens, each of probability sigmoid(phi_z) given z:
    p(y*|x,z) = sigmoid(phi_z)^tokens, so its per-token geometric mean is the one-token model's w_z."""

    tokens: int = 3

    @property
    def weights(self) -> np.ndarray:
        return super().weights ** self.tokens

    def answer_score(self) -> np.ndarray:
        """∇log p(y*|x,z) = tokens (1 - sigmoid(phi_z)) on phi_z."""
        k, per_token = self.num_latents, LatentModel(self.prior_logits, self.answer_logits).weights
        return np.concatenate([np.zeros((k, k)), np.diag(self.tokens * (1.0 - per_token))], axis=1)


def check_length_normalized(estimator):
    """On the 3-token model its expectation is GARL's on the one-token model, pool for pool: at q=0 it is -∇P̃ of the
    geometric-mean likelihood P̃ = E_z[w_z^{1/3}], which is not ∇ℓ_0 of the 3-token model."""
    three = TokensModel(MODEL.prior_logits, MODEL.answer_logits, tokens=3)

    def per_token(rlp, alp, q, **options):
        return estimator(rlp, alp, torch.full_like(alp, 3.0), q, **options)

    for m in (2, 5):
        got = Pools.enumerate(three, m).expectation(per_token, q=0.0)
        np.testing.assert_allclose(got, MODEL.grad_loss(0.0), atol=1e-12)
        assert np.linalg.norm(got - three.grad_loss(0.0)) > 0.05
        np.testing.assert_allclose(Pools.enumerate(three, m).expectation(per_token, q=0.75, normalize=False),
                                   Pools.enumerate(MODEL, m).expectation(garl, q=0.75, normalize=False), atol=1e-12)


def test_length_normalised_garl_is_garl_on_the_per_token_likelihood_not_on_lq():
    check_length_normalized(garl_length_normalized)


def test_a_length_normalised_copy_that_forgets_the_length_fails():
    with pytest.raises(AssertionError):
        check_length_normalized(lambda rlp, alp, tokens, q, **options: garl(rlp, alp, q, **options))


def test_length_normalised_garl_reports_the_true_p_hat():
    alp = torch.tensor([[-6.0, -9.0, -4.0]])
    out = garl_length_normalized(torch.zeros(1, 3), alp, torch.full((1, 3), 3.0), 0.5)
    assert out.metrics["log_p_hat"] == pytest.approx(weight_stats(alp, 0.5).log_mean.item())
    assert out.metrics["per_token_log_p_hat"] == pytest.approx(weight_stats(alp / 3, 0.5).log_mean.item())


# ---------------------------------------------------------------- MaxRL's advantage


def outcome_pools(model: LatentModel, num_samples: int):
    """Every pool of M sampled (rationale, answer) outcomes, an answer right with probability w_z: the pools' latent
    outcome indices (z for a hit, K + z for a miss), their probabilities, each outcome's score ∇log p(z, ŷ|x) and
    reward."""
    k, w = model.num_latents, model.weights
    probs = np.concatenate([model.prior * w, model.prior * (1 - w)])
    miss_score = model.rationale_score() - np.concatenate([np.zeros((k, k)), np.diag(w)], axis=1)  # ∇log(1 - w_z)
    scores = np.concatenate([model.rationale_score() + model.answer_score(), miss_score])
    counts = sample_count_vectors(2 * k, num_samples)
    pools = pools_from_counts(counts)
    return pools, count_vector_probabilities(counts, probs), scores, (pools < k).astype(float)


def maxrl_expectation(estimator, model, num_samples, **options):
    pools, probs, scores, rewards = outcome_pools(model, num_samples)
    sequence = torch.zeros(pools.shape, dtype=torch.float64, requires_grad=True)  # only the gradient matters
    estimator(sequence, torch.tensor(rewards), **options).per_example.sum().backward()
    return probs @ np.einsum("cm,cmp->cp", sequence.grad.numpy(), scores[pools])


def check_maxrl(estimator):
    """E[ĝ] = -(1 - (1-P)^n)/P ∇P: n = M without the control variate (MaxRL's order-M truncation of log P), n = M - 1
    with it."""
    for model in (MODEL, LatentModel(np.array([0.2, -1.0, 0.4]), np.array([-2.0, 0.5, -3.0]))):
        p, grad_p = model.success_probability, -(model.prior @ model.per_latent_g())
        for m in (2, 3, 5):
            for control_variate, order in ((False, m), (True, m - 1)):
                want = -(1 - (1 - p) ** order) / p * grad_p
                np.testing.assert_allclose(maxrl_expectation(estimator, model, m, control_variate=control_variate),
                                           want, atol=1e-12)


def test_maxrl_is_unbiased_for_its_truncated_likelihood():
    check_maxrl(maxrl)


def test_a_maxrl_copy_without_the_mean_normalisation_fails():
    def centred_only(sequence, rewards, control_variate):
        advantage = rewards - rewards.mean(-1, keepdim=True) if control_variate else rewards
        per_example = -(advantage * sequence).mean(-1)
        return ObjectiveOutput(per_example.sum(), per_example)

    with pytest.raises(AssertionError):
        check_maxrl(centred_only)


def test_maxrls_advantage_is_garls_q1_coefficient_with_p_from_verifier_hits():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    sequence = torch.zeros(4, 4, requires_grad=True)
    maxrl(sequence, rewards).per_example.sum().backward()
    advantage = -sequence.grad * 4
    hits = rewards.sum(1) > 0
    torch.testing.assert_close(advantage[hits], weight_stats(rewards.log(), 1.0).centred_weight()[hits])
    assert torch.all(advantage[~hits] == 0)  # GARL's w̄ is 0 there: MaxRL defines no gradient


def test_maxrl_refuses_negative_rewards():
    with pytest.raises(ValueError, match="rewards must be >= 0; got min -1.0"):
        maxrl(torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]))


# ---------------------------------------------------------------- registration, options, training


def test_the_new_estimators_are_registered_with_their_needs_and_options():
    for name in NEW:
        spec = get_objective(name)
        assert spec.uses_q == name.startswith("garl") and spec.min_samples == 2 and not spec.corrects_off_policy
    assert get_objective("garl_resampled_pathwise").parse_options({"num_resamples": 3}).num_resamples == 3
    assert get_objective("maxrl").parse_options({"control_variate": False}).control_variate is False
    with pytest.raises(ConfigError, match=r"objective.options.scale_rewards.*batch"):
        get_objective("rlpr").parse_options({"scale_rewards": "batch"})
    with pytest.raises(ConfigError, match="did you mean 'num_resamples'"):
        get_objective("garl_resampled_pathwise").parse_options({"num_resample": 3})


def longer_earns_more(output, example):
    """A stand-in verifier reward that differs within a group (the tiny model never writes the right sum)."""
    return len(output) / (1 + len(output))


def doc_commands(run_dirs: bool = False) -> list[list[str]]:
    """The ``nemo-jq train`` lines of docs/estimators.md, as argument lists (without their ``train.run_dir``: a test
    gives its own)."""
    commands = [shlex.split(line)[2:] for line in DOC.read_text().splitlines() if line.startswith("nemo-jq train ")]
    return commands if run_dirs else [[word for word in args if not word.startswith("train.run_dir=")] for args in commands]


def test_the_doc_shows_one_command_per_new_estimator_each_a_run_of_its_own():
    names = [re.search(r"objective\.name=(\S+)", " ".join(args)).group(1) for args in doc_commands()]
    assert sorted(names) == sorted(NEW)
    # one after another, each in its own folder: in the default runs/train the second was refused (a run is there)
    folders = [word for args in doc_commands(run_dirs=True) for word in args if word.startswith("train.run_dir=")]
    assert len(folders) == len(set(folders)) == len(names)


@pytest.mark.parametrize("command", doc_commands(), ids=lambda args: args[0].split("=")[1])
def test_each_doc_command_trains_two_steps(tmp_path, capsys, monkeypatch, command):
    """The doc's command through ``nemo-jq train`` on the tiny run: two steps with a gradient (MaxRL with the
    stand-in reward, which the tiny model can earn)."""
    from nemo_jq.data.synthetic import SyntheticArithmetic

    monkeypatch.setattr(SyntheticArithmetic, "reward", lambda self, output, example: longer_earns_more(output, example))
    code, _, err = run_cli(capsys, "train", *TINY_RUN, "train.max_steps=2", "eval.every=1000",
                           f"train.run_dir={tmp_path / 'run'}", *command)
    assert code == 0, err
    train = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in train)
    if Need.REFERENCE_ANSWER_LOGPROB in get_objective(command[0].split("=")[1]).needs:
        assert all(np.isfinite(r["log_p_hat"]) for r in train)


def test_the_trainer_hands_each_new_estimator_what_its_pure_function_gets(tmp_path):
    """One batch of real rollouts: the registered adapters read the spans the pure functions document."""
    trainer = Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'run'}", "objective.name=rlpr"]))
    parts = trainer.components
    examples = parts.splits.train[:2]
    from nemo_jq.objectives import EstimatorInputs
    from nemo_jq.recipe.experience import experience_from

    rollouts = parts.engine.generate(parts.prompt_ids(examples), 4, sample_answers=False, generator=torch.Generator().manual_seed(0))
    batch = experience_from(parts, examples, trainer.objective.estimator, rollouts, 0, 0.0).batch
    token_lp = trainer.policy.token_logprobs(batch).detach()
    inputs = EstimatorInputs(token_lp, batch.rationale_mask, batch.answer_mask, 4, q=0.5,
                             generator=torch.Generator().manual_seed(2))
    rationale = (token_lp * batch.rationale_mask).sum(-1).view(2, 4)
    answer = (token_lp * batch.answer_mask).sum(-1).view(2, 4)
    lengths = batch.answer_mask.sum(-1).view(2, 4)
    expected = {
        "garl_score_only": garl_score_only(rationale, answer, 0.5),
        "garl_resampled_pathwise": garl_resampled_pathwise(rationale, answer, 0.5,
                                                           generator=torch.Generator().manual_seed(2)),
        "garl_length_normalized": garl_length_normalized(rationale, answer, lengths, 0.5),
        "rlpr": rlpr(rationale, token_lp.view(2, 4, -1), batch.answer_mask.view(2, 4, -1)),
    }
    assert int(lengths.min()) > 1  # y* spans several tokens: length normalisation does something
    for name, out in expected.items():
        got = get_objective(name)(inputs)
        assert got.loss.item() == pytest.approx(out.loss.item()) and got.metrics == pytest.approx(out.metrics), name


def test_rlpr_refuses_one_sample_a_prompt():
    """M=1 has no group baseline and no std: the loss was NaN, said nowhere."""
    one = torch.zeros(2, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="RLPR"):
        rlpr(one, one.unsqueeze(-1), torch.ones(2, 1, 1, dtype=torch.bool))
