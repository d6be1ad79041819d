"""Pipeline schedules as data: which operation each stage runs at each tick, generated and checked in Python.

Letters as in `jaxllm.parallel.pipeline`: p stages, m micro-batches, r repeats (chunks per stage), C = p*r
chunks of consecutive layers; chunk c runs on stage c % p. An operation is one of
  F(i, c): the forward of micro-batch i through chunk c,
  B(i, c): its backward (for `zb_h1` the input gradient only),
  W(i, c): `zb_h1` only, the weight gradient of micro-batch i in chunk c, split off B to fill the bubble.
Every operation takes one tick (the unit-cost model the bubble formulas use); a tick's operations of all stages
run in lockstep, and what F and B produce reaches the next (previous) stage for the following tick.

Dependencies: F(i, c) after F(i, c-1); B(i, c) after F(i, c) and after B(i, c+1); W(i, c) after B(i, c).
A schedule is each stage's order of operations (GPipe: all forwards, then all backwards; 1F1B: a warm-up of
forwards, then one forward and one backward in turn; interleaved 1F1B: Megatron-LM's order over r chunks per
stage; ZB-H1: 1F1B's with the weight gradients deferred into what would have been the bubble, never more
micro-batches in flight than 1F1B). `build(name, p, m, r)` places each stage's next operation at the first tick
its dependencies allow and returns a checked `Schedule`; `Schedule.slots` then assigns every activation and
gradient that waits on a stage to a buffer slot, so the executor (jaxllm/parallel/scheduled.py) holds only as
many as are in flight at once.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1")
EXPLICIT = ("1f1b", "interleaved_1f1b", "zb_h1")  # run by the explicit forward-backward executor
FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


class Op(NamedTuple):
    """One operation: kind F, B or W of micro-batch `mb` through chunk `chunk`."""

    kind: str
    mb: int
    chunk: int


def _needs(op: Op, chunks: int, split_weights: bool) -> list[Op]:
    """The operations `op` waits for."""
    kind, i, c = op
    if kind == FORWARD:
        return [Op(FORWARD, i, c - 1)] if c > 0 else []
    if kind == BACKWARD:
        return [Op(FORWARD, i, c)] + ([Op(BACKWARD, i, c + 1)] if c < chunks - 1 else [])
    return [Op(BACKWARD, i, c)] if split_weights else []


def _gpipe_order(stage: int, p: int, m: int, r: int) -> list[Op]:
    """Every forward (repeat by repeat, micro-batches in order), then every backward in reverse: the order of
    differentiating the forward scan (jaxllm/parallel/pipeline.py)."""
    forwards = [Op(FORWARD, k % m, (k // m) * p + stage) for k in range(m * r)]
    return forwards + [Op(BACKWARD, i, c) for _, i, c in reversed(forwards)]


def _one_f_one_b_order(stage: int, p: int, m: int, r: int) -> list[Op]:
    """1F1B (r = 1) and Megatron-LM's interleaved 1F1B (r > 1; m a multiple of p): forwards visit the stage's
    chunks p micro-batches at a time, backwards the same with the chunks reversed; a warm-up of forwards
    (deeper for earlier stages, and by (r-1)*p more when interleaved), then one forward and one backward in turn."""
    total = m * r

    def virtual(k: int, backward: bool) -> Op:
        j = (k // p) % r
        j = r - 1 - j if backward else j
        mb = (k // (p * r)) * p + k % p if r > 1 else k
        return Op(BACKWARD if backward else FORWARD, mb, j * p + stage)

    warmup = min(total, (p - stage - 1) * (2 if r > 1 else 1) + (r - 1) * p)
    order = [virtual(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        order += [virtual(warmup + k, False), virtual(k, True)]
    return order + [virtual(k, True) for k in range(total - warmup, total)]


def _zero_bubble_order(stage: int, p: int, m: int, r: int) -> list[Op]:
    """ZB-H1 (Qi et al., 2024): 1F1B's order with each backward split into B and W, stage s deferring its Ws by
    s micro-batches. 1F1B holds p - s micro-batches on stage s, so with the deferred Ws every stage holds at most
    p, 1F1B's peak (stage 0's); the deferred Ws fill the ticks 1F1B spends waiting for gradients in the
    cool-down, and the bubble falls to (p-1)/(3m+p-1), a third of 1F1B's in the same units."""
    del r
    warmup = min(m, p - stage - 1)
    order = [Op(FORWARD, i, stage) for i in range(warmup)]
    deferred = 0
    for k in range(m):
        order += [Op(FORWARD, warmup + k, stage)] if warmup + k < m else []
        order.append(Op(BACKWARD, k, stage))
        if k >= stage:
            order.append(Op(WEIGHT, k - stage, stage))
            deferred += 1
    return order + [Op(WEIGHT, i, stage) for i in range(deferred, m)]


