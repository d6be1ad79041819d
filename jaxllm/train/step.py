"""Pure train and eval steps. Each is jitted once, with the train state donated.

A batch is a dict of int32 arrays [B, T]: `tokens`, `targets`, `segment_ids`, `positions`, `loss_mask`.
The loss is the mean cross-entropy over target tokens with `loss_mask == 1`, computed in float32.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.config import AnomalyConfig
from jaxllm.optim import current_lr
from jaxllm.sharding import constrain, logical_to_spec
from jaxllm.train.anomaly import detect, push
from jaxllm.train.state import TrainState

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


def batch_sharding(mesh) -> NamedSharding:
    """Rows of a batch split over the batch axes (data, fsdp); replicated over tensor and stage."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return NamedSharding(mesh, logical_to_spec(("batch", None), None, sizes, kind="activations"))


def process_rows(sharding, global_rows: int) -> tuple[int, int]:
    """(block index, block count): this process needs rows [index * B / count, (index + 1) * B / count) of every
    global batch of `global_rows` rows placed with `sharding`, and loads only those.

    Processes whose devices hold the same rows (the batch is replicated over an axis that crosses hosts, e.g.
    `stage`) get the same block; with `data` across hosts each process gets its own.
    """
    blocks = {idx[0].indices(global_rows)[:2] for idx in sharding.addressable_devices_indices_map((global_rows,)).values()}
    lo, hi = min(a for a, _ in blocks), max(b for _, b in blocks)
    size = hi - lo
    covered = sum(b - a for a, b in blocks)
    if global_rows % size or lo % size or covered < size:
        raise ValueError(f"the batch layout gives process {jax.process_index()} rows {sorted(blocks)} of "
                         f"{global_rows}, not one contiguous block; put fewer hosts on mesh.dcn_fsdp")
    return lo // size, global_rows // size


def cross_entropy_sum(logits_BTV, targets_BT, mask_BT):
    """(sum of token losses, number of counted tokens), in float32.

    The target logit is picked with a one-hot product rather than a gather: with the vocabulary split over
    `tensor`, that is an elementwise product and a sharded reduction, with no gather across devices.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.sum(logits_BTV * jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=jnp.float32), -1)
    mask_BT = mask_BT.astype(jnp.float32)
    return jnp.sum((lse_BT - target_logit_BT) * mask_BT), jnp.sum(mask_BT)


def _loss_sum(graphdef, params, batch):
    model = nnx.merge(graphdef, params)
    logits_BTV = model(batch["tokens"], batch["segment_ids"], batch["positions"])
    return cross_entropy_sum(logits_BTV, batch["targets"], batch["loss_mask"])


def _micro_batches(batch, num_micro: int):
    """[B, ...] -> [A, B/A, ...] taking every A-th row, so each device's rows stay on that device."""

    def split(x):
        x = x.reshape((x.shape[0] // num_micro, num_micro) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def grads_and_loss(graphdef, params, batch, grad_accum: int = 1):
    """(gradients, mean loss, target-token count) of one batch.

    Gradients of the summed token loss are accumulated over `grad_accum` micro-batches and divided once by
    the batch's total target-token count, so accumulation equals one big batch exactly (no per-micro mean).
    """
    micro = _micro_batches(batch, grad_accum)

    def accumulate(carry, mb):
        mb = {k: constrain(v, ("batch", "seq")) for k, v in mb.items()}
        (loss_sum, count), grads = jax.value_and_grad(lambda p: _loss_sum(graphdef, p, mb), has_aux=True)(params)
        acc_grads, acc_loss, acc_count = carry
        return (jax.tree.map(jnp.add, acc_grads, grads), acc_loss + loss_sum, acc_count + count), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grads, loss_sum, count), _ = jax.lax.scan(accumulate, init, micro)
    denom = jnp.maximum(count, 1.0)
    return jax.tree.map(lambda g: g / denom, grads), loss_sum / denom, count


def make_train_step(graphdef, tx: optax.GradientTransformation, grad_accum: int = 1,
                    anomaly: AnomalyConfig = AnomalyConfig(), skip_anomalies: bool = False) -> Callable:
    """`step(state, batch) -> (state, metrics)`: `grads_and_loss`, then one optimizer update scaled by
    `state.lr_scale`. Metrics are device scalars (the loop reads them one step late).

    Every step checks for anomalies (`jaxllm.train.anomaly.detect` against the state's history windows); with
    `skip_anomalies` an anomalous step leaves parameters and optimizer state unchanged, decided inside the
    compiled step (no host round trip), so the step dispatched after it starts from a healthy state.
    """

    def step(state: TrainState, batch):
        grads, loss, count = grads_and_loss(graphdef, state.params, batch, grad_accum)
        # One-shot fault injection for drills: NaN gradients, or a loss spike (x1000, gradients too).
        grads = jax.tree.map(lambda g: jnp.where(state.inject == 1, jnp.nan, g), grads)
        spike_factor = jnp.where(state.inject == 2, 1000.0, 1.0)
        loss = loss * spike_factor
        grads = jax.tree.map(lambda g: g * spike_factor, grads)

        grad_norm = optax.tree.norm(grads)
        flags = detect(loss, grad_norm, state.loss_window, state.grad_window, anomaly)
        is_anomaly = flags["anomaly"]

        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        updates = jax.tree.map(lambda u: u * state.lr_scale, updates)
        params = optax.apply_updates(state.params, updates)
        if skip_anomalies:
            keep_old = lambda new, old: jax.tree.map(lambda n, o: jnp.where(is_anomaly, o, n), new, old)
            params = keep_old(params, state.params)
            opt_state = keep_old(opt_state, state.opt_state)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": current_lr(opt_state) * state.lr_scale,  # the rate this update used
            "target_tokens": count,
            **flags,
        }
        healthy = ~is_anomaly
        new_state = TrainState(
            step=state.step + 1, params=params, opt_state=opt_state, lr_scale=state.lr_scale,
            loss_window=push(state.loss_window, loss, healthy),
            grad_window=push(state.grad_window, grad_norm, healthy),
            inject=jnp.zeros_like(state.inject),
        )
        return new_state, metrics

    return step


def make_eval_step(graphdef) -> Callable:
    """`eval_step(params, batch) -> (loss_sum, token_count)` for token-weighted held-out loss."""

    def eval_step(params, batch):
        batch = {k: constrain(v, ("batch", "seq")) for k, v in batch.items()}
        return _loss_sum(graphdef, params, batch)

    return eval_step


def jit_train_step(step_fn, state_shardings, mesh):
    """Compile-once wrapper: state donated, shardings pinned so every step reuses one executable."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_sharding(mesh)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
    )


def jit_eval_step(eval_fn, param_shardings, mesh):
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(eval_fn, in_shardings=(param_shardings, batch_sharding(mesh)), out_shardings=replicated)
