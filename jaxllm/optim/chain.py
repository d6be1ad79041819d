"""The optax chain from `OptimConfig`: schedule, global-norm clipping, AdamW / LAMB / Adafactor / Muon, weight-decay
mask.

The learning rate and the clipping threshold are hyperparameters in the optimizer state (`inject_hyperparams`),
not constants of the compiled step: a hot update (jaxllm/train/control.py) changes `clip_norm` between steps
without a recompile, and checkpoints carry it.

Gradient accumulation is not an optax wrapper here: the train step sums micro-batch gradients weighted by
their token counts, so the loss is normalised by the true number of target tokens of the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxllm.config.schema import OptimConfig
from jaxllm.model.moe import RouterBias
from jaxllm.optim.muon import scale_by_muon_and_adam
from jaxllm.optim.veto import scale_by_adam, vetoable


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup, then cosine / constant / warmup-stable-decay; its length is the configured run length,
    never where a run happens to stop, so resumed runs follow the same curve."""
    warmup = min(cfg.warmup_steps, total_steps)
    rest = max(total_steps - warmup, 1)
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warm = optax.linear_schedule(0.0, peak, warmup) if warmup else None
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=cfg.min_lr_ratio)
    else:  # wsd: hold the peak, then decay linearly over the last `decay_fraction` of the run
        decay = max(int(round(rest * cfg.decay_fraction)), 1)
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)], [rest - decay]
        )
    if warm is None:
        return after
    return optax.join_schedules([warm, after], [warmup])


def decay_mask(params):
    """True for parameters that get weight decay: matrices, but not norms (rank <= 1 per layer), embeddings or a
    mixture of experts' routing bias (moved by the train step alone, `jaxllm.model.moe.RouterBias`)."""

    def one(path, var):
        names = var.get_metadata().get("out_sharding") or ()
        is_norm = "norm" in names
        is_embedding = "embed_tokens" in [getattr(k, "key", None) for k in path]
        return var.replace(not (is_norm or is_embedding or isinstance(var, RouterBias)))

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def adafactor(cfg: OptimConfig, learning_rate) -> optax.GradientTransformation:
    """Adafactor with the step sizes AdamW has, so one `optim.lr` means the same for both.

    optax's defaults differ twice: `multiply_by_parameter_scale` makes the step relative to each parameter's RMS
    (about init_std = 0.02 here, so the same lr stepped ~50x less), and its weight decay is added after the
    learning rate, so weight_decay=0.1 would shrink every weight by 10% a step. Here the step is absolute and the
    decay is lr * weight_decay * param, AdamW's decoupled decay. The factored second moments, update clipping
    at RMS 1 and the decay rate 0.8 stay optax's.
    """
    decay = cfg.weight_decay * learning_rate if cfg.weight_decay else None
    return optax.adafactor(learning_rate, multiply_by_parameter_scale=False, weight_decay_rate=decay,
                           weight_decay_mask=decay_mask)


def clip_by_global_norm(max_norm) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` with `max_norm` a traced value, where `max_norm <= 0` disables clipping: one
    compiled step serves every threshold.

    Why not optax's own with a traced threshold: optax scales a clipped gradient as `(t / norm) * max_norm`.
    With its Python-float threshold 1.0 XLA folds the multiply away; a traced threshold keeps it (and an
    unshielded `t / (norm / max_norm)` gets rewritten back into it), which changes the fused kernels of the
    Adam moment updates that consume the clipped gradient and with them the rounding: ULP differences on every
    clipped step, which a 60-step run amplifies into a different model (tests/test_grpo_run.py's rising reward
    fell). Here the two scalars the element-wise kernels need, "keep" and the divisor `norm / max_norm`, come
    through an optimization barrier, so those kernels are optax's `select(keep, t, t / divisor)` and, for the
    default threshold 1.0 (divisor == norm exactly), the train step is bitwise the one with optax's constant
    threshold (tests/test_optim.py). Other thresholds agree to float32 rounding.
    """

    def update_fn(updates, state, params=None):
        del params
        g_norm = optax.tree.norm(updates)
        keep, divisor = jax.lax.optimization_barrier(((g_norm < max_norm) | (max_norm <= 0), g_norm / max_norm))
        clip = lambda t: jax.lax.select(keep, t, t / divisor.astype(t.dtype))
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Clipping followed by the configured optimizer, driven by `learning_rate_schedule`. AdamW and LAMB are
    optax's, built on `jaxllm.optim.veto.scale_by_adam` so that the train step's veto costs no pass over their
    moments (a `VetoableTransformation`); Adafactor is vetoed by the step's select. Muon (`jaxllm.optim.muon`:
    orthogonalised momentum on the hidden kernels, Adam on the rest) takes AdamW's decay and learning rate after
    it, and the step's select too (its momentum is not vetoed in place).

    The returned transformation is wrapped in `optax.inject_hyperparams` so the current learning rate and the
    clipping threshold (`optim.clip_norm`, 0: off) are part of the optimizer state: the rate is read back for
    metrics, the threshold is changed by hot updates (`with_clip_norm`).
    """
    schedule = learning_rate_schedule(cfg, total_steps)

    def build(learning_rate, clip_norm):
        # optax.adamw and optax.lamb, link for link, on the Adam whose moments the train step can veto
        adam = scale_by_adam(cfg.b1, cfg.b2, cfg.eps)
        decay = optax.add_decayed_weights(cfg.weight_decay, decay_mask)
        if cfg.name == "adamw":
            opt = optax.chain(adam, decay, optax.scale_by_learning_rate(learning_rate))
        elif cfg.name == "lamb":
            opt = optax.chain(adam, decay, optax.scale_by_trust_ratio(), optax.scale_by_learning_rate(learning_rate))
        elif cfg.name == "muon":
            muon = scale_by_muon_and_adam(cfg.muon_momentum, cfg.muon_ns_steps, cfg.b1, cfg.b2, cfg.eps)
            opt = optax.chain(muon, decay, optax.scale_by_learning_rate(learning_rate))
        else:
            opt = adafactor(cfg, learning_rate)
        return optax.chain(clip_by_global_norm(clip_norm), opt)

    tx = optax.inject_hyperparams(build)(learning_rate=schedule, clip_norm=cfg.clip_norm)
    return vetoable(tx) if cfg.name in ("adamw", "lamb") else tx


def current_lr(opt_state) -> jax.Array:
    """The learning rate the last update used (from `inject_hyperparams` state)."""
    return opt_state.hyperparams["learning_rate"]


def current_clip_norm(opt_state) -> jax.Array:
    """The global-norm clipping threshold the next update uses (0: off)."""
    # An optimizer state not made by `make_optimizer` (tests' plain optax) has no threshold: no clipping.
    return getattr(opt_state, "hyperparams", {}).get("clip_norm", jnp.zeros((), jnp.float32))


def with_clip_norm(opt_state, clip_norm: jax.Array):
    """`opt_state` with the clipping threshold `clip_norm` (an array placed like the one it replaces)."""
    return opt_state._replace(hyperparams={**opt_state.hyperparams, "clip_norm": clip_norm})


def without_clip_norm(opt_state):
    """`opt_state` as jaxllm laid it out before the threshold moved into it (clipping baked into the step):
    the layout of older checkpoints."""
    return opt_state._replace(hyperparams={k: v for k, v in opt_state.hyperparams.items() if k != "clip_norm"})
