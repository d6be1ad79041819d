"""What PPO's and GRPO's batch sources write into an iteration's rollout rows (`PPOBatches.score`,
`GRPOBatches.score`), against the formulas written out here in numpy: PPO's per-token rewards, GAE with gamma and
lambda in their places, the whitened advantages and the returns; GRPO's advantages normalised within each
prompt's group of responses. The critic is a stand-in that returns fixed values: what is checked is the
bookkeeping around it."""

import numpy as np
import pytest

from jaxllm.config.fine_tuning import PPOConfig
from jaxllm.objectives.grpo import GRPOBatches
from jaxllm.objectives.ppo import PPOBatches

PROMPT, MASK = 4, np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], np.float32)
SETTINGS = PPOConfig(kl_coef=0.05, gamma=0.9, lam=0.7, missing_eos_penalty=0.5, kl_estimator="k1")


def _rollout(rng) -> dict[str, np.ndarray]:
    b, n = MASK.shape
    return dict(tokens=np.zeros((b, PROMPT + n), np.int32), segment_ids=np.ones((b, PROMPT + n), np.int32),
                positions=np.tile(np.arange(PROMPT + n, dtype=np.int32), (b, 1)), mask=MASK.copy(),
                old_logps=(rng.normal(size=MASK.shape) * MASK).astype(np.float32),
                ref_logps=(rng.normal(size=MASK.shape) * MASK).astype(np.float32),
                scores=rng.normal(size=(b, 1)).astype(np.float32), stopped=np.array([[1], [0], [1]], np.float32))


def _expected(rows, values):
    """(per-token rewards, advantages before whitening, returns, whitened advantages), by the book."""
    m, v = MASK, values * MASK
    rewards = -SETTINGS.kl_coef * (rows["old_logps"] - rows["ref_logps"]) * m
    for b, length in enumerate(m.sum(axis=1).astype(int)):
        penalty = 0.0 if rows["stopped"][b, 0] else SETTINGS.missing_eos_penalty
        rewards[b, length - 1] += rows["scores"][b, 0] - penalty
    advantages = np.zeros_like(rewards)
    for b in range(len(m)):
        running = 0.0
        for t in reversed(range(m.shape[1])):
            next_value = v[b, t + 1] if t + 1 < m.shape[1] else 0.0
            delta = rewards[b, t] + SETTINGS.gamma * next_value - v[b, t]
            running = delta + SETTINGS.gamma * SETTINGS.lam * running
            advantages[b, t] = running * m[b, t]
    n = m.sum()
    mean = (advantages * m).sum() / n
    var = (((advantages - mean) * m) ** 2).sum() / (n - 1)
    return rewards, advantages, (advantages + v) * m, (advantages - mean) / np.sqrt(var + 1e-8) * m


def test_ppo_scores_a_rollout_by_the_book():
    rng = np.random.default_rng(0)
    rows, values = _rollout(rng), rng.normal(size=MASK.shape).astype(np.float32)
    source = object.__new__(PPOBatches)  # the scoring alone: no sampler, prompts or model behind it
    source.ppo, source.kl_coef = SETTINGS, SETTINGS.kl_coef
    source.block = (0, 1)  # one process holds every row
    scored = source.score(dict(rows, values=values * MASK), variables=None)  # the sampler's critic values
    rewards, _, returns, whitened = _expected(rows, values)
    np.testing.assert_allclose(scored["old_values"], values * MASK, atol=1e-6)
    np.testing.assert_allclose(scored["rewards"][:, 0], rewards.sum(axis=1), atol=1e-5)
    np.testing.assert_allclose(scored["returns"], returns, atol=1e-5)
    np.testing.assert_allclose(scored["advantages"], whitened, atol=1e-4)
    np.testing.assert_allclose(scored["kl"][:, 0], ((rows["old_logps"] - rows["ref_logps"]) * MASK).sum(axis=1),
                               atol=1e-5)


@pytest.mark.parametrize("group", [2, 4])
def test_grpo_normalises_each_prompt_s_group_of_responses(group):
    scores = np.array([1.0, 0.0, 3.0, 2.0, 5.0, 9.0, 4.0, 4.5], np.float32)
    source = object.__new__(GRPOBatches)
    source.responses_per_prompt = group
    scored = source.score({"scores": scores[:, None]}, variables=None)
    groups = scores.reshape(-1, group)  # a prompt's responses are consecutive rows
    want = (groups - groups.mean(axis=1, keepdims=True)) / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(scored["advantages"][:, 0], want.reshape(-1), atol=1e-5)


def test_each_process_block_holds_whole_groups():
    """GRPO's group statistics stay inside a process: 1 prompt of 8 responses cannot split over 2 processes'
    blocks (a one-line error naming the key), 2 prompts can."""
    from types import SimpleNamespace

    from jaxllm.config.fine_tuning import GRPOConfig
    from jaxllm.config.schema import ConfigError

    source = object.__new__(GRPOBatches)
    source.responses_per_prompt, source.block, source.batch_size, source.rows, source.strata = 8, (0, 2), 8, 8, 4
    source.request = SimpleNamespace(rows=(0, 2))
    with pytest.raises(ConfigError, match="grpo.prompts_per_iteration: 1 prompts do not split over the 2 processes"):
        source._check_blocks(GRPOConfig(prompts_per_iteration=1, num_generations=8))
    source._check_blocks(GRPOConfig(prompts_per_iteration=2, num_generations=8))


def test_the_logp_mismatch_is_zero_on_policy_and_measures_a_gap():
    """`logp_mismatch_mean/max` over valid response tokens only: 0 where the trainer gives back what the sampler
    recorded; a sampler one update behind shows as its gap (here 0.1 on every valid token, 5.0 on masked slots
    that must not count)."""
    rows = _rollout(np.random.default_rng(1))
    source = object.__new__(PPOBatches)
    source.block = (0, 1)
    for offset, want in ((0.0, 0.0), (0.1, 0.1)):
        trainer = rows["old_logps"] + offset * MASK + 5.0 * (1 - MASK)
        got = source._mismatch(trainer, rows)
        np.testing.assert_allclose([got["logp_mismatch_mean"], got["logp_mismatch_max"]], [want, want], atol=1e-6)


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_trainer_side_of_an_iteration(staleness):
    """One step off, the ratio's old log-probs are the trainer's at the iteration's start and the truncated
    importance weights are min(exp(old - recorded), tis_cap) on valid tokens (verl's TIS); on-policy the old
    log-probs stay the recorded ones and the weights use the trainer's recompute of them."""
    rows = _rollout(np.random.default_rng(2))
    recorded = rows["old_logps"]
    sampled = recorded + 0.01 * MASK  # the trainer, with the weights that sampled
    current = recorded + np.array([[0.5], [-0.3], [2.0]], np.float32) * MASK  # the trainer, one update later
    source = object.__new__(GRPOBatches)
    source.block, source.staleness, source.tis_cap, source.timings = (0, 1), staleness, 2.0, {}
    source._trainer_logps = lambda variables, rows: current
    out = source._for_the_trainer(dict(rows), sampled, current=None)
    old = current if staleness else recorded
    np.testing.assert_allclose(out["old_logps"], old * MASK, atol=1e-6)
    proximal = current if staleness else sampled
    want = np.minimum(np.exp(proximal - recorded), 2.0) * MASK
    np.testing.assert_allclose(out["tis_weights"], want, atol=1e-6)
    assert out["tis_weights"].max() <= 2.0 and (staleness == 0 or out["tis_weights"].max() == 2.0)
    np.testing.assert_allclose(source.timings["logp_mismatch_mean"], 0.01, atol=1e-6)
