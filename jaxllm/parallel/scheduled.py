"""The explicit forward-backward pipeline: one jitted program that runs a schedule table (1F1B, interleaved 1F1B,
ZB-H1; jaxllm/parallel/schedules.py) over the `stage` mesh axis.

`jaxllm.parallel.pipeline` runs the forward as a scan and lets autodiff reverse it, so every micro-batch's stage
inputs live until the backward starts. Here the backward is written out instead: a `lax.scan` over the table's
ticks inside a `jax.shard_map` manual over `stage` (data, fsdp, tensor stay automatic, as in the GPipe scan),
where each stage runs its tick's operation through `lax.switch`:
  F  the chunk's layers on the micro-batch's input (the first chunk embeds the tokens itself); the output goes to
     the next chunk's stage. The last chunk's F does nothing: its B runs the forward again anyway.
  B  `jax.vjp` of the chunk (the last chunk: of the chunk, the head and the loss, seeded with the loss scale) at
     the kept input, applied to the output gradient that came back from the next chunk; the input gradient goes
     to the previous chunk's stage, the weight gradients add into the carry. With ZB-H1, B takes the input
     gradient only and W, later, the weight gradients (each recomputes the chunk's forward from the kept input).
After each tick two collective permutes move what the stages produced, one stage on (activations) and one stage
back (gradients), and each stage files what it received into the buffer slot the table assigned; a buffer holds
only the values in flight at once (about p micro-batches per stage for 1F1B, against all m for the scan).

Activations are recomputed once per B (and W) from the kept stage input, like the GPipe scan's checkpointed
iterations: the same FLOPs, and the model's remat policy applies inside the chunk. Ticks run in lockstep, so a
tick lasts as long as its slowest stage's operation (a B is about twice an F); the table's bubble counts every
operation as one tick.

The caller supplies the model as three functions (`StageFunctions`) over (trained, frozen) pairs of parameter
trees: the layers' trees stacked [L, ...] (split over `stage` like the stored parameters) and the other
parameters' ("outer": embedding, final norm, head), whole on every stage.

What travels between stages is a message: the activations and, for a mixture of experts, every layer's router
sums so far ([L, b, ...], each chunk filling in its own layers'), so that the last stage's loss adds the
auxiliary losses of the whole stack and their gradients travel back to each chunk's routers with the activations'.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.pipeline import (STAGE, circular_rounds, from_circular, index_leading, num_stages,
                                      to_circular)
from jaxllm.parallel.schedules import BACKWARD, FORWARD, KIND_CODES, WEIGHT, Program, Schedule, program
from jaxllm.parallel.sharding import active_mesh, constrain_to_rest, partial_branch, permutes_hang


class StageFunctions(NamedTuple):
    """The model cut at its layer stack; `outer` and `layers` are (trained, frozen) pairs.

    embed(outer, layers, mb) -> x [b, T, D]: the first chunk's input from micro-batch `mb` (a pytree of [b, ...]);
    chunk(outer, layers, x, mb, c) -> (x, stats): the Lc layers `layers` (leaves [Lc, ...]) of global chunk `c`
      (traced) and their per-layer statistics (leaves [Lc, b, ...], float32: a mixture's router sums) or None;
    tail(outer, layers, x, stats, mb) -> (loss, aux): the loss of the stack's output and of every layer's
      statistics (leaves [L, b, ...], or None), aux a pytree of float32 sums.
    `layers` in embed and tail is only there to build the model; its values are not used.
    """

    embed: Callable
    chunk: Callable
    tail: Callable


def _branch_key(kind: int, first: bool, last: bool, split_weights: bool) -> tuple:
    """Which compiled branch runs an operation; operations with nothing to do share the idle branch."""
    if kind == KIND_CODES[FORWARD]:
        return ("idle",) if last else ("F", first)
    if kind == KIND_CODES[BACKWARD]:
        if split_weights and first:  # the input gradient of the first chunk goes nowhere
            return ("idle",)
        return ("B", first, last)
    if kind == KIND_CODES[WEIGHT]:
        return ("W", first, last)
    return ("idle",)


def _branches(prog: Program, split_weights: bool) -> tuple[list[tuple], jax.Array]:
    """(the distinct branch keys the program uses, idle first; the branch index of every [tick, stage])."""
    keys = [("idle",)]
    index = np.zeros(prog.kind.shape, np.int32)
    for t, s in np.ndindex(*prog.kind.shape):
        key = _branch_key(int(prog.kind[t, s]), bool(prog.first[t, s]), bool(prog.last[t, s]), split_weights)
        if key not in keys:
            keys.append(key)
        index[t, s] = keys.index(key)
    return keys, index


def _vjp(f: Callable, args: dict, diff: tuple[str, ...], cotangent):
    """(f's output, aux, {name: gradient}) of `f(**args) -> (out, aux)`, differentiating the `diff` args only."""
    def of_diff(*values):
        return f(**{**args, **dict(zip(diff, values))})

    out, pullback, aux = jax.vjp(of_diff, *[args[n] for n in diff], has_aux=True)
    return out, aux, dict(zip(diff, pullback(cotangent)))


def _at_rest(chunk_grads):
    """A chunk's weight gradients, in the layout of the weights at rest where collective permutes would hang
    (`permutes_hang`), as XLA:CPU otherwise moved an unrolled chunk's with them (`constrain_to_rest`)."""
    return constrain_to_rest(chunk_grads) if permutes_hang() else chunk_grads


def _varying(tree):
    """`tree`, invariant over `stage`, marked as varying over it."""
    return jax.tree.map(lambda a: jax.lax.pcast(a, STAGE, to="varying"), tree)


def _zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _slot(buffer, i):
    """The message in slot `i` of a buffer of messages (leaves [slots, ...])."""
    return jax.tree.map(lambda b: b[i], buffer)


def _with_chunk_stats(stats_L, chunk_stats, start):
    """Every layer's statistics `stats_L` ([L, ...] leaves) with the chunk's ([Lc, ...]) at layer `start`."""
    return jax.tree.map(lambda a, c: jax.lax.dynamic_update_slice_in_dim(a, c.astype(a.dtype), start, 0), stats_L,
                        chunk_stats)


@dataclasses.dataclass(frozen=True)
class _Stage:
    """One device's view inside the shard_map: the model, its stage index `s` of `p`, its layer chunks
    (trained, frozen) as [r, Lc, ...] in circular order, the outer parameters, the micro-batches and the loss's
    cotangent, all varying over `stage`. Its operations take the carry and (micro-batch, local chunk, activation
    slot, gradient slot) and return the carry with what they sent on and back and their chunk's weight gradients.

    The carry's layer-gradient accumulator is updated after the switch, by every stage alike: a resharding of
    those gradients inside a branch that only some stages take would be a collective over all devices that the
    others never join (XLA:CPU waits for them forever). The outer parameters' gradients (embedding, head) add up
    inside their first/last-chunk branches: outside, every stage would pass over them every tick."""

    fns: StageFunctions
    s: jax.Array
    p: int
    layers_t: Any
    layers_f: Any
    outer_t: Any
    outer_f: Any
    mbs: Any
    seed: jax.Array
    zeros_msg: Any  # (x [b, T, D], stats [L, b, ...] or None), zeros
    zeros_chunk: Any
    chunk_layers: int
    tail_outer_grads: bool  # whether the last chunk's B takes the outer parameters' gradients from the tail

    def weights(self, rep, chunk_t=None):
        trained = index_leading(self.layers_t, rep) if chunk_t is None else chunk_t
        return trained, index_leading(self.layers_f, rep)

    def idle(self, carry, op):
        return carry, (self.zeros_msg, self.zeros_msg, self.zeros_chunk)

    def run_chunk(self, outer, weights, msg, mb, rep):
        """The message out of local chunk `rep` (global chunk rep*p + s) for the message in."""
        x, stats = msg
        c = rep * self.p + self.s
        y, chunk_stats = self.fns.chunk(outer, weights, x, mb, c)
        return y, (None if stats is None else _with_chunk_stats(stats, chunk_stats, c * self.chunk_layers))

    def first_message(self, outer, weights, mb):
        return self.fns.embed(outer, weights, mb), self.zeros_msg[1]

    def forward(self, carry, op, first):
        mb, rep, act, _ = op
        mb, outer, weights = index_leading(self.mbs, mb), (self.outer_t, self.outer_f), self.weights(rep)
        msg = self.first_message(outer, weights, mb) if first else _slot(carry["acts"], act)
        return carry, (self.run_chunk(outer, weights, msg, mb, rep), self.zeros_msg, self.zeros_chunk)

    def backward(self, carry, op, first, last, input_grad, weight_grads):
        """B (input_grad, and weight_grads unless ZB) or ZB's W (weight_grads only) of one operation."""
        mb_index, rep, act, grad = op
        mb = index_leading(self.mbs, mb_index)

        def f(chunk_t, ot, msg):
            outer, weights = (ot, self.outer_f), self.weights(rep, chunk_t)
            msg = self.first_message(outer, weights, mb) if first else msg
            y, stats = self.run_chunk(outer, weights, msg, mb, rep)
            return self.fns.tail(outer, weights, y, stats, mb) if last else ((y, stats), None)

        outer_grads = first or (last and self.tail_outer_grads)
        diff = (("chunk_t",) if weight_grads else ()) + (("ot",) if weight_grads and outer_grads else ())
        diff += ("msg",) if input_grad and not first else ()
        args = dict(chunk_t=index_leading(self.layers_t, rep), ot=self.outer_t,
                    msg=None if first else _slot(carry["acts"], act))
        cotangent = self.seed.astype(jnp.float32) if last else _slot(carry["grads"], grad)
        loss, aux, g = _vjp(f, args, diff, cotangent)
        carry = dict(carry)
        if "ot" in g:
            carry["outer_grads"] = jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), carry["outer_grads"], g["ot"])
        if last and input_grad:  # the loss counts once: in B, which every schedule runs
            carry["loss"] = carry["loss"] + loss
            carry["aux"] = jax.tree.map(jnp.add, carry["aux"], aux)
        chunk_grads = self.zeros_chunk if "chunk_t" not in g else jax.tree.map(
            lambda z, d: d.astype(z.dtype), self.zeros_chunk, _at_rest(g["chunk_t"]))
        return carry, (self.zeros_msg, g.get("msg", self.zeros_msg), chunk_grads)

    def branch(self, key: tuple, split_weights: bool):
        """The operation of a `_branch_key`."""
        if key[0] == "F":
            return functools.partial(self.forward, first=key[1])
        if key[0] in ("B", "W"):
            b = key[0] == "B"
            return functools.partial(self.backward, first=key[1], last=key[2], input_grad=b,
                                     weight_grads=not (b and split_weights))
        return self.idle

    def initial_carry(self, prog: Program) -> dict:
        """Zeroed buffers (activation and gradient slots) and sums (gradients, loss, the tail's aux)."""
        outer, weights, mb0 = (self.outer_t, self.outer_f), self.weights(0), index_leading(self.mbs, 0)
        aux = jax.eval_shape(lambda: self.fns.tail(outer, weights, *self.zeros_msg, mb0)[1])
        slots = lambda n: jax.tree.map(lambda z: jnp.zeros((n,) + z.shape, z.dtype), self.zeros_msg)
        return dict(_varying(dict(acts=slots(prog.act_slots), grads=slots(prog.grad_slots),
                                  outer_grads=_zeros(self.outer_t), loss=jnp.zeros((), jnp.float32),
                                  aux=_zeros(aux))),
                    layer_grads=jax.tree.map(jnp.zeros_like, self.layers_t))  # varies already, like the layers