def _require(condition: bool, message: str) -> None:
    """An AssertionError unless `condition`: a raise, not `assert`, so the check holds under `python -O` too."""
    if not condition:
        raise AssertionError(message)


_ORDERS = {"gpipe": _gpipe_order, "circular": _gpipe_order, "1f1b": _one_f_one_b_order,
           "interleaved_1f1b": _one_f_one_b_order, "zb_h1": _zero_bubble_order}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A placed schedule: `ticks[t][s]` is the operation stage s runs at tick t, or None (idle)."""

    name: str
    stages: int
    microbatches: int
    repeats: int
    ticks: tuple[tuple[Op | None, ...], ...]

    @property
    def chunks(self) -> int:
        return self.stages * self.repeats

    @property
    def split_weights(self) -> bool:
        return self.name == "zb_h1"

    @property
    def bubble(self) -> float:
        """Idle fraction of the stage-ticks, every operation one tick."""
        busy = sum(op is not None for row in self.ticks for op in row)
        return 1 - busy / (len(self.ticks) * self.stages)

    def placed(self) -> dict[Op, tuple[int, int]]:
        """Every operation's (tick, stage)."""
        return {op: (t, s) for t, row in enumerate(self.ticks) for s, op in enumerate(row) if op is not None}

    def in_flight(self) -> list[int]:
        """Per stage, the most micro-batch chunks whose forward ran and whose last backward operation (W with
        `zb_h1`, else B) did not: the activations the stage must hold at once."""
        last = WEIGHT if self.split_weights else BACKWARD
        peaks = []
        for s in range(self.stages):
            held, peak = 0, 0
            for row in self.ticks:
                op = row[s]
                held += 1 if op is not None and op.kind == FORWARD else 0
                peak = max(peak, held)
                held -= 1 if op is not None and op.kind == last else 0
            peaks.append(peak)
        return peaks

    def check(self) -> None:
        """Raise AssertionError unless every operation runs once on its chunk's stage, after what it needs."""
        p, C = self.stages, self.chunks
        kinds = (FORWARD, BACKWARD, WEIGHT) if self.split_weights else (FORWARD, BACKWARD)
        want = {Op(k, i, c) for k in kinds for i in range(self.microbatches) for c in range(C)}
        placed = self.placed()
        count = sum(op is not None for row in self.ticks for op in row)
        _require(set(placed) == want and count == len(want), f"{self.name}: operations missing or repeated")
        for op, (t, s) in placed.items():
            _require(s == op.chunk % p, f"{self.name}: {op} on stage {s}")
            for need in _needs(op, C, self.split_weights):
                _require(placed[need][0] < t, f"{self.name}: {op} at tick {t} before {need} at {placed[need][0]}")

    def render(self, width: int = 4) -> str:
        """The tick table as text: a row per stage, a column per tick, 'F3' (forward of micro-batch 3), 'B3',
        'W3'; with repeats, the chunk's repeat after a dot ('F3.1'); '.' idle."""
        def cell(op):
            if op is None:
                return "."
            return f"{op.kind}{op.mb}" + (f".{op.chunk // self.stages}" if self.repeats > 1 else "")

        width = max(width, max(len(cell(op)) for row in self.ticks for op in row) + 1)
        return "\n".join(f"stage {s} |" + "".join(cell(row[s]).rjust(width) for row in self.ticks)
                         for s in range(self.stages))


