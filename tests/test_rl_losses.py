"""jaxllm's PPO / GRPO functions (jaxllm/objectives/losses.py) against TRL.

PPO left TRL in 2026, so gae, whiten, kl_penalty, ppo_policy_loss and ppo_value_loss are checked against
float64 NumPy transcriptions of the last-published trl/trainer/ppo_trainer.py (PPOTrainer.train) and of TRL's
masked_mean / masked_var / masked_whiten; group_advantages against a transcription of TRL 1.13.0
GRPOTrainer._generate_and_score_completions; grpo_loss against TRL 1.13.0's own
FusedLinearGRPOFunction.ppo_loss_fn. Plus the on-policy limits, the estimators' zeros and sign, and the
argument checks.

Inputs are drawn in float32 and fed to NumPy / torch as the very same values in float64, so every difference is
jaxllm's float32 arithmetic alone. Masks are ragged prefixes (each row 1..T valid tokens, row 0 full, the last
row a single token), or all full; padding holds garbage (TRL's INVALID_LOGPROB = 1.0 for log-probs, large
random numbers elsewhere) that must not leak.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.objectives.losses import (GRPO_LOSS_AGGS, KL_ESTIMATORS, gae, group_advantages, grpo_loss, kl_penalty,
                                ppo_policy_loss, ppo_value_loss, whiten)

B, T = 6, 12
INVALID_LOGPROB = 1.0  # TRL's padding value for log-probs
# A relative 1e-6 (~8 float32 ulps), with 1e-6 absolute for values near zero: jax computes in float32, the
# references in float64. Measured over 40 seeds x {ragged, full}, as a fraction of this tolerance: GAE returns
# <= 0.90 and advantages <= 0.72 (a T-step float32 recurrence on values of size ~5), whitening <= 0.45, the
# rest <= 0.17. The seeds below are fixed, so the margin is deterministic.
TOL = dict(rtol=1e-6, atol=1e-6)


def _mask(rng, kind):
    if kind == "full":
        return np.ones((B, T), np.float32)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0], lengths[-1] = T, 1
    return (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)


def _batch(seed, kind):
    """float32 [B, T] arrays: mask, log-probs (policy, old, ref), advantages, values, old values, returns,
    rewards, with garbage at padding."""
    rng = np.random.default_rng(seed)
    mask = _mask(rng, kind)
    pad = mask == 0

    def arr(x, fill):
        return np.where(pad, fill, x).astype(np.float32)

    logp = -rng.uniform(0.05, 4.0, (B, T))
    old = logp + rng.normal(0, 0.3, (B, T))  # ratios spread past 1 +- 0.2, so some tokens clip
    ref = logp + rng.normal(0, 0.5, (B, T))
    big = rng.uniform(-1e3, 1e3, (B, T))
    values = rng.normal(0, 1, (B, T))
    return dict(mask=mask, logp=arr(logp, INVALID_LOGPROB), old=arr(old, INVALID_LOGPROB),
                ref=arr(ref, INVALID_LOGPROB), adv=arr(rng.normal(0, 1, (B, T)), big),
                values=arr(values, big), old_values=arr(values + rng.normal(0, 0.3, (B, T)), big),
                returns=arr(rng.normal(0, 1.5, (B, T)), big), rewards=arr(rng.normal(0, 1, (B, T)), big))


def _f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


CASES = [(0, "ragged"), (1, "ragged"), (2, "ragged"), (3, "full")]


# ---- float64 NumPy transcriptions of TRL ------------------------------------------------------------------


def _np_masked_mean(values, mask):
    """TRL masked_mean (trl/trainer/utils.py, last published with PPO): (values * mask).sum() / mask.sum()."""
    return (values * mask).sum() / mask.sum()


def _np_masked_var(values, mask):
    """TRL masked_var(unbiased=True): mean = masked_mean(values, mask); centered_values = values - mean;
    variance = masked_mean(centered_values**2, mask); bessel_correction = mask_sum / (mask_sum - 1);
    variance = variance * bessel_correction (TRL raises for mask_sum 0 or 1)."""
    mean = _np_masked_mean(values, mask)
    variance = _np_masked_mean((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    return variance * mask_sum / (mask_sum - 1)


def _np_masked_whiten(values, mask, shift_mean=True):
    """TRL masked_whiten: mean, var = masked_mean(values, mask), masked_var(values, mask);
    whitened = (values - mean) * torch.rsqrt(var + 1e-8); if not shift_mean: whitened += mean."""
    mean, var = _np_masked_mean(values, mask), _np_masked_var(values, mask)
    whitened = (values - mean) / np.sqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def _np_gae(rewards, values, mask, gamma, lam):
    """TRL PPOTrainer.train (trl/trainer/ppo_trainer.py, last published before PPO left TRL in 2026), after
    values = torch.masked_fill(values, padding_mask_p1, 0) and rewards likewise (here: the mask's padding):

        lastgaelam = 0; advantages_reversed = []
        for t in reversed(range(gen_length)):
            nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
            delta = rewards[:, t] + args.gamma * nextvalues - values[:, t]
            lastgaelam = delta + args.gamma * args.lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], axis=1)
        returns = advantages + values
        ...
        advantages = torch.masked_fill(advantages, padding_mask, 0)
    """
    values, rewards = np.where(mask > 0, values, 0.0), np.where(mask > 0, rewards, 0.0)
    gen_length = values.shape[1]
    lastgaelam, advantages_reversed = 0.0, []
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = np.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    return np.where(mask > 0, advantages, 0.0), returns


def _np_kl(logprobs, ref_logprobs, kind):
    """TRL PPOTrainer.train: logr = ref_logprobs - logprobs; kl = -logr if kl_estimator == "k1" else
    (logr.exp() - 1) - logr  # k3. k2 (not in TRL's PPOTrainer) is Schulman's logr**2 / 2."""
    logr = ref_logprobs - logprobs
    return {"k1": -logr, "k2": 0.5 * logr ** 2, "k3": (np.exp(logr) - 1) - logr}[kind]