def _tick(stage: _Stage, branches, carry, row):
    """One tick on one stage: its operation, the weight gradients added, the two collective permutes, and what
    came filed into the slots the table names."""
    p = stage.p
    row = {k: v[stage.s] for k, v in row.items()}
    op = (row["mb"], row["repeat"], row["act"], row["grad"])
    with partial_branch():  # each stage takes its own branch
        carry, (send_act, send_grad, chunk_grads) = jax.lax.switch(row["branch"], branches, carry, op)
    carry = dict(carry)
    carry["layer_grads"] = jax.tree.map(lambda acc, d: acc.at[row["repeat"]].add(d), carry["layer_grads"],
                                        chunk_grads)
    came_act = jax.lax.ppermute(send_act, STAGE, [(i, (i + 1) % p) for i in range(p)])
    came_grad = jax.lax.ppermute(send_grad, STAGE, [(i, (i - 1) % p) for i in range(p)])
    for buffer, slot, came in (("acts", row["file_act"], came_act), ("grads", row["file_grad"], came_grad)):
        at = jnp.maximum(slot, 0)

        def filed(buf, new):
            return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, new, buf[at]), at, 0)

        carry[buffer] = jax.tree.map(filed, carry[buffer], came)
    return carry, None


def scheduled_value_and_grad(fns: StageFunctions, layers: tuple[Any, Any], outer: tuple[Any, Any], mbs: Any,
                             schedule: Schedule, seed: jax.Array, tail_outer_grads: bool = True):
    """((loss summed over micro-batches, aux summed), (gradients of the trained layers [L, ...], of the trained
    outer parameters)) of the model `fns` over the micro-batches `mbs` (leaves [m, b, ...]), run as `schedule`
    on the active mesh's `stage` axis; the loss's cotangent is `seed` (a loss scale, or 1). Without
    `tail_outer_grads` the outer parameters' gradients come only through the embedding, not the tail (a loss
    whose tail another run differentiates already: jaxllm/train/scheduled_grads.py)."""
    mesh = active_mesh()
    p, r = num_stages(mesh), schedule.repeats
    if p != schedule.stages:
        raise ValueError(f"schedule for {schedule.stages} stages on a mesh with {p}")
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    if num_layers % (p * r):
        raise ValueError(f"{num_layers} layers do not split into stages*repeats = {p}*{r} chunks")
    prog = program(schedule)
    keys, branch = _branches(prog, schedule.split_weights)
    table = {k: jnp.asarray(v) for k, v in dict(branch=branch, mb=prog.mb, repeat=prog.repeat, act=prog.act,
                                                grad=prog.grad, file_act=prog.file_act,
                                                file_grad=prog.file_grad).items()}
    lc = num_layers // (p * r)
    rounds = circular_rounds(p, r) if r > 1 else None

    def chunks(w):
        """This device's stored layers [L/p, ...] as its chunks [r, Lc, ...] in the order it runs them."""
        w = w.reshape((r, lc) + w.shape[1:])
        return w if rounds is None else to_circular(w, rounds)

    def per_stage(layers_t, layers_f, outer_t, outer_f, mbs, seed):
        layers_t, layers_f = jax.tree.map(chunks, (layers_t, layers_f))
        # Everything varies over `stage` from here: a gradient of an invariant input would otherwise get an
        # implicit psum over `stage` inside a branch that only some stages take.
        outer_t, outer_f, mbs, seed = _varying((outer_t, outer_f, mbs, seed))
        stage = _Stage(fns, jax.lax.axis_index(STAGE), p, layers_t, layers_f, outer_t, outer_f, mbs, seed,
                       _varying(_zero_message(fns, layers_t, layers_f, outer_t, outer_f, mbs, num_layers)),
                       _varying(jax.tree.map(lambda w: jnp.zeros(w.shape[1:], w.dtype), layers_t)), lc,
                       tail_outer_grads)
        branches = [stage.branch(key, schedule.split_weights) for key in keys]
        carry, _ = jax.lax.scan(functools.partial(_tick, stage, branches), stage.initial_carry(prog), table)
        layer_grads = carry["layer_grads"]
        if rounds is not None:
            layer_grads = jax.tree.map(lambda g: from_circular(g, rounds), layer_grads)
        layer_grads = jax.tree.map(lambda g: g.reshape((r * lc,) + g.shape[2:]), layer_grads)
        return layer_grads, jax.lax.psum((carry["loss"], carry["aux"], carry["outer_grads"]), STAGE)

    (layers_t, layers_f), (outer_t, outer_f) = layers, outer
    layer_grads, (loss, aux, outer_grads) = jax.shard_map(
        per_stage, mesh=mesh, in_specs=(P(STAGE), P(STAGE), P(), P(), P(), P()), out_specs=(P(STAGE), P()),
        axis_names={STAGE},
    )(layers_t, layers_f, outer_t, outer_f, mbs, seed)
    return (loss, aux), (layer_grads, outer_grads)


def _zero_message(fns: StageFunctions, layers_t, layers_f, outer_t, outer_f, mbs, num_layers: int):
    """Zeros shaped as a message: the first chunk's input x and every layer's statistics ([L, ...]) or None."""
    outer, weights, mb = (outer_t, outer_f), (index_leading(layers_t, 0), index_leading(layers_f, 0)), \
        index_leading(mbs, 0)
    x = jax.eval_shape(fns.embed, outer, weights, mb)
    _, chunk_stats = jax.eval_shape(fns.chunk, outer, weights, _varying(jnp.zeros(x.shape, x.dtype)), mb, 0)
    stats = jax.tree.map(lambda a: jnp.zeros((num_layers,) + a.shape[1:], a.dtype), chunk_stats)
    return jnp.zeros(x.shape, x.dtype), stats
