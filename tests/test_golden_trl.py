"""Torch-free twins of the TRL checks of tests/test_post_losses.py and test_rl_losses.py, on the checked-in
reference of TRL 1.13.0 (tests/golden/reference/trl/, see tests/golden/make_reference_outputs.py): DPO / robust
DPO through FusedLinearDPOFunction.preference_loss_fn, cDPO through its unsmoothed loss, IPO and Bradley-Terry
through transcriptions of DPOTrainer's and RewardTrainer's code, GRPO through FusedLinearGRPOFunction.ppo_loss_fn.
The reference is float64 on the very float32 inputs given to jaxllm. Part of the smoke run (Python 3.12 with
current JAX, no torch there)."""

import numpy as np
import pytest

from golden_reference import REFERENCE, arrays, trl_cases
from jaxllm.config.fine_tuning import GRPO_LOSS_AGGS
from jaxllm.objectives.losses import bradley_terry_loss, dpo_loss, grpo_loss, kl_penalty

pytestmark = pytest.mark.smoke
# As tests/test_post_losses.py and test_rl_losses.py: a relative 1e-6 (~8 float32 ulps), 1e-6 absolute near zero.
TOL = dict(rtol=1e-6, atol=1e-6)
EPS_X = 2e-5  # float32 error bound on the IPO residual x, as tests/test_post_losses.py
REF = arrays(REFERENCE / "trl")
CASES = trl_cases()


def _cases(loss):
    return [pytest.param(c, id=c["name"]) for c in CASES if c["loss"] == loss]


def _ref(case):
    return {k.removeprefix(case["name"] + "."): v for k, v in REF.items() if k.startswith(case["name"] + ".")}


@pytest.mark.parametrize("case", _cases("dpo"))
def test_dpo_matches_trl(case):
    ref = _ref(case)
    losses, chosen, rejected = dpo_loss(*REF["logps"], **case["kwargs"])
    np.testing.assert_allclose(float(losses.mean()), ref["loss"], **TOL)
    np.testing.assert_allclose(np.asarray(chosen), ref["chosen_rewards"], **TOL)
    np.testing.assert_allclose(np.asarray(rejected), ref["rejected_rewards"], **TOL)


@pytest.mark.parametrize("case", _cases("dpo_flipped"))
@pytest.mark.parametrize("ls", [0.1, 0.25])
def test_dpo_sigmoid_label_smoothing_is_cdpo(case, ls):
    """Smoothed sigmoid DPO = (1 - ls) TRL(chosen, rejected) + ls TRL(rejected, chosen), TRL 1.13.0's sigmoid
    ignoring label_smoothing (see tests/test_post_losses.py)."""
    beta = case["kwargs"]["beta"]
    kept = _ref(next(c for c in CASES if c["kwargs"] == dict(beta=beta, loss_type="sigmoid", label_smoothing=0.0)))
    losses, _, _ = dpo_loss(*REF["logps"], beta=beta, label_smoothing=ls)
    np.testing.assert_allclose(float(losses.mean()), (1 - ls) * kept["loss"] + ls * _ref(case)["loss"], **TOL)


@pytest.mark.parametrize("case", _cases("ipo"))
def test_ipo_matches_trl_branch(case):
    """Per-pair IPO losses within a tolerance on the residual x of the loss x^2 (see tests/test_post_losses.py),
    rewards within TOL; without lengths TRL's branch ran on a one-token mask."""
    ref, beta = _ref(case), case["kwargs"]["beta"]
    lengths = REF["ipo_lengths"]
    kw = dict(chosen_lengths=lengths[0], rejected_lengths=lengths[1]) if case["kwargs"]["with_lengths"] else {}
    loss, chosen, rejected = dpo_loss(*REF["logps"], beta=beta, loss_type="ipo", **kw)
    want = ref["losses"]
    bound = 2 * np.sqrt(want) * EPS_X + EPS_X**2 + TOL["rtol"] * want
    assert np.all(np.abs(np.asarray(loss) - want) <= bound)
    np.testing.assert_allclose(np.asarray(chosen), ref["chosen_rewards"], **TOL)
    np.testing.assert_allclose(np.asarray(rejected), ref["rejected_rewards"], **TOL)


@pytest.mark.parametrize("case", _cases("bradley_terry"))
def test_bradley_terry_matches_trl(case):
    chosen, rejected, margin = REF["rewards"]
    kw = case["kwargs"]
    got = bradley_terry_loss(chosen, rejected, margin=margin if kw["margin"] else None,
                             center_coef=kw["center_coef"] or 0.0)
    np.testing.assert_allclose(float(got.mean()), _ref(case)["loss"], **TOL)


@pytest.mark.parametrize("case", _cases("grpo"))
def test_grpo_loss_matches_trl(case):
    """The loss and, with a KL term, TRL's first metric (the masked mean of its k3 KL)."""
    ref, kw = _ref(case), case["kwargs"]
    b = {k.removeprefix(case["data"] + "."): v for k, v in REF.items() if k.startswith(case["data"] + ".")}
    got = grpo_loss(b["logp"], b["old"], b["ref"], b["advantages"], b["mask"], beta=kw["beta"], clip=0.2,
                    loss_agg=kw["loss_type"], clip_high=kw["epsilon_high"],
                    max_completion_length=kw["max_completion_length"])
    np.testing.assert_allclose(got, ref["loss"], **TOL)
    assert ("kl" in ref) == bool(kw["beta"])
    if kw["beta"]:
        kl = np.sum(kl_penalty(b["logp"], b["ref"], "k3") * b["mask"]) / b["mask"].sum()
        np.testing.assert_allclose(kl, ref["kl"], **TOL)


def test_reference_covers_every_grpo_aggregation():
    assert {c["kwargs"]["loss_type"] for c in CASES if c["loss"] == "grpo"} == set(GRPO_LOSS_AGGS)
