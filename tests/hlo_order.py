"""Which collective loops of a compiled XLA program may run at the same time.

XLA:CPU runs the parts of a program that no data path orders concurrently, in an order each device picks as its
threads come free, and gloo (its collectives across processes) matches messages by their order: two layer loops
with collectives that nothing orders can leave devices waiting for each other at different collectives (see
`jaxllm.train.diagnostic_step.DiagnosticSteps`). `unordered_collective_pairs` finds such pairs in the entry
computation of a compiled program's text (`jax.stages.Compiled.as_text()`), following operands only: an
optimization barrier is gone by then (XLA:CPU expands it), and that is what runs.
"""

from __future__ import annotations

import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][a-z\-]*)\((.*)$")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=(\{[^}]*\}|%[\w.\-]+)")


def _computations(text: str) -> tuple[dict[str, list[tuple]], str]:
    """{computation: [(name, opcode, operands, called computations)]} and the entry computation's name."""
    computations, current, entry = {}, None, ""
    for line in text.splitlines():
        if line.rstrip().endswith("{") and line.startswith(("ENTRY ", "%")):
            words = line.split()
            name = (words[1] if words[0] == "ENTRY" else words[0]).lstrip("%")
            entry = name if words[0] == "ENTRY" else entry
            current = computations.setdefault(name, [])
        elif line.strip() == "}":
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            name, opcode, rest = m.groups()
            operands = re.findall(r"%([\w.\-]+)", rest)  # and called computations' names, never an instruction's
            called = [c.strip("{} %") for group in _CALLED.findall(rest) for c in group.split(",")]
            current.append((name, opcode, operands, called))
    return computations, entry


def unordered_collective_pairs(text: str) -> list[tuple[str, str]]:
    """Pairs of the entry computation's collectives and `while` loops whose bodies hold collectives, one of the
    pair a loop at least, with no data path between them."""
    return _unordered(text)[0]


def unordered_loop_pairs(text: str) -> list[tuple[str, str]]:
    """The pairs of `unordered_collective_pairs` that are two loops."""
    pairs, loops = _unordered(text)
    return [(a, b) for a, b in pairs if a in loops and b in loops]


def _unordered(text: str) -> tuple[list[tuple[str, str]], set[str]]:
    computations, entry = _computations(text)
    memo: dict[str, bool] = {}

    def collective_in(computation: str) -> bool:
        if computation not in memo:
            memo[computation] = False
            memo[computation] = any(op.removesuffix("-start") in COLLECTIVES or any(map(collective_in, called))
                                    for _, op, _, called in computations.get(computation, ()))
        return memo[computation]

    instructions = {name: operands for name, _, operands, _ in computations[entry]}
    entry_code = computations[entry]
    loops = {name for name, op, _, called in entry_code if op == "while" and any(map(collective_in, called))}
    nodes = [name for name, op, _, _ in entry_code if name in loops or op.removesuffix("-start") in COLLECTIVES]

    def ancestors(name: str) -> set[str]:
        seen, stack = set(), list(instructions[name])
        while stack:
            x = stack.pop()
            if x in instructions and x not in seen:
                seen.add(x)
                stack.extend(instructions[x])
        return seen

    before = {node: ancestors(node) for node in nodes}
    pairs = [(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]
             if (a in loops or b in loops) and a not in before[b] and b not in before[a]]
    return pairs, loops

