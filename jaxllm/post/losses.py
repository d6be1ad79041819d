"""Preference losses for post-training: DPO (sigmoid / robust / IPO) and the Bradley-Terry reward-model loss.

Small pure jax.numpy functions on per-pair quantities, returned per pair and unreduced, so the caller chooses
the reduction (a plain mean reproduces TRL's). Each formula follows TRL 1.13.0; tests/test_post_losses.py
checks them against TRL's own code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
