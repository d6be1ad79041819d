"""Expert parallelism: a mixture-of-experts layer run per device inside one `jax.shard_map`, its experts split over
the `expert` mesh axis and its tokens routed on the device that holds them.

Outside the expert layers the batch is split over (data, fsdp, expert) (jaxllm/parallel/sharding.RULES), so every
device holds its own rows and routes them itself: no sort or gather ever spans the whole batch. Inside, each device
of an expert group (the devices along `expert`) holds E / expert of the experts, and tokens must reach the device
of each expert they picked. The exchange here works on every backend, XLA:CPU included, where
`jax.lax.ragged_all_to_all` is not implemented: the group all-gathers its rows (and their routing), each device
runs its own experts over the whole group's picks of them, and a reduce-scatter adds the partial outputs up and
hands each device back its own rows. Nothing is dropped and nothing depends on how rows were split, so the results
equal those of expert = 1. The price is moving every row to every device of the group (expert - 1 times a row's
bytes each way) where an all-to-all would move only the picks.

The ragged exchange (`model.moe_exchange`: "ragged"; "auto" takes it where the backend implements
`jax.lax.ragged_all_to_all` and the expert groups span hosts: jaxllm.config.schema.resolve_moe_exchange) moves only
the picks: each device sorts its (token, expert) pairs by expert, sends each device of the group the rows of the
pairs whose experts it holds (one ragged all-to-all, sizes agreed by an all-gather of the per-expert counts), the
receiver groups what it got by expert for its grouped matmuls, and a second ragged all-to-all brings the outputs
back to the pairs' devices, which weight and add them. Dropless dispatch only (capacity dispatch's buffers are
per row and stay with the gather). With a top k of E experts over `expert` devices a token reaches about
expert * (1 - (1 - 1/expert)^k) of them, not all: Qwen3-MoE's top 8 of 128 on 8 devices moves about 1/1.5 of the
gather's bytes, Mixtral's top 2 of 8 about 1/4. The receiving buffer holds the worst case (every pick of the
group on one device), as large as the gather's dispatch. XLA:CPU does not implement the op; there
`ragged_all_to_all` below computes the same result from an all-gather (as many bytes as the gather exchange, and
more work: for checking the bookkeeping on CPU, which the tests do).

The experts' hidden units split over `tensor` as a dense MLP's do (the down projection's partial sums are added over
`tensor` with the reduce-scatter), and fsdp's split of the model dimension is gathered at the shard_map's edge, just
before use, as for any layer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.context import CONTEXT
from jaxllm.parallel.sharding import active_mesh, constrain, logical_to_spec, mesh_sizes, permutes_hang

EXPERT, TENSOR = "expert", "tensor"


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name: str):
    """`jax.lax.ragged_all_to_all` (its arguments and result), and on XLA:CPU, which does not implement it, the same
    result from an all-gather of every device's operand and offsets: each row of `output` that a sender's slice
    covers takes that slice's row."""
    if jax.default_backend() != "cpu":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis_name)
    me = jax.lax.axis_index(axis_name)
    operands_S = jax.lax.all_gather(operand, axis_name)  # [senders, N, ...]
    starts_S, sizes_S, at_S = (jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes,
                                                                                  output_offsets))
    row_M = jnp.arange(output.shape[0])
    covered_SM = (row_M >= at_S[:, None]) & (row_M < (at_S + sizes_S)[:, None])
    source_SM = jnp.arange(len(starts_S))[:, None] * operand.shape[0] + starts_S[:, None] + row_M - at_S[:, None]
    source_M = jnp.sum(jnp.where(covered_SM, source_SM, 0), axis=0)  # the slices never overlap: one term at most
    taken = operands_S.reshape(-1, *operand.shape[1:])[source_M]
    covered = jnp.any(covered_SM, axis=0).reshape(-1, *(1,) * (operand.ndim - 1))
    return jnp.where(covered, taken, output)


class Dispatched(NamedTuple):
    """A device's side of the ragged exchange (`ExpertGroup.send_to_experts`): `rows` [expert * P, D] the group's
    picks of this device's experts grouped by expert (`group_sizes` [E_local] of them, the rest padding), and how
    to send their outputs back."""

    rows: jax.Array
    group_sizes: jax.Array
    sent_order: jax.Array  # [P]: this device's pairs in the order they were sent (by expert)
    grouping: jax.Array  # [expert * P]: the received row each grouped row is
    pairs_SD: jax.Array  # [sender, destination]: picks sent


