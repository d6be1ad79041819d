"""The device groups of an HLO collective, from any of the spellings XLA prints for `replica_groups`:

    {{0,2},{1,3}}                                   explicit lists
    [4,2]<=[8]   [4,2]<=[4,2]T(1,0)                 iota: iota(8) reshaped, transposed, rows are groups
    mesh['a'=4,'b'=2] {'b'}                         mesh axes: the devices varying along the listed axes
    mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'a'}   ... over a permuted device array
    mesh['a'=8] {'a':(2)2}                          ... or a sub-axis: (pre-size)size of an axis

Ids are the executable's logical device ids (with `use_global_device_ids`, as JAX's SPMD programs are): position
i of the device assignment, which for a jit over a mesh is `mesh.devices.flat[i]`. The semantics follow XLA's
xla/hlo/ir/replica_group.cc (MeshAxesReplicaGroupList) and tile_assignment.cc (IotaTileAssignment); parsed by
hand because JAX exposes no parser for HLO text attributes.
"""

from __future__ import annotations

import math
import re

import numpy as np

_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_AXIS_REF = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    """iota(prod(reshape)) reshaped to `reshape` and transposed by `perm`."""
    array = np.arange(math.prod(reshape)).reshape(reshape)
    return array.transpose(perm) if perm else array


def _explicit(text: str) -> list[list[int]]:
    return [_ints(group) for group in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]


def _iota_groups(match: re.Match) -> list[list[int]]:
    shape = _ints(match.group(1))
    perm = _ints(match.group(3)) if match.group(3) else None
    return _iota(_ints(match.group(2)), perm).reshape(shape).tolist()


def _device_array(sizes: list[int], device_ids: str | None) -> np.ndarray:
    if not device_ids:
        return np.arange(math.prod(sizes)).reshape(sizes)
    iota = _IOTA.fullmatch("[0]<=" + device_ids.strip())
    if iota:
        perm = _ints(iota.group(3)) if iota.group(3) else None
        return _iota(_ints(iota.group(2)), perm).reshape(sizes)
    return np.asarray(_ints(device_ids.strip("[]() "))).reshape(sizes)  # an explicit permutation


def _mesh_groups(match: re.Match) -> list[list[int]]:
    """Groups of a mesh-axes list: split each referenced axis into (pre, size, rest) pieces, move the pieces
    the group spans to the end, and read rows."""
    axes = _MESH_AXIS.findall(match.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    devices = _device_array(sizes, match.group(2))
    refs: dict[int, list[tuple[int, int, int]]] = {}  # axis -> (pre-size, size, order in the list)
    for order, (name, pre, size) in enumerate(_AXIS_REF.findall(match.group(3))):
        axis = names.index(name)
        refs.setdefault(axis, []).append((int(pre), int(size), order) if pre else (1, sizes[axis], order))
    pieces, grouped = [], {}
    for axis, size in enumerate(sizes):
        done = 1
        for pre, part, order in sorted(refs.get(axis, [])):
            if pre != done:
                pieces.append(pre // done)
                done = pre
            grouped[order] = len(pieces)
            pieces.append(part)
            done *= part
        if done != size or axis not in refs:
            pieces.append(size // done)
    spanned = [grouped[o] for o in sorted(grouped)]
    rest = [i for i in range(len(pieces)) if i not in spanned]
    group_size = math.prod(pieces[i] for i in spanned)
    return devices.reshape(pieces).transpose(rest + spanned).reshape(-1, group_size).tolist()


def parse_replica_groups(text: str) -> list[list[int]]:
    """The device groups `text` (the value of an HLO `replica_groups=` attribute, in any spelling above) names;
    [] for an empty list (every device in one group)."""
    text = text.strip()
    if text.startswith("{"):
        return _explicit(text)
    match = _IOTA.match(text)
    if match:
        return _iota_groups(match)
    match = _MESH.match(text)
    if match:
        return _mesh_groups(match)
    raise ValueError(f"unrecognised replica_groups {text[:80]!r}")


REPLICA_GROUPS = re.compile(r"replica_groups=(\{(?:\{[\d,\s]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|"
                            r"mesh\[[^\]]*\](?:,\s*device_ids=\([^)]*\)?\))?\s*\{[^}]*\})")
SOURCE_TARGET_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def groups_of(instruction: str) -> list[list[int]] | None:
    """The device groups of one HLO collective instruction (a collective-permute's source/target pairs count
    as two-device groups); None when it names none."""
    match = REPLICA_GROUPS.search(instruction)
    if match:
        return parse_replica_groups(match.group(1))
    match = SOURCE_TARGET_PAIRS.search(instruction)
    if match:
        return [_ints(pair) for pair in re.findall(r"\{(\d+,\d+)\}", match.group(1))]
    return None
