"""Proximal policy optimisation with a critic, as an objective: the model is jaxllm.model.actor_critic.ActorCritic,
the policy's LoRA adapters and the critic's own adapters and scalar head over one frozen base, trained together
by the shared step and loop on batches the policy's rollouts make (jaxllm/objectives/rl.py). One optimizer updates
both, on the summed loss (policy loss + ppo.vf_coef x value loss), as TRL's PPOTrainer does with its
policy-and-value wrapper; global-norm clipping covers both.

The critic starts from the policy's base with fresh adapters and a head drawn like the reward model's, so it
costs its adapters and head only: the base is the policy's arrays. With ppo.critic_init=rm:<checkpoint> it starts
as that trained reward model instead: a frozen body of its own, the model's head, and fresh adapters. Under full
fine-tuning (lora.rank=0, rollouts on devices of their own, where the frozen reference lives) policy and critic
are two whole models, every weight trained: the critic a copy of the base with a fresh head, or the reward model.

An iteration: the policy samples one response per prompt; the reference gives its log-probs and the critic its
values (`ppo_values`, the state before each response token); `token_rewards` makes per-token rewards
(-kl_coef * kl_t, the score at the last token, the missing-EOS penalty) and GAE the advantages (whitened) and
returns. kl_coef adapts per iteration toward ppo.target_kl (`adapt_kl_coef`) and travels in the batch source's
state, so a resumed run keeps it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config.fine_tuning import PPOConfig
from jaxllm.config.schema import Config, ConfigError, LoRAConfig, ModelConfig, PipelineConfig, PrecisionConfig
from jaxllm.model.actor_critic import CRITIC_HEAD, VALUE, ActorCritic
from jaxllm.objectives.losses import gae, kl_penalty, ppo_policy_loss, ppo_value_loss
from jaxllm.objectives.pairs import masked_mean
from jaxllm.objectives.rollout import response_stats_and_router
from jaxllm.train.objective import BatchRequest, Objective
from jaxllm.model.head import next_token_loss, with_router_penalty
from jaxllm.objectives.rl import RolloutBatches, response_kl, rl_objective, rl_setup, rows_prompt_len
from jaxllm.model.build import build_model
from jaxllm.model.lora import merge
from jaxllm.parallel.sharding import sharding_tree
from jaxllm.runs.checkpoint import CheckpointError
from jaxllm.runs.loader import load_base, load_checkpoint
from jaxllm.train.step import SKIP_UPDATE


def actor_critic_objective(model: ModelConfig, precision: PrecisionConfig, pipeline: PipelineConfig = PipelineConfig(),
                           lora: LoRAConfig | None = None, rope_scaling=None, sequence_parallel: bool = False,
                           critic_init: str = "", base=None) -> Objective:
    """The model half of PPO: the actor-critic, whose adapters (both) and critic head train; `sequence_parallel`
    as `build_model`. `critic_init` "rm:<checkpoint>" (PPOConfig) starts the critic as that reward model: a
    frozen body of its own and its head, loaded by the objective (`own`, `load_own`). Without adapters (full
    fine-tuning) everything trains: the critic's body of its own is loaded from `base` (the policy's base,
    jaxllm.runs.base_model.Base) with a fresh head, or is the reward model whole."""
    adapters = lora is not None and lora.rank
    model_class = functools.partial(ActorCritic, own_critic_body=bool(critic_init))
    objective = Objective(name="ppo", build_model=functools.partial(build_model, model, precision, pipeline=pipeline,
                                                                     lora=lora, rope_scaling=rope_scaling,
                                                                     model_class=model_class,
                                                                     sequence_parallel=sequence_parallel),
                          loss_fn=next_token_loss,
                          trainable=nnx.Any(nnx.LoRAParam, CRITIC_HEAD) if adapters else nnx.Param)
    if critic_init:
        return dataclasses.replace(objective, own=nnx.All(VALUE, nnx.Not(nnx.LoRAParam)),
                                   load_own=functools.partial(critic_from_reward_model, critic_init[len("rm:"):]))
    if adapters:
        return objective
    return dataclasses.replace(objective, own=nnx.All(VALUE, nnx.Not(CRITIC_HEAD)), fresh=CRITIC_HEAD,
                               load_own=functools.partial(critic_from_base, base))


def critic_from_base(base, abstract, mesh):
    """Full fine-tuning's critic body (`abstract`: its variables, under `value`) loaded from the policy's `base`
    (jaxllm.runs.base_model.Base): the language model's embedding, layers and final norm, a copy of their own."""
    if not jax.tree.leaves(abstract):
        return abstract
    plain = nnx.from_flat_state([(path[1:], v) for path, v in nnx.to_flat_state(abstract)])
    loaded, _ = load_base(base, plain, mesh)
    return nnx.from_flat_state([(("value",) + tuple(path), v) for path, v in nnx.to_flat_state(loaded)])