def _exclusive_cumsum(sizes):
    return jnp.cumsum(sizes) - sizes


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
    """The collectives of one device's expert group, inside the shard_map (axis names None: that axis is not split,
    e.g. outside any mesh)."""

    expert_axis: str | None = None
    tensor_axis: str | None = None
    rows_split: bool = True  # False: the rows are whole on every device of the group (too few to split)
    seq_axis: str | None = None  # the axis the rows' sequence is split over (context parallelism), if any
    ragged: bool = False  # exchange the picks by ragged all-to-all (`send_to_experts`) instead of `gather`
    # The axes the batch's rows are split over besides `expert` (other devices hold other rows for the same
    # experts): a quantised weight gradient's scales take their max over them (jaxllm.model.quant).
    row_axes: tuple[str, ...] = ()

    def row_total(self, sums):
        """Per-row sums over this device's part of the sequence -> over the whole row."""
        return sums if self.seq_axis is None else jax.lax.psum(sums, self.seq_axis)

    def first_expert(self, local_experts: int):
        """The index of this device's first expert."""
        return 0 if self.expert_axis is None else jax.lax.axis_index(self.expert_axis) * local_experts

    def gather(self, rows):
        """The group's rows [expert * B, ...] from this device's [B, ...], in device order."""
        if self.expert_axis is None or not self.rows_split:
            return rows
        return jax.lax.all_gather(rows, self.expert_axis, axis=0, tiled=True)

    def tensor_total(self, partial):
        """The sum of the experts' partial outputs over their hidden units' split (`tensor`)."""
        return partial if self.tensor_axis is None else jax.lax.psum(partial, self.tensor_axis)

    def combine(self, partial):
        """This device's rows of the sum over the group's (and tensor's) partial outputs: `gather` backwards."""
        partial = self.tensor_total(partial)
        if self.expert_axis is None:
            return partial
        if not self.rows_split:
            return jax.lax.psum(partial, self.expert_axis)
        return jax.lax.psum_scatter(partial, self.expert_axis, scatter_dimension=0, tiled=True)

    def send_to_experts(self, x_TD, experts_TK, num_experts: int) -> Dispatched:
        """The ragged exchange's way out (`ragged` groups only): each of this device's T tokens' K picks [T, K]
        sent, as its row of `x_TD`, to the device of the group that holds its expert."""
        axis, (T, K), D = self.expert_axis, experts_TK.shape, x_TD.shape[1]
        n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
        experts_P = experts_TK.reshape(T * K)
        sent_order = jnp.argsort(experts_P, stable=True)  # by expert, so each device's picks are one slice
        counts_E = jnp.bincount(experts_P, length=num_experts).astype(jnp.int32)
        local_experts = num_experts // n
        counts_SDE = jax.lax.all_gather(counts_E, axis).reshape(n, n, local_experts)
        pairs_SD = counts_SDE.sum(-1)
        earlier_senders = jnp.arange(n)[:, None] < me
        received = ragged_all_to_all(
            x_TD[sent_order // K], jnp.zeros((n * T * K, D), x_TD.dtype), _exclusive_cumsum(pairs_SD[me]),
            pairs_SD[me], jnp.sum(jnp.where(earlier_senders, pairs_SD, 0), axis=0), pairs_SD[:, me], axis)
        # Received: each sender's picks in turn, by expert within each; the segment of a row names its expert.
        ends = jnp.cumsum(counts_SDE[:, me].reshape(-1))
        segment_R = jnp.searchsorted(ends, jnp.arange(n * T * K), side="right")
        expert_R = jnp.where(segment_R < ends.shape[0], segment_R % local_experts, local_experts)
        grouping = jnp.argsort(expert_R, stable=True)
        return Dispatched(received[grouping], counts_SDE[:, me].sum(0), sent_order, grouping, pairs_SD)

    def send_back(self, out_RD, sent: Dispatched):
        """The ragged exchange's way back: the outputs of the grouped rows `out_RD` [expert * P, D] returned to
        their pairs' devices, this device's own pairs' outputs [P, D] in pair order (token t's k-th pick: t K + k)."""
        axis, P = self.expert_axis, sent.sent_order.shape[0]
        n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
        pairs_SD = sent.pairs_SD
        received_RD = out_RD[jnp.argsort(sent.grouping)]
        earlier_destinations = jnp.arange(n)[None, :] < me
        back_PD = ragged_all_to_all(
            received_RD, jnp.zeros((P, out_RD.shape[1]), out_RD.dtype), _exclusive_cumsum(pairs_SD[:, me]),
            pairs_SD[:, me], jnp.sum(jnp.where(earlier_destinations, pairs_SD, 0), axis=1), pairs_SD[me], axis)
        return back_PD[jnp.argsort(sent.sent_order)]


def _axes(spec: P) -> set[str]:
    return {axis for entry in spec if entry for axis in ((entry,) if isinstance(entry, str) else entry)}


def _on_split_sequence(layer: Callable, x_BTD, router, gate_EDF, up_EDF, down_EFD, split_seq: bool):
    """`layer` where the sequence is split over `context` by hand (ring attention inside the pipeline,
    `jaxllm.parallel.pipeline.pipeline(seq_split=True)`): with `split_seq` each device routes its own positions and
    the per-row stats add up over `context`; else (capacity dispatch, whose buffers are per whole row) the row is
    gathered, routed whole on every device, and each keeps its own positions' outputs."""
    if split_seq:
        group = ExpertGroup(seq_axis=CONTEXT, row_axes=(CONTEXT,))
        return layer(x_BTD, router, gate_EDF, up_EDF, down_EFD, group)
    T = x_BTD.shape[1]
    whole_BTD = jax.lax.all_gather(x_BTD, CONTEXT, axis=1, tiled=True)
    out_BTD, stats = layer(whole_BTD, router, gate_EDF, up_EDF, down_EFD, ExpertGroup())
    # Every device computed the same whole-row stats; jax types an all-gather's result as varying over the axis,
    # so one mean over it (of equal values) makes them invariant, as the pipeline's per-row stats must be.
    stats = jax.tree.map(lambda a: jax.lax.pmean(a, CONTEXT), stats)
    return jax.lax.dynamic_slice_in_dim(out_BTD, jax.lax.axis_index(CONTEXT) * T, T, axis=1), stats


def run_experts(layer: Callable, x_BTD, router, gate_EDF, up_EDF, down_EFD, split_seq: bool = True,
                exchange: str = "gather"):
    """`layer(x_BTD, router, gate_EDF, up_EDF, down_EFD, group) -> (out_BTD, per-row stats)` on every device of
    the active mesh with its rows and its experts (`ExpertGroup` says which); called as is outside any mesh.
    `router` is any tree of arrays (the router's kernel, its bias), whole on every device. With `split_seq` the
    rows' sequence stays split over `context` as outside (each device routes its own positions; the layer adds
    its per-row stats over the sequence with `group.row_total`), else it is gathered (capacity dispatch: its
    buffers are per whole row). `exchange` (`model.moe_exchange` as resolved: "auto" is "gather" here; "gather"
    for capacity dispatch) says how the picks reach their experts where the rows are split over `expert`
    (`ExpertGroup.ragged`).

    Manual over every mesh axis not already manual (inside the pipeline, `stage` is): rows over the batch axes,
    experts over `expert`, their hidden units over `tensor`; the router whole on every device."""
    mesh = active_mesh()
    if mesh is None or mesh.manual_axes:
        # Inside the pipeline's shard_map (manual over `stage`) the layer runs on the stage's whole micro-batch,
        # laid out by XLA: autodiff of a shard_map nested in another gives its residuals output shardings over
        # the outer manual axes too, and the program fails to verify ("operand shape, corresponding sharding,
        # and region operand shape ... must match"; jax 0.10 and 0.12, jax-ml/jax#26588). Same results; the
        # experts are gathered there rather than reached by an exchange.
        # The stage's rows are whole on each of its devices there: with both fsdp and tensor above 1, XLA's SPMD
        # partitioner aborts on capacity dispatch's scatter when they are split (jax 0.10, CPU). Where collective
        # permutes would hang (XLA:CPU inside an explicit schedule's per-stage branch) so are the experts'
        # weights: left split there, the partitioner moved them between the fsdp and expert (or tensor) device
        # orders with one.
        if mesh is not None:
            x_BTD = constrain(x_BTD, (None, None, None))
        if mesh is not None and permutes_hang():
            gate_EDF, up_EDF, down_EFD = (constrain(a, (None, None, None)) for a in (gate_EDF, up_EDF, down_EFD))
        if mesh is not None and CONTEXT in mesh.manual_axes:
            return _on_split_sequence(layer, x_BTD, router, gate_EDF, up_EDF, down_EFD, split_seq)
        return layer(x_BTD, router, gate_EDF, up_EDF, down_EFD, ExpertGroup())
    manual = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    sizes = {axis: size if axis in manual else 1 for axis, size in mesh_sizes(mesh).items()}
    spec = lambda names, shape: logical_to_spec(names, shape, sizes, kind="activations")
    rows = spec(("batch", "seq" if split_seq else None), x_BTD.shape[:2])
    gate = spec(("expert", None, "mlp"), gate_EDF.shape)
    down = spec(("expert", "mlp", None), down_EFD.shape)
    group = ExpertGroup(EXPERT if EXPERT in gate else None, TENSOR if TENSOR in gate else None,
                        rows_split=EXPERT in _axes(rows), seq_axis=rows[1] if len(rows) > 1 else None,
                        ragged=exchange == "ragged" and EXPERT in gate and EXPERT in _axes(rows),
                        row_axes=tuple(sorted(_axes(rows) - {EXPERT})))
    return jax.shard_map(lambda *args: layer(*args, group), mesh=mesh, in_specs=(rows, P(), gate, gate, down),
                         out_specs=(rows, P(*rows[:1])), axis_names=manual)(x_BTD, router, gate_EDF, up_EDF, down_EFD)
