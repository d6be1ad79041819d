"""Post-training losses: preference (DPO sigmoid / robust / IPO, the Bradley-Terry reward-model loss) and RL
(PPO's GAE, whitening, KL estimators, clipped policy and value losses; GRPO's group advantages and policy loss).

Small pure jax.numpy functions. The preference losses take per-pair quantities and return them per pair and
unreduced, so the caller chooses the reduction (a plain mean reproduces TRL's). Each formula follows TRL 1.13.0;
tests/test_post_losses.py checks them against TRL's own code. The RL functions take [B, T] arrays over response
tokens with a 0/1 mask and reduce with masked means over the valid tokens of the whole batch. PPO follows TRL's
last-published PPOTrainer (PPO left TRL in 2026), GRPO follows TRL 1.13.0; tests/test_rl_losses.py checks them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config.fine_tuning import GRPO_LOSS_AGGS, KL_ESTIMATORS  # the names the config accepts, defined once there
from jaxllm.objectives.pairs import masked_mean

DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo")


def _f32(x):
    # Summed log-probs reach -1e3 and beyond; bf16 differences of such numbers lose every digit that matters.
    return jnp.asarray(x, jnp.float32)


def _per_token(logratios, lengths):
    """Sequence log-ratio divided by its completion length, as TRL's IPO branch does (clamped at 1 token)."""
    return logratios if lengths is None else logratios / jnp.maximum(_f32(lengths), 1.0)


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0, chosen_lengths=None, rejected_lengths=None):
    """Per-pair DPO loss and implicit rewards, in float32.

    Inputs are per pair, shape [P]: each response's log-prob summed over its completion tokens, under the
    policy and under the frozen reference. With d = (pi_c - pi_r) - (ref_c - ref_r) and ls = label_smoothing:

    - "sigmoid": -log sigmoid(beta d) (1 - ls) - log sigmoid(-beta d) ls. At ls = 0 this is TRL 1.13.0's
      sigmoid loss. TRL 1.13.0 ignores label_smoothing for "sigmoid"; here ls > 0 gives conservative DPO
      (cDPO), the formula of TRL's earlier sigmoid branch and of its 1.13.0 "aot" branch.
    - "robust": (-log sigmoid(beta d) (1 - ls) + log sigmoid(-beta d) ls) / (1 - 2 ls), ls in [0, 0.5).
    - "ipo": (delta - 1 / (2 beta))^2, where delta is d with each side's log-ratio divided by its
      completion length (chosen_lengths / rejected_lengths, [P] token counts clamped at 1), as TRL 1.13.0's
      DPOTrainer does; without lengths the summed log-probs are used as given (the unnormalised IPO).
      The lengths are used by "ipo" only.

    Returns (losses, chosen_rewards, rejected_rewards), each [P]. The rewards are beta * (pi - ref) of the
    summed log-probs, gradient stopped, for every loss type: TRL logs them detached and does not
    length-normalise them for IPO.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs label_smoothing in [0, 0.5), got {label_smoothing}")  # 1/(1-2ls)
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("give both chosen_lengths and rejected_lengths, or neither")
    chosen = _f32(policy_chosen_logps) - _f32(ref_chosen_logps)
    rejected = _f32(policy_rejected_logps) - _f32(ref_rejected_logps)
    if loss_type == "ipo":
        delta = _per_token(chosen, chosen_lengths) - _per_token(rejected, rejected_lengths)
        losses = (delta - 1.0 / (2.0 * beta)) ** 2
    else:
        logits = beta * (chosen - rejected)
        clean = -jax.nn.log_sigmoid(logits) * (1.0 - label_smoothing)  # the label as given
        flipped = -jax.nn.log_sigmoid(-logits) * label_smoothing  # the label flipped, with probability ls
        losses = clean + flipped if loss_type == "sigmoid" else (clean - flipped) / (1.0 - 2.0 * label_smoothing)
    rewards = jax.lax.stop_gradient(beta * chosen), jax.lax.stop_gradient(beta * rejected)
    return (losses, *rewards)


def bradley_terry_loss(chosen_rewards, rejected_rewards, margin=None, center_coef=0.0):
    """Per-pair reward-model loss, in float32: -log sigmoid(r_c - r_r - margin) + center_coef (r_c + r_r)^2.

    TRL 1.13.0's RewardTrainer.compute_loss takes the mean of the first term and adds
    center_rewards_coefficient * mean((r_c + r_r)^2); both are plain means over pairs, so the mean of these
    per-pair losses equals TRL's loss. The centring term pulls rewards towards zero mean (TRL's None = 0 here).
    """
    chosen, rejected = _f32(chosen_rewards), _f32(rejected_rewards)
    diff = chosen - rejected if margin is None else chosen - rejected - _f32(margin)
    losses = -jax.nn.log_sigmoid(diff)
    return losses + center_coef * (chosen + rejected) ** 2 if center_coef else losses


def _valid(x, mask):
    """x in float32 with masked positions set to 0: padding may hold anything (TRL fills it with 1.0), even inf,
    and inf * 0 would poison every masked sum."""
    return jnp.where(mask > 0, _f32(x), 0.0)


def gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation over [B, T] response tokens: (advantages, returns), float32.

    delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1}, by a reverse scan over T, with
    returns = A + V. Rewards and values at masked positions are taken as 0, so V = 0 after a row's last valid
    token (the bootstrap there is 0), as TRL's PPOTrainer gets by masked_fill(values / rewards,
    padding_mask_p1, 0) before its loop (trl/trainer/ppo_trainer.py, PPOTrainer.train, last published before
    PPO left TRL in 2026). Advantages and returns at masked positions are returned as 0.
    """
    m = _f32(mask)
    r, v = _valid(rewards, m), _valid(values, m)
    next_v = jnp.concatenate([v[:, 1:], jnp.zeros_like(v[:, :1])], axis=1)
    deltas_TB = (r + gamma * next_v - v).T

    def step(next_advantage, delta):
        advantage = delta + gamma * lam * next_advantage
        return advantage, advantage

    _, advantages_TB = jax.lax.scan(step, jnp.zeros(r.shape[0], jnp.float32), deltas_TB, reverse=True)
    advantages = advantages_TB.T * m
    return advantages, (advantages + v) * m