def critic_from_reward_model(path: str, abstract, mesh):
    """The critic's body and head (`abstract`: their variables, under `value`) from the reward-model run at
    `path`, its adapters merged into its body, placed per the rules on `mesh`; ConfigError (ppo.critic_init)
    when it is not a reward model of the policy's architecture."""
    if not jax.tree.leaves(abstract):
        return abstract
    dtype = jnp.dtype(jax.tree.leaves(abstract)[0].dtype).name
    try:
        loaded = load_checkpoint(path, mesh=mesh, compute=dtype)
    except (CheckpointError, FileNotFoundError) as exc:
        raise ConfigError("ppo.critic_init", str(exc)) from None
    if (loaded.config.get("train") or {}).get("objective") != "reward":
        raise ConfigError("ppo.critic_init", f"{path} is not a reward model (train.objective=reward) checkpoint")
    held = {("value",) + tuple(p): v for p, v in nnx.to_flat_state(nnx.state(merge(loaded.model), nnx.Param))}
    wanted = nnx.to_flat_state(abstract)
    if any(p not in held or held[p].get_value().shape != v.get_value().shape for p, v in wanted):
        raise ConfigError("ppo.critic_init", f"{path} is a reward model of another architecture than the policy's: "
                                             f"the critic takes its body as it is")
    picked = nnx.from_flat_state([(p, held[p]) for p, _ in wanted])
    return jax.device_put(picked, sharding_tree(abstract, mesh))


def ppo_values(model, tokens_BS, segment_ids_BS, positions_BS, prompt_len: int):
    """The critic's value [B, N] (float32) of the state before each response slot: slot P + n - 1's score."""
    return model.value(tokens_BS, segment_ids_BS, positions_BS)[:, prompt_len - 1:-1]


def _masked_var(x, mask):
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def ppo_loss_fn(model, batch, rng=None, *, ppo: PPOConfig):
    """`loss_fn` of PPO on a minibatch of rollout rows (no dropout: see jaxllm/objectives/rl.py): the clipped policy
    loss + vf_coef x the clipped value loss - entropy_coef x the entropy, each a mean over valid tokens."""
    mask = batch["mask"]
    prompt_len = rows_prompt_len(batch)
    layout = batch["tokens"], batch["segment_ids"], batch["positions"]
    logps, entropy_BN, router = response_stats_and_router(model, *layout, prompt_len, ppo.temperature,
                                                          entropy=True)
    values = ppo_values(model, *layout, prompt_len)
    policy_loss, clip_fraction, approx_kl = ppo_policy_loss(logps, batch["old_logps"], batch["advantages"], mask,
                                                            ppo.clip, weights=batch.get("tis_weights"))
    value_loss = ppo_value_loss(values, batch["old_values"], batch["returns"], mask, ppo.value_clip)
    entropy = masked_mean(entropy_BN, mask)
    loss = policy_loss + ppo.vf_coef * value_loss
    if ppo.entropy_coef:
        loss = loss - ppo.entropy_coef * entropy
    count = jnp.sum(mask)
    returns = batch["returns"]
    metrics = {"policy_loss": policy_loss, "value_loss": value_loss, "clip_fraction": clip_fraction,
               "approx_kl": approx_kl, "entropy": jax.lax.stop_gradient(entropy),
               "explained_variance": 1.0 - _masked_var(returns - values, mask) / (_masked_var(returns, mask) + 1e-8),
               "score": jnp.mean(batch["scores"]), "reward": jnp.mean(batch["rewards"]),
               "kl": jnp.mean(batch["kl"]), "kl_coef": jnp.mean(batch["kl_coef"]),
               "response_length": jnp.mean(jnp.sum(mask, axis=1)), "eos_rate": jnp.mean(batch["stopped"])}
    if ppo.max_approx_kl:
        metrics[SKIP_UPDATE] = (approx_kl > ppo.max_approx_kl).astype(jnp.float32)
    loss_sum, router_metrics = with_router_penalty(model, loss * count, count, router)
    return loss_sum, count, {**metrics, **router_metrics}


def token_rewards(scores_B, stopped_B, kl_BN, mask_BN, kl_coef: float, missing_eos_penalty: float = 0.0):
    """Per-token rewards [B, N] (TRL's PPOTrainer): -kl_coef * kl_t on every valid token, plus each row's score
    at its last valid token, less `missing_eos_penalty` where the row did not end at EOS."""
    scores_B = np.where(stopped_B > 0, scores_B, scores_B - missing_eos_penalty)
    rewards = -kl_coef * kl_BN * mask_BN
    last = np.maximum(mask_BN.sum(axis=1).astype(np.int64), 1) - 1
    rewards[np.arange(len(last)), last] += scores_B
    return rewards.astype(np.float32)


def adapt_kl_coef(kl_coef: float, kl: float, target: float, horizon: int, responses: int) -> float:
    """Ziegler et al.'s adaptive KL controller (TRL's AdaptiveKLController.update): the coefficient moves toward
    holding the per-response KL at `target`, by at most 20% of responses/horizon per update."""
    error = float(np.clip(kl / target - 1.0, -0.2, 0.2))
    return kl_coef * (1.0 + error * responses / horizon)