def _np_ppo_policy(logprobs, old_logprobs, advantages, mask, cliprange):
    """TRL PPOTrainer.train, per micro-batch (padding of new_logprobs and mb_logprobs filled with
    INVALID_LOGPROB, advantages masked_fill'd with 0):

        logprobs_diff = new_logprobs - mb_logprobs
        ratio = torch.exp(logprobs_diff)
        pg_losses = -mb_advantage * ratio
        pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
        pg_loss_max = torch.max(pg_losses, pg_losses2)
        pg_loss = masked_mean(pg_loss_max, ~padding_mask[micro_batch_inds])
        pg_clipfrac = masked_mean((pg_losses2 > pg_losses).float(), ~padding_mask[micro_batch_inds])
        approxkl = 0.5 * (logprobs_diff**2).mean()

    TRL's approxkl is a plain mean over all B x T positions, where padding contributes 0 (both sides hold
    INVALID_LOGPROB); jaxllm's is the masked mean, i.e. TRL's times B T / n_valid.
    """
    pad = mask == 0
    new_logprobs = np.where(pad, INVALID_LOGPROB, logprobs)
    mb_logprobs = np.where(pad, INVALID_LOGPROB, old_logprobs)
    mb_advantage = np.where(pad, 0.0, advantages)
    logprobs_diff = new_logprobs - mb_logprobs
    ratio = np.exp(logprobs_diff)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * np.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = _np_masked_mean(np.maximum(pg_losses, pg_losses2), mask)
    pg_clipfrac = _np_masked_mean((pg_losses2 > pg_losses).astype(np.float64), mask)
    approxkl = 0.5 * (logprobs_diff ** 2).mean()
    return pg_loss, pg_clipfrac, approxkl * mask.size / mask.sum()


