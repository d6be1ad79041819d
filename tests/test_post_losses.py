"""jaxllm's preference losses against TRL 1.13.0 (torch, CPU): DPO sigmoid / robust through TRL's own
FusedLinearDPOFunction.preference_loss_fn, IPO against a transcription of TRL's DPOTrainer branch (which only
runs inside a full trainer), Bradley-Terry against RewardTrainer's loss formula; plus the beta -> 0 and
equal-reward limits and the argument checks.

Inputs are drawn in float32 and fed to torch as the very same values in float64, so every difference is
jaxllm's float32 arithmetic alone."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.objectives.losses import bradley_terry_loss, dpo_loss

P = 64
# A relative 1e-6 (~8 float32 ulps) on losses and rewards, with 1e-6 absolute for values near zero. The float32
# rounding is in the log-ratios of summed log-probs of size <= 60 (half an ulp: 1.9e-6), scaled by beta <= 0.5
# and by |d log sigmoid| <= 1; measured over 20 seeds: <= 2.3e-7 relative on the mean loss, 1.2e-7 on rewards.
TOL = dict(rtol=1e-6, atol=1e-6)
EPS_X = 2e-5  # float32 error bound on the IPO residual x (see test_ipo_matches_trl_branch)


def _logps(seed):
    """Four [P] float32 arrays of summed log-probs: policy chosen / rejected, reference chosen / rejected."""
    return tuple(-np.random.default_rng(seed).uniform(5, 60, size=(4, P)).astype(np.float32))


def _t64(*arrays):
    torch = pytest.importorskip("torch")
    return [torch.from_numpy(np.asarray(a, np.float64)) for a in arrays]


def _trl_dpo(pc, pr, rc, rr, **kw):
    """TRL's own DPO loss on one chunk (reduced: a sum over pairs divided by the number of pairs) and rewards."""
    torch = pytest.importorskip("torch")
    FusedLinearDPOFunction = pytest.importorskip("trl.losses.dpo_loss").FusedLinearDPOFunction
    full_target = torch.zeros(2 * P, 1)  # only its shape[0] // 2 = n_pairs is read
    loss, cr, rj = FusedLinearDPOFunction.preference_loss_fn(*_t64(pc, pr), full_target, *_t64(rc, rr), **kw)
    return loss.item(), cr.numpy(), rj.numpy()


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("loss_type,ls", [("sigmoid", 0.0), ("robust", 0.0), ("robust", 0.1), ("robust", 0.3)])
def test_dpo_matches_trl(loss_type, ls, beta):
    """Mean loss and the per-pair rewards equal TRL's FusedLinearDPOFunction.preference_loss_fn."""
    logps = _logps(1)
    losses, cr, rj = dpo_loss(*logps, beta=beta, loss_type=loss_type, label_smoothing=ls)
    ref_loss, ref_cr, ref_rj = _trl_dpo(*logps, beta=beta, loss_type=loss_type, label_smoothing=ls)
    assert losses.shape == cr.shape == rj.shape == (P,) and losses.dtype == jnp.float32
    np.testing.assert_allclose(float(losses.mean()), ref_loss, **TOL)
    np.testing.assert_allclose(np.asarray(cr), ref_cr, **TOL)
    np.testing.assert_allclose(np.asarray(rj), ref_rj, **TOL)
    np.testing.assert_allclose([float(cr.mean()), float(rj.mean())], [ref_cr.mean(), ref_rj.mean()], **TOL)


@pytest.mark.parametrize("ls", [0.1, 0.25])
def test_dpo_sigmoid_label_smoothing_is_cdpo(ls):
    """TRL 1.13.0's sigmoid ignores label_smoothing, so the smoothed (cDPO) sigmoid is checked through TRL's
    unsmoothed one: (1 - ls) * L(chosen, rejected) + ls * L(rejected, chosen), the labels flipped with
    probability ls."""
    pc, pr, rc, rr = _logps(2)
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=ls)
    kept = _trl_dpo(pc, pr, rc, rr, beta=0.1)[0]
    assert _trl_dpo(pc, pr, rc, rr, beta=0.1, label_smoothing=ls)[0] == kept  # TRL: no smoothing for "sigmoid"
    flipped = _trl_dpo(pr, pc, rr, rc, beta=0.1)[0]
    np.testing.assert_allclose(float(losses.mean()), (1 - ls) * kept + ls * flipped, **TOL)