def whiten(x, mask, shift_mean=True):
    """TRL's masked_whiten (trl/core.py, later trl/trainer/utils.py): (x - mean) rsqrt(var + 1e-8), + mean
    again if not shift_mean, float32.

    mean and var are over the valid tokens of the whole batch, var unbiased (TRL's masked_var: the masked mean
    of (x - mean)^2 times n / (n - 1), n = mask.sum()). TRL raises for n < 2; a jitted function cannot, so here
    n = 1 gives var = 0 (no Bessel factor) and n = 0 gives all zeros. Masked positions are returned as 0.
    """
    m = _f32(mask)
    x = _valid(x, m)
    mean = masked_mean(x, m)
    n = jnp.sum(m)
    var = masked_mean((x - mean) ** 2, m) * n / jnp.maximum(n - 1.0, 1.0)
    whitened = (x - mean) * jax.lax.rsqrt(var + 1e-8)
    return (whitened if shift_mean else whitened + mean) * m


def kl_penalty(logprobs, ref_logprobs, kind):
    """Per-token estimators of KL(policy || ref) for tokens sampled from the policy, [B, T] -> [B, T], float32.

    With d = logprobs - ref_logprobs: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d (>= 0). k1 and k3 are TRL's
    PPOTrainer ones (trl/trainer/ppo_trainer.py, PPOTrainer.train: logr = ref - logp; kl = -logr or
    (logr.exp() - 1) - logr); k3 is also TRL 1.13.0 GRPOTrainer._compute_loss's per_token_kl. No masking.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")
    d = _f32(logprobs) - _f32(ref_logprobs)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d ** 2
    return jnp.expm1(-d) + d  # expm1: exp(-d) - 1 near d = 0 loses every digit to cancellation in float32


def ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip=0.2, weights=None):
    """PPO clipped surrogate: (loss, clip_fraction, approx_kl), float32 scalars.

    ratio = exp(logp - old); pg1 = -A ratio; pg2 = -A clip(ratio, 1 - clip, 1 + clip); loss = masked mean of
    max(pg1, pg2), each token's term times `weights` [B, T] when given (truncated importance weights of the
    behaviour policy: verl's TIS, `pg_losses * tis_imp_ratio`); clip_fraction = masked mean of [pg2 > pg1];
    approx_kl = masked mean of (logp - old)^2 / 2.
    TRL's PPOTrainer.train (trl/trainer/ppo_trainer.py, last published): pg_loss, pg_clipfrac, approxkl. TRL's
    approxkl is a plain mean over all B x T positions (padding holds 0 there); here it is over valid tokens.
    """
    m = _f32(mask)
    diff = _valid(logprobs, m) - _valid(old_logprobs, m)
    a = _valid(advantages, m)
    ratio = jnp.exp(diff)
    pg1 = -a * ratio
    pg2 = -a * jnp.clip(ratio, 1.0 - clip, 1.0 + clip)
    per_token = jnp.maximum(pg1, pg2)
    loss = masked_mean(per_token if weights is None else per_token * _f32(weights), m)
    clip_fraction = masked_mean((pg2 > pg1).astype(jnp.float32), m)
    return loss, clip_fraction, 0.5 * masked_mean(diff ** 2, m)


def ppo_value_loss(values, old_values, returns, mask, clip=0.2):
    """PPO clipped value loss, a float32 scalar: 0.5 masked mean of max((v - R)^2, (v_clipped - R)^2), with
    v_clipped = old + clip(v - old, -clip, clip). TRL's PPOTrainer.train (trl/trainer/ppo_trainer.py, last
    published): vf_loss, with clip = cliprange_value.
    """
    m = _f32(mask)
    v, old, ret = _valid(values, m), _valid(old_values, m), _valid(returns, m)
    clipped = old + jnp.clip(v - old, -clip, clip)
    return 0.5 * masked_mean(jnp.maximum((v - ret) ** 2, (clipped - ret) ** 2), m)


def group_advantages(rewards, group_size, eps=1e-4):
    """GRPO advantages, [N] -> [N] float32: (r - group mean) / (group std + eps), the std unbiased.

    rewards are grouped consecutively, group_size completions per prompt. TRL 1.13.0
    GRPOTrainer._generate_and_score_completions with scale_rewards="group" (its nanstd is unbiased).
    """
    r = _f32(rewards)
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (an unbiased std needs two samples), got {group_size}")
    if r.ndim != 1 or r.shape[0] % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {r.shape}")
    groups = r.reshape(-1, group_size)
    mean = jnp.mean(groups, axis=1, keepdims=True)
    std = jnp.std(groups, axis=1, keepdims=True, ddof=1)
    return ((groups - mean) / (std + eps)).reshape(-1)


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, beta=0.04, clip=0.2, loss_agg="dapo",
              clip_high=None, max_completion_length=None, weights=None):
    """GRPO policy loss, a float32 scalar; TRL 1.13.0 FusedLinearGRPOFunction.ppo_loss_fn
    (trl/losses/grpo_loss.py) and GRPOTrainer._compute_loss, token-level importance sampling.

    Per token: -min(ratio A, clip(ratio, 1 - clip, 1 + clip_high) A) + beta k3(logp, ref), ratio =
    exp(logp - old), A = advantages [B] (or [B, T]), clip_high defaulting to clip. old_logprobs None means
    on-policy (old = logp, gradient stopped); ref_logprobs None means no KL term, as in TRL. Aggregation
    (loss_agg): "dapo" and "bnpo" the token mean over the whole batch (TRL's dapo divides by num_items_in_batch,
    the batch's token count, which is the same when the whole batch is here); "grpo" each sequence's token mean
    (clamped at 1 token), then the mean over sequences; "dr_grpo" the token sum / (B max_completion_length),
    max_completion_length defaulting to T (TRL requires it). `weights` [B, T], when given, multiply each
    token's clipped term (not the KL term): truncated importance weights, as `ppo_policy_loss`'s.
    """
    if loss_agg not in GRPO_LOSS_AGGS:
        raise ValueError(f"unknown GRPO loss_agg {loss_agg!r}; expected one of {GRPO_LOSS_AGGS}")
    m = _f32(mask)
    logp = _valid(logprobs, m)
    old = jax.lax.stop_gradient(logp) if old_logprobs is None else _valid(old_logprobs, m)
    a = _f32(advantages)
    a = a[:, None] if a.ndim == 1 else a
    ratio = jnp.exp(logp - old)
    high = clip if clip_high is None else clip_high
    per_token = -jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - clip, 1.0 + high) * a)
    if weights is not None:
        per_token = per_token * _f32(weights)
    if beta != 0.0 and ref_logprobs is not None:
        per_token = per_token + beta * kl_penalty(logp, _valid(ref_logprobs, m), "k3")
    per_token = per_token * m
    if loss_agg == "grpo":
        return jnp.mean(jnp.sum(per_token, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0))
    if loss_agg == "dr_grpo":
        length = m.shape[1] if max_completion_length is None else max_completion_length
        return jnp.sum(per_token) / (m.shape[0] * length)
    return masked_mean(per_token, m)