def _np_ppo_value(vpred, mb_values, mb_return, mask, cliprange_value):
    """TRL PPOTrainer.train:

        vpredclipped = torch.clamp(vpred, mb_values - args.cliprange_value, mb_values + args.cliprange_value)
        vf_losses1 = torch.square(vpred - mb_return)
        vf_losses2 = torch.square(vpredclipped - mb_return)
        vf_loss_max = torch.max(vf_losses1, vf_losses2)
        vf_loss = 0.5 * masked_mean(vf_loss_max, ~padding_mask_p1[micro_batch_inds])
    """
    vpredclipped = np.clip(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_loss_max = np.maximum((vpred - mb_return) ** 2, (vpredclipped - mb_return) ** 2)
    return 0.5 * _np_masked_mean(vf_loss_max, mask)


def _np_group_advantages(rewards, num_generations):
    """TRL 1.13.0 GRPOTrainer._generate_and_score_completions, scale_rewards="group" (nanstd is unbiased):

        mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)   # both repeat_interleave'd
        advantages = rewards - mean_grouped_rewards
        advantages = advantages / (std_rewards + 1e-4)
    """
    grouped = rewards.reshape(-1, num_generations)
    mean = np.repeat(grouped.mean(axis=1), num_generations)
    std = np.repeat(grouped.std(axis=1, ddof=1), num_generations)
    return (rewards - mean) / (std + 1e-4)


# ---- parity -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,kind", CASES)
def test_gae_matches_trl(seed, kind):
    b = _batch(seed, kind)
    gamma, lam = 0.99, 0.95
    advantages, returns = gae(b["rewards"], b["values"], b["mask"], gamma, lam)
    want_adv, want_ret = _np_gae(*_f64(b["rewards"], b["values"], b["mask"]), gamma, lam)
    np.testing.assert_allclose(advantages, want_adv, **TOL)
    np.testing.assert_allclose(returns, want_ret, **TOL)
    jitted = jax.jit(gae, static_argnums=(3, 4))(b["rewards"], b["values"], b["mask"], gamma, lam)
    np.testing.assert_allclose(jitted[0], want_adv, **TOL)


def test_gae_undiscounted_is_reward_to_go():
    """gamma = lam = 1, V = 0: the advantage is the sum of the valid rewards from t on."""
    b = _batch(4, "ragged")
    rewards = np.where(b["mask"] > 0, b["rewards"], 0.0)
    advantages, returns = gae(b["rewards"], np.zeros((B, T), np.float32), b["mask"], 1.0, 1.0)
    to_go = np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]
    np.testing.assert_allclose(advantages, to_go, **TOL)
    np.testing.assert_allclose(returns, to_go, **TOL)


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("seed,kind", CASES)
def test_whiten_matches_trl(seed, kind, shift_mean):
    b = _batch(seed, kind)
    x = np.where(b["mask"] > 0, 3.0 * b["adv"] + 1.5, b["adv"]).astype(np.float32)  # mean and var not 0, 1
    got = np.asarray(whiten(x, b["mask"], shift_mean=shift_mean))
    x64, m64 = _f64(x, b["mask"])
    want = _np_masked_whiten(np.where(m64 > 0, x64, 0.0), m64, shift_mean)
    valid = b["mask"] > 0
    np.testing.assert_allclose(got[valid], want[valid], **TOL)
    assert np.all(got[~valid] == 0)


def test_whiten_single_token_is_finite():
    mask = np.zeros((B, T), np.float32)
    mask[2, 0] = 1
    got = whiten(np.full((B, T), 5.0, np.float32), mask, shift_mean=False)
    np.testing.assert_array_equal(got, mask * 5.0)  # var taken as 0: x - mean = 0, + mean


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("seed,kind", CASES)
def test_kl_penalty_matches_trl(seed, kind, estimator):
    b = _batch(seed, kind)
    got = kl_penalty(b["logp"], b["ref"], estimator)
    np.testing.assert_allclose(got, _np_kl(*_f64(b["logp"], b["ref"]), estimator), **TOL)


@pytest.mark.parametrize("seed,kind", CASES)
def test_ppo_policy_loss_matches_trl(seed, kind):
    b = _batch(seed, kind)
    loss, clip_fraction, approx_kl = ppo_policy_loss(b["logp"], b["old"], b["adv"], b["mask"], clip=0.2)
    want = _np_ppo_policy(*_f64(b["logp"], b["old"], b["adv"], b["mask"]), 0.2)
    assert 0 < want[1] < 1  # the case exercises clipping
    for got, ref in zip((loss, clip_fraction, approx_kl), want):
        assert got.dtype == jnp.float32 and got.shape == ()
        np.testing.assert_allclose(got, ref, **TOL)


@pytest.mark.parametrize("seed,kind", CASES)
def test_ppo_value_loss_matches_trl(seed, kind):
    b = _batch(seed, kind)
    got = ppo_value_loss(b["values"], b["old_values"], b["returns"], b["mask"], clip=0.2)
    want = _np_ppo_value(*_f64(b["values"], b["old_values"], b["returns"], b["mask"]), 0.2)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_group_advantages_matches_trl(group_size):
    rewards = np.random.default_rng(group_size).normal(0, 2, 8 * group_size).astype(np.float32)
    rewards[:group_size] = np.round(rewards[:group_size])  # a group with ties
    got = group_advantages(rewards, group_size)
    np.testing.assert_allclose(got, _np_group_advantages(*_f64(rewards), group_size), **TOL)


def _trl_grpo(b, advantages, beta, loss_type, epsilon_high, max_completion_length):
    """TRL 1.13.0's own FusedLinearGRPOFunction.ppo_loss_fn, token-level importance sampling, in float64.

    ppo_loss_fn is the part of TRL's fused GRPO loss after the log-probs: it takes per_token_logps (the
    policy's log-prob of each chosen token, which forward() computes from hidden states and the lm_head by
    chunk_forward) together with old / ref per-token log-probs, the completion mask, [B] advantages, loss_type,
    beta, epsilon_low / high and max_completion_length. So it is called directly with the very log-probs given
    to jaxllm, no logits needed; full_attention_mask is the same mask (this is the whole batch, one chunk).
    """
    torch = pytest.importorskip("torch")
    grpo = pytest.importorskip("trl.losses.grpo_loss")
    t = {k: torch.from_numpy(np.asarray(b[k], np.float64)) for k in ("logp", "old", "ref", "mask")}
    loss, metrics = grpo.FusedLinearGRPOFunction.ppo_loss_fn(
        per_token_logps=t["logp"], attention_mask=t["mask"], advantages=torch.from_numpy(advantages),
        full_attention_mask=t["mask"], ref_per_token_logps=t["ref"], old_per_token_logps=t["old"],
        epsilon_low=0.2, epsilon_high=epsilon_high, beta=beta, loss_type=loss_type,
        max_completion_length=max_completion_length)
    return loss.item(), [m.item() for m in metrics]


