"""Reading an optimised HLO module's text (`compiled.as_text()`): its computations and instructions, how many
times each computation runs per execution of the program, the bytes of a shape, and the Python source of an
instruction (its stack frame).

A while loop's body runs `known_trip_count` times (XLA writes it into the loop's backend_config when it can
prove it, e.g. for a `lax.scan`); a body without one counts once and is reported as unknown. Hand-written
because JAX exposes an HLO module's text but no parser or visitor for it in Python.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import numpy as np

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_WHILE = re.compile(r"condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    shape: str  # the result shape as printed, e.g. "f32[64,4,16]{2,1,0}" or a tuple "(f32[..], ...)"
    text: str  # the whole line
    computation: str


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a printed shape (a tuple's elements in order)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(shape)
            if dtype in DTYPE_BYTES]


def shape_bytes(shape: str) -> int:
    """Bytes of a printed shape (every element of a tuple)."""
    return int(sum(DTYPE_BYTES[dtype] * int(np.prod(dims)) for dtype, dims in array_shapes(shape)))


@dataclasses.dataclass
class HloModule:
    """The instructions of an HLO module's text, and how many times each computation runs per execution."""

    instructions: list[Instruction]
    runs: dict[str, int]  # computation -> executions per run of the entry computation
    unknown_trip_counts: int  # while loops without a known trip count (their bodies counted once)
    frames: dict[int, tuple[str, int, str, int]]  # stack frame id -> (file, line, function, parent frame id)

    @classmethod
    def parse(cls, text: str) -> "HloModule":
        instructions, computation, entry = [], None, None
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header and not line.startswith(" "):
                computation = header.group(2)
                entry = computation if header.group(1) else entry
                continue
            match = _INSTRUCTION.match(line)
            if match and computation is not None:
                instructions.append(Instruction(match.group(1), match.group(3), match.group(2), line, computation))
        runs, unknown = _executions(instructions, entry)
        return cls(instructions, runs, unknown, _stack_frames(text))

    def source(self, instruction: Instruction, keep=lambda file: True) -> tuple[str, int, str] | None:
        """(file, line, function) of the innermost Python frame of `instruction` whose file `keep` accepts."""
        match = re.search(r"stack_frame_id=(\d+)", instruction.text)
        frame = int(match.group(1)) if match else 0
        seen = set()
        while frame in self.frames and frame not in seen:
            seen.add(frame)
            file, line, function, parent = self.frames[frame]
            if keep(file):
                return file, line, function
            frame = parent
        return None


def _executions(instructions: list[Instruction], entry: str | None) -> tuple[dict[str, int], int]:
    """Executions of each computation per run of `entry`: a while body runs its trip count times per run of
    the computation holding the loop, anything else called runs once per run of its caller."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    unknown = 0
    for ins in instructions:
        loop = _WHILE.search(ins.text) if ins.opcode == "while" else None
        if loop:
            trips = _TRIP_COUNT.search(ins.text)
            unknown += trips is None
            n = int(trips.group(1)) if trips else 1
            calls[ins.computation] += [(loop.group(1), n + 1), (loop.group(2), n)]
            continue
        callees = _CALLS.findall(ins.text)
        branches = _BRANCHES.search(ins.text)
        if branches:  # a conditional runs one branch: counted as if each ran (an upper bound)
            callees += [b.strip().lstrip("%") for b in branches.group(1).split(",") if b.strip()]
        calls[ins.computation] += [(callee, 1) for callee in callees]
    runs: dict[str, int] = defaultdict(int)

    def visit(computation: str, times: int, depth: int = 0) -> None:
        runs[computation] += times
        if depth < 64:  # HLO has no recursion; the bound only guards against a misread text
            for callee, n in calls.get(computation, ()):
                visit(callee, times * n, depth + 1)

    if entry is not None:
        visit(entry, 1)
    return dict(runs), unknown


def _table(text: str, title: str) -> dict[int, str]:
    """Rows `id body` of one of the module's trailing tables (FileNames, FunctionNames, ...)."""
    match = re.search(rf"^{title}\n((?:\d+ .*\n?)*)", text, re.MULTILINE)
    if not match:
        return {}
    return {int(i): body for i, body in (row.split(" ", 1) for row in match.group(1).splitlines() if row)}


def _stack_frames(text: str) -> dict[int, tuple[str, int, str, int]]:
    files = {i: v.strip('"') for i, v in _table(text, "FileNames").items()}
    functions = {i: v.strip('"') for i, v in _table(text, "FunctionNames").items()}
    locations = {}
    for i, body in _table(text, "FileLocations").items():
        fields = dict(re.findall(r"(\w+)=(\d+)", body))
        locations[i] = (files.get(int(fields["file_name_id"]), "?"), int(fields["line"]),
                        functions.get(int(fields["function_name_id"]), "?"))
    frames = {}
    for i, body in _table(text, "StackFrames").items():
        fields = dict(re.findall(r"(\w+)=(\d+)", body))
        location = locations.get(int(fields["file_location_id"]), ("?", 0, "?"))
        # The printed parent id is one above the parent's row (seen on jax 0.10.2's XLA); 0 and 1 mean none.
        parent = int(fields["parent_frame_id"]) - 1
        frames[i] = (*location, parent if 0 < parent < i else 0)
    return frames