def build(name: str, stages: int, microbatches: int, repeats: int = 1) -> Schedule:
    """The checked schedule `name` (one of SCHEDULES) for p stages, m micro-batches and r repeats: each stage runs
    its operations in the schedule's order, each at the first tick after everything it needs."""
    p, m, r = stages, microbatches, repeats
    if name not in SCHEDULES:
        raise ValueError(f"pipeline.schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if (r > 1) != (name in ("circular", "interleaved_1f1b")):
        raise ValueError(f"schedule {name!r} takes {'pipeline.repeats > 1' if r == 1 else 'pipeline.repeats=1'}")
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(f"interleaved_1f1b needs micro-batches in multiples of the stages: {m} % {p} != 0")
    split = name == "zb_h1"
    orders = [_ORDERS[name](s, p, m, r) for s in range(p)]
    done: dict[Op, int] = {}
    ticks: list[tuple[Op | None, ...]] = []
    while any(orders):
        t = len(ticks)
        row = []
        for order in orders:
            ready = order and all(done.get(n, t) < t for n in _needs(order[0], p * r, split))
            row.append(order.pop(0) if ready else None)
        # a tick where no stage can move leaves the next one the same: the orders wait on each other for ever
        _require(any(op is not None for op in row), f"{name}: the stages' orders deadlock at tick {t}")
        done.update((op, t) for op in row if op is not None)
        ticks.append(tuple(row))
    schedule = Schedule(name, p, m, r, tuple(ticks))
    schedule.check()
    return schedule


class Program(NamedTuple):
    """A schedule as int32 arrays [ticks, stages] for the executor, and its buffer sizes.

    At tick t stage s runs `kind` (IDLE, or FORWARD/BACKWARD/WEIGHT as 1/2/3) of micro-batch `mb` in its local
    chunk `repeat` (chunk repeat*p + s), which is the model's first chunk where `first` and its last where `last`;
    the operation reads its input activation from slot `act` and its output gradient from slot `grad` of the
    stage's buffers. After the tick's collective permutes, what came from the previous stage is filed into
    activation slot `file_act` and what came from the next into gradient slot `file_grad` (-1: nothing came).
    """

    kind: np.ndarray
    mb: np.ndarray
    repeat: np.ndarray
    first: np.ndarray
    last: np.ndarray
    act: np.ndarray
    grad: np.ndarray
    file_act: np.ndarray
    file_grad: np.ndarray
    act_slots: int
    grad_slots: int


KIND_CODES = {None: 0, FORWARD: 1, BACKWARD: 2, WEIGHT: 3}


def _assign_slots(intervals: dict[tuple[int, int, int], tuple[int, int]]) -> tuple[dict, int]:
    """Slots for values that wait on a stage: `intervals[(stage, mb, chunk)] = (arrival tick, last-use tick)`.
    A value is filed at the end of its arrival tick and read during its last-use tick, so a slot is free again for
    a value arriving in the tick of its last read. Returns ({key: slot}, slots per stage)."""
    slot_of, most = {}, 0
    for stage in {k[0] for k in intervals}:
        free_at: list[int] = []  # per slot, the tick of its current value's last read
        for key in sorted((k for k in intervals if k[0] == stage), key=lambda k: intervals[k]):
            arrive, last_use = intervals[key]
            slot = next((n for n, t in enumerate(free_at) if t <= arrive), len(free_at))
            free_at[slot:slot + 1] = [last_use]
            slot_of[key] = slot
        most = max(most, len(free_at))
    return slot_of, most


def program(schedule: Schedule) -> Program:
    """The executor's arrays of `schedule`, with activation and gradient slots assigned (see `Program`)."""
    p, C = schedule.stages, schedule.chunks
    placed = schedule.placed()
    last_kind = WEIGHT if schedule.split_weights else BACKWARD
    ticks = lambda kind, i, c: placed[Op(kind, i, c)][0]
    acts = {(c % p, i, c): (ticks(FORWARD, i, c - 1), ticks(last_kind, i, c))
            for i in range(schedule.microbatches) for c in range(1, C)}
    grads = {(c % p, i, c): (ticks(BACKWARD, i, c + 1), ticks(last_kind, i, c))
             for i in range(schedule.microbatches) for c in range(C - 1)}
    act_slot, act_slots = _assign_slots(acts)
    grad_slot, grad_slots = _assign_slots(grads)
    shape = (len(schedule.ticks), p)
    out = {name: np.zeros(shape, np.int32) for name in Program._fields[:7]}
    out.update(file_act=np.full(shape, -1, np.int32), file_grad=np.full(shape, -1, np.int32))
    for op, (t, s) in placed.items():
        key = (s, op.mb, op.chunk)
        values = dict(kind=KIND_CODES[op.kind], mb=op.mb, repeat=op.chunk // p, first=op.chunk == 0,
                      last=op.chunk == C - 1, act=act_slot.get(key, 0), grad=grad_slot.get(key, 0))
        for name, value in values.items():
            out[name][t, s] = value
        if op.kind == FORWARD and op.chunk < C - 1:  # the next chunk's stage files the output
            out["file_act"][t, (s + 1) % p] = act_slot[((s + 1) % p, op.mb, op.chunk + 1)]
        if op.kind == BACKWARD and op.chunk > 0:  # the previous chunk's stage files the input gradient
            out["file_grad"][t, (s - 1) % p] = grad_slot[((s - 1) % p, op.mb, op.chunk - 1)]
    return Program(**out, act_slots=max(act_slots, 1), grad_slots=max(grad_slots, 1))