@pytest.mark.parametrize("epsilon_high", [0.2, 0.28])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", GRPO_LOSS_AGGS)
@pytest.mark.parametrize("seed,kind", [(0, "ragged"), (3, "full")])
def test_grpo_loss_matches_trl(seed, kind, loss_type, beta, epsilon_high):
    b = _batch(seed, kind)
    advantages = np.asarray(group_advantages(np.random.default_rng(seed).normal(0, 1, B), 3), np.float64)
    max_len = T + 4  # dr_grpo divides by the configured maximum, which may exceed the padded T
    got = grpo_loss(b["logp"], b["old"], b["ref"], advantages.astype(np.float32), b["mask"], beta=beta,
                    clip=0.2, loss_agg=loss_type, clip_high=epsilon_high, max_completion_length=max_len)
    want, metrics = _trl_grpo(b, advantages, beta, loss_type, epsilon_high, max_len)
    assert got.dtype == jnp.float32 and got.shape == ()
    np.testing.assert_allclose(got, want, **TOL)
    if beta:  # TRL's first metric is the masked mean of its own k3_loss_fn
        np.testing.assert_allclose(np.sum(kl_penalty(b["logp"], b["ref"], "k3") * b["mask"]) / b["mask"].sum(),
                                   metrics[0], **TOL)


def test_grpo_dr_grpo_defaults_to_padded_length():
    b = _batch(1, "ragged")
    adv = np.linspace(-1, 1, B).astype(np.float32)
    args = (b["logp"], b["old"], b["ref"], adv, b["mask"])
    np.testing.assert_allclose(grpo_loss(*args, loss_agg="dr_grpo"),
                               grpo_loss(*args, loss_agg="dr_grpo", max_completion_length=T), rtol=0, atol=0)


# ---- limits and properties --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,kind", CASES)
def test_on_policy_ratio_is_one(seed, kind):
    b = _batch(seed, kind)
    mask, adv = _f64(b["mask"], b["adv"])
    minus_mean_adv = -_np_masked_mean(np.where(mask > 0, adv, 0.0), mask)
    loss, clip_fraction, approx_kl = ppo_policy_loss(b["logp"], b["logp"], b["adv"], b["mask"])
    assert clip_fraction == 0 and approx_kl == 0
    np.testing.assert_allclose(loss, minus_mean_adv, **TOL)
    seq_adv = b["adv"][:, 0]
    want = -np.sum(seq_adv[:, None] * mask) / mask.sum()
    for old in (None, b["logp"]):
        np.testing.assert_allclose(grpo_loss(b["logp"], old, b["logp"], seq_adv, b["mask"]), want, **TOL)


def test_kl_estimators_zero_at_ref_and_k3_nonnegative():
    b = _batch(5, "full")
    for estimator in KL_ESTIMATORS:
        assert np.all(np.asarray(kl_penalty(b["logp"], b["logp"], estimator)) == 0)
    logp = b["logp"].ravel()
    ref = np.concatenate([logp[: len(logp) // 2] + np.float32(1e-4) * np.sign(np.sin(np.arange(len(logp) // 2))),
                          b["ref"].ravel()[len(logp) // 2:] * 5.0])  # near-equal and far-apart pairs
    assert np.all(np.asarray(kl_penalty(logp, ref.astype(np.float32), "k3")) >= 0)
    assert np.all(np.asarray(kl_penalty(logp, ref.astype(np.float32), "k2")) >= 0)


def test_group_advantages_constant_group_is_zero():
    rewards = np.array([2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 0.0, 1.0], np.float32)
    got = np.asarray(group_advantages(rewards, 4))
    assert np.all(got[:4] == 0)
    np.testing.assert_allclose(got[4:].reshape(-1, 4).mean(axis=1), 0.0, atol=1e-7)


def test_argument_errors():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(x, x, "kl")
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(np.zeros(7, np.float32), 2)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(np.zeros(8, np.float32), 1)
    with pytest.raises(ValueError, match="dapo"):
        grpo_loss(x, x, x, np.zeros(2, np.float32), x + 1, loss_agg="luspo")