class PPOBatches(RolloutBatches):
    """PPO's iterations: one response per prompt, with the critic's values, per-token rewards, advantages and
    returns; the KL coefficient is state of the source, carried from iteration to iteration."""

    def __init__(self, cfg: Config, request: BatchRequest, sampler, prompts: list[dict]):
        self.ppo = cfg.ppo
        super().__init__(cfg, cfg.ppo, request, sampler, prompts)

    def restore_extra(self, saved: dict) -> None:
        self.kl_coef = float(saved.get("kl_coef", self.ppo.kl_coef))

    def extra_state(self) -> dict:
        return {"kl_coef": self.kl_coef}

    def score(self, rows: dict[str, np.ndarray], variables) -> dict[str, np.ndarray]:
        """Rewards, advantages and returns from the rows' values (the sampler computed them with the reference's
        log-probs: `ppo_values` is its `value_fn`)."""
        p, mask = self.ppo, rows["mask"]
        values = rows.pop("values")
        kl = np.asarray(kl_penalty(rows["old_logps"], rows["ref_logps"], p.kl_estimator)) * mask
        rewards = token_rewards(rows["scores"][:, 0], rows["stopped"][:, 0], kl, mask, self.kl_coef,
                                p.missing_eos_penalty)
        advantages, returns = gae(rewards, values, mask, p.gamma, p.lam)
        response_kls = response_kl(rows)
        rows.update(old_values=values.astype(np.float32),
                    advantages=whiten_over_blocks(np.asarray(advantages, np.float64), mask, self.total),
                    returns=np.asarray(returns, np.float32), rewards=rewards.sum(axis=1, keepdims=True),
                    kl=response_kls[:, None].astype(np.float32),
                    kl_coef=np.full((len(mask), 1), self.kl_coef, np.float32))
        if p.target_kl:  # the next iteration's coefficient, from this one's KL (over every process's rows)
            kl_sum, responses = self.total([response_kls.sum(), len(mask)])
            self.kl_coef = adapt_kl_coef(self.kl_coef, float(kl_sum / responses), p.target_kl, p.kl_horizon,
                                         int(responses))
        return rows


def whiten_over_blocks(x: np.ndarray, mask: np.ndarray, total) -> np.ndarray:
    """jaxllm.objectives.losses.whiten (TRL's masked_whiten) of rows held in blocks by several processes: the
    mean and the unbiased variance over the valid tokens of all blocks, `total(values)` summing over them;
    float32, 0 where masked."""
    count, summed = total([mask.sum(), (x * mask).sum()])
    mean = summed / max(count, 1.0)
    var = total(((x - mean) ** 2 * mask).sum()) / max(count, 1.0) * count / max(count - 1.0, 1.0)
    return ((x - mean) / np.sqrt(var + 1e-8) * mask).astype(np.float32)


def critic_bytes(objective: Objective) -> tuple[int, int]:
    """(bytes of the critic's own variables, bytes of the shared frozen base), from shapes alone."""
    state = jax.eval_shape(lambda: nnx.state(objective.build_model(jax.random.key(0))))
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    critic = state.filter(VALUE)
    base = state.filter(nnx.Not(nnx.Any(nnx.LoRAParam, VALUE)))
    return size(critic), size(base)


def ppo_objective(cfg: Config, log=print) -> Objective:
    """The PPO objective of a resolved `cfg`, reading the prompts first."""
    build = functools.partial(actor_critic_objective, critic_init=cfg.ppo.critic_init)
    setup = rl_setup(cfg, "ppo", log, build_policy=build, value_fn=ppo_values)
    own, base = critic_bytes(setup.policy)
    if not cfg.lora.rank:
        if not cfg.ppo.critic_init:  # the critic's body: a trained copy of the base the rollouts start from
            policy = dataclasses.replace(setup.policy, load_own=functools.partial(critic_from_base, setup.base))
            setup = dataclasses.replace(setup, policy=policy)
        log(f"critic: a model of its own, every weight trained (full fine-tuning), from "
            f"{cfg.ppo.critic_init[len('rm:'):] or 'the base'}: {own / 1e6:.2f} MB beside the policy's "
            f"{base / 1e6:.2f} MB")
    elif cfg.ppo.critic_init:
        log(f"critic: the reward model {cfg.ppo.critic_init[len('rm:'):]} (its frozen body and score head) with LoRA "
            f"adapters of its own: {own / 1e6:.2f} MB beside the policy's base of {base / 1e6:.2f} MB")
    else:
        log(f"critic: LoRA adapters and a value head on the policy's frozen base (shared, no second copy): "
            f"{own / 1e6:.2f} MB of its own, next to the base's {base / 1e6:.2f} MB")

    def open_batches(request: BatchRequest):
        return PPOBatches(cfg, request, setup.sampler, setup.prompts["train"])

    return rl_objective(setup, "ppo", functools.partial(ppo_loss_fn, ppo=cfg.ppo), open_batches,
                             ("score", "kl", "approx_kl", "value_loss"))
