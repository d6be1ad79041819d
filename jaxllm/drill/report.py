"""The drill's verdict: the final parameters and loss history against the uninterrupted reference run, the
numbers per fault kind, one table, and one JSON object."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from jaxllm.drill.plan import KINDS, PROCESS_KINDS
from jaxllm.drill.supervisor import DrillRun


def compare_params(run_dir: Path, reference_dir: Path, step: int) -> tuple[bool, str, float]:
    """Whether `step`'s parameters in two runs' checkpoints are equal bit for bit (dtype, shape and every value),
    a note naming the first differing parameters, and the largest relative difference over the arrays
    (||ours - theirs|| / ||theirs||; inf when they differ in layout)."""
    # start-up speed: JAX and the checkpoint loader only once a drill compares parameters
    import jax
    import numpy as np

    from jaxllm.runs.loader import load_checkpoint

    ours = jax.tree_util.tree_leaves_with_path(load_checkpoint(str(run_dir), step=step).params)
    theirs = jax.tree_util.tree_leaves_with_path(load_checkpoint(str(reference_dir), step=step).params)
    if [p for p, _ in ours] != [p for p, _ in theirs] or any(
            a.dtype != b.dtype or a.shape != b.shape for (_, a), (_, b) in zip(ours, theirs)):
        return False, "the two checkpoints hold different parameters", math.inf
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64)) for (_, a), (_, b) in zip(ours, theirs)]
    relative = max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) for a, b in pairs)
    differing = [jax.tree_util.keystr(path) for ((path, _), (a, b)) in zip(ours, pairs)
                 if not np.array_equal(a, b, equal_nan=True)]
    if differing:
        return False, (f"{len(differing)} of {len(ours)} parameters differ, first {differing[:3]}, largest relative "
                       f"difference {relative:.2e}"), relative
    return True, f"all {len(ours)} parameters of step {step} equal", relative


def _close(a: float, b: float, tolerance: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tolerance * abs(b)


def data_audit(history: dict[int, dict]) -> dict:
    """Which data each finally kept step trained on (its `data_index`, where the batch source logs one): the
    indices seen twice, and those skipped other than by a rollback (a rollback's skip is on purpose)."""
    indices = [record["data_index"] for _, record in sorted(history.items()) if "data_index" in record]
    if not indices:
        return {}
    offsets = {step - 1 - record["data_index"] for step, record in history.items() if "data_index" in record}
    return dict(data_indices=len(indices), data_seen_twice=len(indices) - len(set(indices)),
                data_in_order=indices == sorted(indices), data_offsets=sorted(offsets))


def summarize(run: DrillRun, counts: dict[str, int], seed: int, steps: int, history: dict[int, dict],
              reference: dict[int, dict], bitwise: tuple[bool, str, float] | None, tolerance: float = 0.0) -> dict:
    """The drill's JSON object. `history`/`reference`: the last record of each step of the drilled and the
    reference run; `bitwise`: `compare_params`'s answer (None: the drilled run has no final checkpoint).
    `tolerance` (elastic drills, whose reductions run in another order on fewer devices): the relative
    difference the final parameters and each step's loss may have (0: bit for bit)."""
    done = [o for o in run.outcomes if o.injected]
    complete = sorted(history) == list(range(1, steps + 1))
    losses_equal = complete and all(s in reference and _close(history[s]["loss"], reference[s]["loss"], tolerance)
                                    for s in history)
    bitwise_equal = bool(bitwise and bitwise[0])
    params_close = bool(bitwise) and bitwise[2] <= tolerance
    median_step = statistics.median(r["step_time_s"] for r in history.values()) if history else 0.0
    by_kind = {}
    for kind in (k for k in KINDS if k in counts):
        mine = [o for o in done if o.fault.kind == kind]
        by_kind[kind] = dict(
            requested=counts[kind], injected=len(mine), recovered=sum(o.recovered for o in mine),
            steps_lost=[o.steps_lost for o in mine],
            recover_s=[round(o.recover_s, 3) for o in mine if o.recover_s is not None],
            during_save=sum(bool(o.during_save) for o in mine))
    wrong_resumes = [o.fault.index for o in done
                     if o.fault.kind in PROCESS_KINDS and o.resumed is not None and o.resumed != o.expected_resume]
    result = dict(
        seed=seed, steps=steps, faults={k: v["injected"] for k, v in by_kind.items()},
        requested=dict(counts), recoveries=sum(o.recovered for o in done), injected=len(done),
        corrupt_loads=sum(o.corrupt_load for o in done), wrong_resumes=wrong_resumes,
        unplanned_exits=run.unplanned_exits, error=run.error, starts=run.starts, finished=run.finished and complete,
        steps_lost=[o.steps_lost for o in done], recover_s=[round(o.recover_s, 3) for o in done if o.recover_s],
        history_steps=len(history), median_step_s=median_step, wall_s=run.wall_s,
        goodput=len(history) * median_step / run.wall_s if run.wall_s > 0 else 0.0,
        bitwise_equal=bitwise_equal, bitwise_note=bitwise[1] if bitwise else "no final checkpoint to compare",
        max_relative_difference=bitwise[2] if bitwise else None, tolerance=tolerance,
        losses_equal=losses_equal, by_kind=by_kind, **data_audit(history),
        events=[dict(kind=o.fault.kind, step=o.fault.step, delay=round(o.fault.delay, 3), injected=o.injected,
                     at_step=o.at_step, during_save=o.during_save, resumed=o.resumed,
                     expected_resume=o.expected_resume, steps_lost=o.steps_lost,
                     recover_s=None if o.recover_s is None else round(o.recover_s, 3), recovered=o.recovered,
                     corrupt_load=o.corrupt_load, quarantined=o.quarantined, detail=o.detail)
                for o in run.outcomes])
    result["passed"] = (result["finished"] and not run.error
                        and all(v["injected"] == v["requested"] for v in by_kind.values())
                        and result["recoveries"] == len(done) and result["corrupt_loads"] == 0
                        and not wrong_resumes and (bitwise_equal or (tolerance > 0 and params_close))
                        and losses_equal and not result.get("data_seen_twice"))
    return result


def _spread(values: list[float], fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{format(statistics.median(values), fmt)} / {format(max(values), fmt)}"


def format_table(result: dict) -> str:
    """The drill's table: one row per fault kind and a total, then the verdict lines."""
    rows = [("kind", "requested", "injected", "recovered", "in save", "lost med/max", "recover s med/max")]
    for kind, v in result["by_kind"].items():
        rows.append((kind, v["requested"], v["injected"], v["recovered"], v["during_save"],
                     _spread(v["steps_lost"], "g"), _spread(v["recover_s"], ".2f")))
    rows.append(("total", sum(result["requested"].values()), result["injected"], result["recoveries"],
                 sum(v["during_save"] for v in result["by_kind"].values()), _spread(result["steps_lost"], "g"),
                 _spread(result["recover_s"], ".2f")))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    yes = lambda flag: "yes" if flag else "NO"
    lines += [
        f"corrupt checkpoints loaded: {result['corrupt_loads']}; resumes not from the newest committed checkpoint: "
        f"{len(result['wrong_resumes'])}; unplanned exits: {len(result['unplanned_exits'])}; "
        f"starts: {result['starts']}",
        f"goodput: {result['history_steps']} steps x {result['median_step_s']:.4f} s median step / "
        f"{result['wall_s']:.1f} s wall = {100 * result['goodput']:.1f}%",
        f"final parameters bitwise equal to the reference: {yes(result['bitwise_equal'])} ({result['bitwise_note']}); "
        f"loss history equal: {yes(result['losses_equal'])}; finished: {yes(result['finished'])}",
        *([f"elastic: final parameters within {result['tolerance']:g} relative of the reference: "
           f"{yes((result['max_relative_difference'] or 0) <= result['tolerance'])} (largest "
           f"{result['max_relative_difference']:.2e}); losses within it: {yes(result['losses_equal'])}"]
          if result["tolerance"] and result["max_relative_difference"] is not None else []),
        *([f"data: {result['data_indices']} steps' data indices, {result['data_seen_twice']} seen twice, in order: "
           f"{yes(result['data_in_order'])}, offsets {result['data_offsets']}"] if "data_indices" in result else []),
        f"drill {'passed' if result['passed'] else 'FAILED'}" + (f": {result['error']}" if result["error"] else ""),
    ]
    return "\n".join(lines)
