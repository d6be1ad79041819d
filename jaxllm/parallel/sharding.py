"""Logical axis names -> mesh axes: the one table that decides every layout.

Model code names dimensions logically (`embed`, `heads`, ...). `RULES` maps each name to mesh axes twice:
once for parameters at rest (and their optimizer state), once for activations in compute. FSDP lives in that
difference: weights split `embed` over `fsdp`, activations split `batch` over (`data`, `fsdp`), so XLA gathers
a layer's weights just before it is used and reduce-scatters its gradients (ZeRO-3).

Sequence parallelism (Megatron-SP, `mesh.sequence_parallel`) lives in the table too: the model names the
sequence dimension of its residual stream (embedding output, layer outputs, norms) `residual_seq` instead of
`seq`, and `residual_seq` splits over `tensor`. Attention and the MLP keep the whole sequence with heads / hidden
units over `tensor`, so XLA all-gathers the sequence before the column-parallel projections (q/k/v, gate/up) and
reduce-scatters after the row-parallel ones (o_proj, down_proj) instead of all-reducing.

Context parallelism is one rule too: `seq` splits over `context` in compute (and `residual_seq` over context and
tensor), parameters never do, so XLA reduces their gradients over `context` as over `data`. Attention is the
one place the split sequence needs more than a layout (jaxllm/parallel/context.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.config.schema import BATCH_AXES

MeshAxes = str | tuple[str, ...] | None

# logical name: (parameters, activations)
RULES: dict[str, tuple[MeshAxes, MeshAxes]] = {
    "batch": (None, BATCH_AXES),
    # context parallelism (jaxllm/parallel/context.py): every activation's sequence splits over `context`
    "seq": (None, "context"),
    "residual_seq": (None, ("context", "tensor")),  # the residual stream's sequence under sequence parallelism
    "embed": ("fsdp", None),
    "heads": ("tensor", "tensor"),
    "kv_heads": ("tensor", "tensor"),
    "head_dim": (None, None),
    "mlp": ("tensor", "tensor"),
    "vocab": ("tensor", "tensor"),
    "layers": ("stage", None),  # stacked layer weights: each pipeline stage holds its own layers
    "stage": ("stage", "stage"),
    "norm": (None, None),
    "lora_rank": (None, None),  # LoRA adapters' rank axis: small, replicated
    # the experts of a mixture-of-experts layer (jaxllm/model/moe.py), split over the `expert` mesh axis; the
    # batch splits over it everywhere else (above), and jaxllm/parallel/experts.py moves tokens between the two
    "expert": ("expert", "expert"),
}


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh_sizes: dict[str, int] | None = None,
    *,
    kind: str = "params",
    rules: dict[str, tuple[MeshAxes, MeshAxes]] = RULES,
) -> PartitionSpec:
    """PartitionSpec for a value whose dimensions carry logical `names`.

    A mesh axis is used at most once per spec (first dimension wins). With `shape` and `mesh_sizes`, a
    dimension whose size the mesh axes do not divide stays replicated rather than failing to compile.
    """
    column = {"params": 0, "activations": 1}[kind]
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        axes = tuple(a for a in _as_tuple(rules[name][column]) if a not in used)
        if mesh_sizes is not None:
            axes = tuple(a for a in axes if mesh_sizes.get(a, 1) > 1)  # size-1 axes split nothing
        if shape is not None and mesh_sizes is not None and axes:
            if shape[dim] % math.prod(mesh_sizes[a] for a in axes):
                axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def mesh_sizes(mesh) -> dict[str, int]:
    """Each mesh axis name with its size."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def active_mesh():
    """The mesh set with `jax.set_mesh`, or None when there is none (e.g. plain single-device use)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


_IN_PARTIAL_BRANCH: contextvars.ContextVar = contextvars.ContextVar("in_partial_branch", default=False)


@contextlib.contextmanager
def partial_branch():
    """Traces code that only some devices run: an explicit pipeline schedule's per-stage branch
    (jaxllm/parallel/scheduled.py), which one stage's devices take while the others take another."""
    token = _IN_PARTIAL_BRANCH.set(True)
    try:
        yield
    finally:
        _IN_PARTIAL_BRANCH.reset(token)