def _trl_ipo(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, completion_mask, beta):
    """TRL 1.13.0, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss, transcribed (it needs a whole trainer):
    lines 1435-1436 (log-ratios), 1438-1440 (the default reverse_kl scores), 1478-1489 (the "ipo" branch),
    1672-1673 (the logged rewards: the summed log-ratios, not length-normalised). completion_mask is the
    trainer's [chosen; rejected] stack, [2P, T]."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores = chosen_logratios
    rejected_scores = rejected_logratios
    chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
    chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
    rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
    ipo_delta = chosen_avg_score - rejected_avg_score
    per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return per_sequence_loss.numpy(), chosen_rewards.numpy(), rejected_rewards.numpy()


@pytest.mark.parametrize("with_lengths", [True, False])
def test_ipo_matches_trl_branch(with_lengths):
    """Per-pair IPO losses and rewards equal TRL's branch; without lengths, TRL's branch on a one-token mask
    (every length 1, so the summed log-probs are used as given). Lengths include 0 (clamped to 1 by both)."""
    torch = pytest.importorskip("torch")
    logps = _logps(3)
    T = 40
    lengths = np.random.default_rng(4).integers(0, T + 1, size=(2, P)) if with_lengths else np.ones((2, P), int)
    lengths[:, :2] = 0 if with_lengths else 1
    mask = torch.from_numpy((np.arange(T) < np.concatenate(lengths)[:, None]).astype(np.float64))
    for beta in (0.1, 0.5):
        kw = dict(chosen_lengths=lengths[0], rejected_lengths=lengths[1]) if with_lengths else {}
        loss, *rewards = dpo_loss(*logps, beta=beta, loss_type="ipo", **kw)
        want, *want_rewards = _trl_ipo(*_t64(*logps), mask, beta)
        err = np.abs(np.asarray(loss) - want)
        # The loss is x^2 with x = delta - 1/(2 beta), |x| <= ~115, so the tolerance is one on x: its float32
        # rounding (two log-ratios, a division, two subtractions, each <= half an ulp of 128 = 3.8e-6: <= 1.9e-5
        # in all; measured <= 7.4e-6 over 20 seeds) becomes 2|x| EPS_X in x^2. A relative tolerance on x^2
        # itself would be ill-conditioned near its minimum x = 0.
        bound = 2 * np.sqrt(want) * EPS_X + EPS_X**2 + TOL["rtol"] * want
        assert np.all(err <= bound), np.max(err - bound)
        for g, w in zip(rewards, want_rewards, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, **TOL)


@pytest.mark.parametrize("margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_bradley_terry_matches_trl(margin, center):
    """The mean per-pair loss equals TRL 1.13.0's RewardTrainer.compute_loss formula
    (trl/trainer/reward_trainer.py lines 760-766), computed with torch in float64."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    rc, rr, m = rng.normal(0.5, 2.0, size=(3, P)).astype(np.float32)
    m = np.abs(m) if margin else None
    rewards_chosen, rewards_rejected = _t64(rc, rr)
    if margin:
        loss = -torch.nn.functional.logsigmoid(rewards_chosen - rewards_rejected - _t64(m)[0]).mean()
    else:
        loss = -torch.nn.functional.logsigmoid(rewards_chosen - rewards_rejected).mean()
    if center is not None:
        loss += center * torch.mean((rewards_chosen + rewards_rejected) ** 2)
    got = bradley_terry_loss(rc, rr, margin=m, center_coef=center or 0.0)
    assert got.shape == (P,) and got.dtype == jnp.float32
    np.testing.assert_allclose(float(got.mean()), loss.item(), **TOL)


def test_dpo_beta_to_zero():
    """At beta -> 0 the sigmoid loss is log 2 per pair and, as sigmoid(0) = 1/2, the gradient of its mean is
    -beta / (2P) per chosen log-prob and +beta / (2P) per rejected one: tiny, proportional to beta."""
    beta = 1e-8
    logps = [jnp.asarray(a) for a in _logps(6)]

    def mean_loss(pc, pr):
        return dpo_loss(pc, pr, *logps[2:], beta=beta)[0].mean()

    np.testing.assert_allclose(float(mean_loss(*logps[:2])), math.log(2), rtol=0, atol=1e-6)
    g_c, g_r = jax.jit(jax.grad(mean_loss, argnums=(0, 1)))(*logps[:2])
    # beta * |d| <= ~1e-6, so sigmoid(-beta d) = 1/2 to ~3e-7 relative
    np.testing.assert_allclose(np.asarray(g_c), np.full(P, -beta / 2 / P), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_r), np.full(P, beta / 2 / P), rtol=1e-5)


def test_bradley_terry_equal_rewards():
    """All-equal rewards: log 2 per pair; the gradient of each pair's loss is -1/2 for chosen, +1/2 for rejected."""
    r = jnp.full((P,), 1.7)
    np.testing.assert_allclose(np.asarray(bradley_terry_loss(r, r)), np.full(P, math.log(2)), rtol=1e-7)
    g_c, g_r = jax.jit(jax.grad(lambda c, j: bradley_terry_loss(c, j).sum(), argnums=(0, 1)))(r, r)
    np.testing.assert_allclose(np.asarray(g_c), np.full(P, -0.5), rtol=1e-7)
    np.testing.assert_allclose(np.asarray(g_r), np.full(P, 0.5), rtol=1e-7)


def test_dpo_rewards_carry_no_gradient():
    """The rewards are detached, as in TRL: their gradient is zero."""
    logps = [jnp.asarray(a) for a in _logps(7)]
    g = jax.grad(lambda pc: sum(r.sum() for r in dpo_loss(pc, *logps[1:])[1:]))(logps[0])
    assert not np.any(np.asarray(g))


def test_dpo_argument_errors():
    logps = _logps(8)
    with pytest.raises(ValueError, match=r"'sigmoid', 'robust', 'ipo'"):
        dpo_loss(*logps, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*logps, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="both"):
        dpo_loss(*logps, loss_type="ipo", chosen_lengths=np.ones(P))
