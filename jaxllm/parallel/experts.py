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
bytes each way) where a ragged all-to-all would move only the picks; on GPUs at scale that exchange is the one to
add behind the same `ExpertGroup` interface.

The experts' hidden units split over `tensor` as a dense MLP's do (the down projection's partial sums are added over
`tensor` with the reduce-scatter), and fsdp's split of the model dimension is gathered at the shard_map's edge, just
before use, as for any layer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.context import CONTEXT
from jaxllm.parallel.sharding import active_mesh, constrain, logical_to_spec, mesh_sizes, permutes_hang

EXPERT, TENSOR = "expert", "tensor"


@dataclasses.dataclass(frozen=True)
class ExpertGroup:
    """The collectives of one device's expert group, inside the shard_map (axis names None: that axis is not split,
    e.g. outside any mesh)."""

    expert_axis: str | None = None
    tensor_axis: str | None = None
    rows_split: bool = True  # False: the rows are whole on every device of the group (too few to split)
    seq_axis: str | None = None  # the axis the rows' sequence is split over (context parallelism), if any

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

    def combine(self, partial):
        """This device's rows of the sum over the group's (and tensor's) partial outputs: `gather` backwards."""
        if self.tensor_axis is not None:
            partial = jax.lax.psum(partial, self.tensor_axis)
        if self.expert_axis is None:
            return partial
        if not self.rows_split:
            return jax.lax.psum(partial, self.expert_axis)
        return jax.lax.psum_scatter(partial, self.expert_axis, scatter_dimension=0, tiled=True)


def _axes(spec: P) -> set[str]:
    return {axis for entry in spec if entry for axis in ((entry,) if isinstance(entry, str) else entry)}


def _on_split_sequence(layer: Callable, x_BTD, router, gate_EDF, up_EDF, down_EFD, split_seq: bool):
    """`layer` where the sequence is split over `context` by hand (ring attention inside the pipeline,
    `jaxllm.parallel.pipeline.pipeline(seq_split=True)`): with `split_seq` each device routes its own positions and
    the per-row stats add up over `context`; else (capacity dispatch, whose buffers are per whole row) the row is
    gathered, routed whole on every device, and each keeps its own positions' outputs."""
    if split_seq:
        return layer(x_BTD, router, gate_EDF, up_EDF, down_EFD, ExpertGroup(seq_axis=CONTEXT))
    T = x_BTD.shape[1]
    whole_BTD = jax.lax.all_gather(x_BTD, CONTEXT, axis=1, tiled=True)
    out_BTD, stats = layer(whole_BTD, router, gate_EDF, up_EDF, down_EFD, ExpertGroup())
    # Every device computed the same whole-row stats; jax types an all-gather's result as varying over the axis,
    # so one mean over it (of equal values) makes them invariant, as the pipeline's per-row stats must be.
    stats = jax.tree.map(lambda a: jax.lax.pmean(a, CONTEXT), stats)
    return jax.lax.dynamic_slice_in_dim(out_BTD, jax.lax.axis_index(CONTEXT) * T, T, axis=1), stats


def run_experts(layer: Callable, x_BTD, router, gate_EDF, up_EDF, down_EFD, split_seq: bool = True):
    """`layer(x_BTD, router, gate_EDF, up_EDF, down_EFD, group) -> (out_BTD, per-row stats)` on every device of
    the active mesh with its rows and its experts (`ExpertGroup` says which); called as is outside any mesh.
    `router` is any tree of arrays (the router's kernel, its bias), whole on every device. With `split_seq` the
    rows' sequence stays split over `context` as outside (each device routes its own positions; the layer adds
    its per-row stats over the sequence with `group.row_total`), else it is gathered (capacity dispatch: its
    buffers are per whole row).

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
                        rows_split=EXPERT in _axes(rows), seq_axis=rows[1] if len(rows) > 1 else None)
    return jax.shard_map(lambda *args: layer(*args, group), mesh=mesh, in_specs=(rows, P(), gate, gate, down),
                         out_specs=(rows, P(*rows[:1])), axis_names=manual)(x_BTD, router, gate_EDF, up_EDF, down_EFD)