def permutes_hang() -> bool:
    """Whether a collective permute traced here would wait forever: XLA:CPU runs one only when every device of
    the program joins it (its rendezvous spans every device its source-target pairs name, and one permute names
    every stage's pairs), and inside a `partial_branch` only one stage's devices do. All-gathers and reductions
    over one axis rendezvous per group and run there. GPUs pair their devices point to point."""
    return _IN_PARTIAL_BRANCH.get() and jax.default_backend() == "cpu"


def _automatic_sizes(mesh) -> dict[str, int]:
    """Each axis of `mesh` with its size, a manual one (split by hand inside a shard_map) counting as 1."""
    return {a: 1 if a in mesh.manual_axes else n for a, n in mesh_sizes(mesh).items()}


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain an activation to the layout its logical `names` map to under the active mesh.

    Outside any mesh there is nothing to constrain to, so `x` is returned as is. Inside a `jax.shard_map` the
    manual axes are already split by hand (PowerSGD's per-`data`-shard gradients, jaxllm/optim/powersgd.py), so they
    count as size 1 here and the constraint names the automatic axes only.
    """
    mesh = active_mesh()
    if mesh is None:
        return x
    spec = logical_to_spec(names, x.shape, _automatic_sizes(mesh), kind="activations")
    return jax.lax.with_sharding_constraint(x, spec)


def sum_over_devices(block_sum: Callable[[jax.Array], jax.Array], arrays: Sequence[jax.Array],
                     specs: Sequence[PartitionSpec], mesh) -> jax.Array:
    """The sum over `arrays` (each laid out by its PartitionSpec in `specs` on `mesh`) of `block_sum` (a sum of
    per-element terms) of the array, computed with every device reducing a different part: the devices that hold
    the same block (its replicas, over the mesh axes its spec leaves out) each take a slice of it, then one psum.

    A norm of replicated parameters taken plainly is repeated in full by every replica: on a data-parallel mesh
    of 8 devices each reads every parameter (and the update, which it must then write out whole first), a tenth
    of a small model's step on CPU. Explicit slices inside a shard_map, rather than a sharding constraint: a
    constraint propagates backwards into the computation of the value (jax 0.10 then computed the Adam moments
    sliced and all-gathered them)."""
    sizes = mesh_sizes(mesh)

    def part_sum(x, spec):
        free = [a for a in mesh.axis_names if sizes[a] > 1 and a not in _axes_of(spec)]
        replicas = math.prod(sizes[a] for a in free)
        index = 0
        for axis in free:
            index = index * sizes[axis] + jax.lax.axis_index(axis)
        for dim, size in enumerate(x.shape):
            if size % replicas == 0:
                return block_sum(jax.lax.dynamic_slice_in_dim(x, index * (size // replicas), size // replicas, dim))
        return jnp.where(index == 0, block_sum(x), 0.0)  # nothing divides: the first replica reduces it all

    def local(*blocks):
        return jax.lax.psum(sum(part_sum(x, spec) for x, spec in zip(blocks, specs, strict=True)),
                            tuple(mesh.axis_names))

    return jax.shard_map(local, in_specs=tuple(specs), out_specs=PartitionSpec(), check_vma=False)(*arrays)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _logical_names(var: nnx.Variable) -> tuple | None:
    return var.get_metadata().get("out_sharding")


def spec_tree(tree: Any, mesh) -> Any:
    """Replace every array in `tree` (an nnx.State, optimizer state, ...) by its parameter PartitionSpec.

    Leaves inside an `nnx.Variable` with logical `out_sharding` names follow RULES; a leaf whose rank differs
    from its names (e.g. Adafactor's factored moments) and plain leaves (step counters) are replicated. A
    Variable that holds no array (`optax.MaskedNode`: a parameter the other side of `optax.partition` updates,
    as Muon's Adam side, jaxllm/optim/muon.py) stays as it is, with no leaf to place.
    """
    sizes = mesh_sizes(mesh)

    def one(x):
        if _is_variable(x):
            names = _logical_names(x)
            value = x.get_value() if hasattr(x, "get_value") else x[...]
            if not jax.tree.leaves(value):
                return x
            shape = getattr(value, "shape", ())
            if names is None or len(names) != len(shape):
                return x.replace(PartitionSpec())
            return x.replace(logical_to_spec(names, shape, sizes))
        return PartitionSpec()

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def constrain_to_rest(tree: Any) -> Any:
    """Every Variable array of `tree` (an nnx.State) constrained to its parameter layout at rest (RULES'
    parameter column) under the active mesh. For a chunk's weight gradients inside an explicit schedule's
    per-stage branch on XLA:CPU (`permutes_hang`): left to itself there, XLA's partitioner laid an unrolled
    chunk's weight gradients out over `context` and moved them back with collective permutes."""
    sizes = _automatic_sizes(active_mesh())

    def one(x):
        if not _is_variable(x):
            return x
        names = _logical_names(x)
        value = x.get_value() if hasattr(x, "get_value") else x[...]
        if names is None or len(names) != value.ndim:
            return x
        return x.replace(jax.lax.with_sharding_constraint(value, logical_to_spec(names, value.shape, sizes)))

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def spec_leaves(tree: Any, mesh) -> list[PartitionSpec]:
    """The PartitionSpecs of `spec_tree(tree, mesh)` in the order of `jax.tree.leaves(tree)`."""
    return jax.tree.leaves(spec_tree(tree, mesh), is_leaf=lambda x: isinstance(x, PartitionSpec))


def replicas_split(spec: PartitionSpec, shape: Sequence[int], sizes: dict[str, int]) -> PartitionSpec:
    """`spec` (of an array of `shape`) with the batch and sequence mesh axes it leaves out (RULES' `batch` and
    `seq` activation axes of size > 1: the axes over which the array is replicated while gradients are reduced
    over them) added to one dimension they divide: the layout of the optimizer's share of the work under ZeRO-1
    (`optim.zero1`).

    All the axes go to the first dimension that takes them all; failing that, as many of them (in order) as one
    dimension takes; a dimension already split keeps its axes first. With no dimension to take any, `spec`."""
    used = _axes_of(spec)
    replicas = _as_tuple(RULES["batch"][1]) + _as_tuple(RULES["seq"][1])
    free = tuple(a for a in replicas if sizes.get(a, 1) > 1 and a not in used)
    entries = [_as_tuple(spec[d] if d < len(spec) else None) for d in range(len(shape))]
    for count in range(len(free), 0, -1):
        extra = free[:count]
        for dim, size in enumerate(shape):
            if size % math.prod(sizes[a] for a in entries[dim] + extra) == 0:
                entries[dim] = entries[dim] + extra
                return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))
    return spec


def split_over_replicas(tree: Any, mesh) -> Any:
    """`spec_tree(tree, mesh)` with every spec `replicas_split`: each device owns a different part of what the
    replicas would otherwise all hold (ZeRO-1's layout of an optimizer state, or of the update of parameters)."""
    sizes = mesh_sizes(mesh)
    shapes = [getattr(x, "shape", ()) for x in jax.tree.leaves(tree)]
    leaves, treedef = jax.tree.flatten(spec_tree(tree, mesh), is_leaf=lambda x: isinstance(x, PartitionSpec))
    return treedef.unflatten([replicas_split(spec, shape, sizes) for spec, shape in zip(leaves, shapes, strict=True)])


def sharding_tree(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Like `spec_tree`, with `NamedSharding`s on `mesh` (usable as jit in/out shardings)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), spec_tree(tree, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_shape(shape: Sequence[int], spec: PartitionSpec, mesh_sizes: dict[str, int]) -> tuple[int, ...]:
    """Per-device shape of a global `shape` split by `spec` (ceil division, as XLA pads)."""
    out = []
    for dim, size in enumerate(shape):
        entry = spec[dim] if dim < len(spec) else None
        split = math.prod(mesh_sizes[a] for a in _as_tuple(entry))
        out.append(-(-size // split))
    return tuple(out)


def _path_name(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(p for p in parts if p != "value")


def report_rows(state: Any, mesh) -> list[dict]:
    """One row per parameter: path, global shape, dtype, logical names, PartitionSpec, bytes per device (plain
    arrays outside a Variable, e.g. optimizer step counters, have no logical names and are replicated)."""
    sizes = mesh_sizes(mesh)
    specs = spec_tree(state, mesh)
    flat_vars = [(path, var) for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)[0]
                 if jax.tree.leaves(var)]  # a Variable holding no array (see `spec_tree`) has no row
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    rows = []
    for (path, var), spec in zip(flat_vars, flat_specs):
        value = (var.get_value() if hasattr(var, "get_value") else var[...]) if _is_variable(var) else var
        itemsize = np.dtype(value.dtype).itemsize
        local = shard_shape(value.shape, spec, sizes)
        rows.append(
            dict(
                path=_path_name(path),
                shape=tuple(value.shape),
                dtype=str(np.dtype(value.dtype)),
                logical=_logical_names(var) if _is_variable(var) else None,
                spec=spec,
                bytes_per_device=math.prod(local) * itemsize,
                bytes_total=math.prod(value.shape) * itemsize,
            )
        )
    return rows


def _axes_of(spec: PartitionSpec) -> set[str]:
    return {axis for entry in spec for axis in _as_tuple(entry)}


def replicated_rows(state: Any, mesh) -> list[dict]:
    """The `report_rows` of parameters that stay whole over a mesh axis their logical names' rules split them
    over (`logical_to_spec` replicates a dimension the axis size does not divide), each with `replicated_over`,
    the axes it lost. Such a parameter costs that axis's size times its bytes across the mesh."""
    sizes = mesh_sizes(mesh)
    rows = []
    for row in report_rows(state, mesh):
        names = row["logical"]
        if names is None or len(names) != len(row["shape"]):
            continue
        lost = _axes_of(logical_to_spec(names, mesh_sizes=sizes)) - _axes_of(row["spec"])
        if lost:
            rows.append(dict(row, replicated_over=tuple(sorted(lost))))
    return rows


def format_replicated(rows: Sequence[dict]) -> str:
    """A start-up warning listing `replicated_rows` with their bytes per device ("" when there are none)."""
    if not rows:
        return ""
    lines = [f"warning: {len(rows)} parameters are replicated over mesh axes their rules split them over (the "
             f"axis size does not divide the dimension), {sum(r['bytes_per_device'] for r in rows):,} bytes per "
             "device in all:"]
    lines += [f"  {r['path']} {r['shape']} {r['logical']}: whole over {', '.join(r['replicated_over'])}, "
              f"{r['bytes_per_device']:,} bytes per device" for r in rows]
    return "\n".join(lines)


def format_report(rows: Iterable[dict]) -> str:
    """A fixed-width table of `report_rows`, with totals."""
    rows = list(rows)
    lines = [f"{'parameter':<44} {'shape':<22} {'PartitionSpec':<36} {'bytes/device':>14}"]
    for r in rows:
        spec = "P(" + ", ".join(repr(e) for e in r["spec"]) + ")"
        lines.append(f"{r['path']:<44} {str(r['shape']):<22} {spec:<36} {r['bytes_per_device']:>14,}")
    per_device = sum(r["bytes_per_device"] for r in rows)
    total = sum(r["bytes_total"] for r in rows)
    lines.append(f"{'total':<44} {'':<22} {'':<36} {per_device:>14,}  (of {total:,} unsharded)")
    return "\n".join(lines)


def bytes_per_device(tree: Any, mesh, specs: Any = None) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) placed by `specs` (a tree of
    PartitionSpecs like it), by default `spec_tree`'s."""
    sizes = mesh_sizes(mesh)
    specs = jax.tree.leaves(spec_tree(tree, mesh) if specs is None else specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))
    leaves = jax.tree.leaves(tree)
    return sum(
        math.prod(shard_shape(leaf.shape, spec, sizes)) * np.dtype(leaf.dtype).itemsize
        for leaf, spec in zip(leaves, specs)
    )


def reshard(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`x` placed with `sharding`, whose devices may be other ones than x's. Across processes through the hosts:
    jax 0.10's XLA:CPU does no device-to-device transfer between processes ("For a cross-host reshard ... the same
    set of devices"), so every process gathers the array (a collective every process joins, in the same order)
    and places its own shards."""
    if x.is_fully_addressable:
        return jax.device_put(x, sharding)
    whole = multihost_utils.process_allgather(x, tiled=True)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: whole[index])
