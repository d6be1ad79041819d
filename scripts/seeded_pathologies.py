"""Run the default job healthy and with each seeded pathology (short CPU runs), diagnose each, and print which
findings each got against the one it must get.

    python scripts/seeded_pathologies.py [--steps 60] [--workdir runs/seeded] [--only lr_x30,zero_layer] [--reuse]

Every run is configs/pretrain.py with `train.on_anomaly=skip` (so it runs to the end), evaluated every 20 steps, on
8 fake CPU devices; `moe_hot_router` is configs/pretrain_moe.py for its whole 300 steps (~20 minutes). `--reuse`
diagnoses runs already in the workdir instead of training them again. The last line is the table as one JSON
object. Exit 0 when every run got what it must (and the healthy run no warning), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxllm.diagnose.report import write_report  # noqa: E402

BASE_LR, BASE_INIT_STD = 3e-3, 0.02  # configs/pretrain.py
# name -> (overrides, finding ids of which at least one must be named; empty: none at warning level or above)
SEEDED = {
    "healthy": ((), ()),
    "lr_x30": ((f"--config.optim.lr={BASE_LR * 30:g}",), ("lr_too_high", "loss_oscillation", "loss_divergence")),
    "lr_div1000": ((f"--config.optim.lr={BASE_LR / 1000:g}",), ("lr_too_low", "slow_convergence")),
    "zero_layer": (("--config.debug.zero_layer=1",), ("dead_layer",)),
    "init_x50": ((f"--config.model.init_std={BASE_INIT_STD * 50:g}",),
                 ("saturated_gates", "attention_logit_growth", "output_logits_saturated")),
    # longer than the default step (1-2.6 s on these shared CPUs): a shorter sleep hides behind the step already
    # queued on the devices (the loop loads the next batch while the devices run the current step)
    "data_sleep": (("--config.debug.data_sleep_s=3.0",), ("input_bound",)),
    # a saturated router (its softmax one-hot, so neither the loss nor an aux loss moves it) and no aux loss
    "moe_hot_router": (("--config.model.moe_aux_loss_coef=0", "--config.debug.router_scale=1000"),
                       ("expert_collapse",)),
}
# A mixture of experts' pathology runs configs/pretrain_moe.py for its whole 300 steps whatever --steps says: every
# router collapses early (around step 30) and spreads again later, so a short healthy run would look collapsed.
MOE_RUNS = {"moe_hot_router"}
NEEDS = {  # the rule a pathology's finding comes from when the run lacks its fields
    "zero_layer": "dead_layer", "data_sleep": "input_bound", "lr_div1000": "lr_too_low",
    "init_x50": "saturated_gates", "moe_hot_router": "expert_collapse",
}


def train(name: str, overrides: tuple[str, ...], workdir: Path, steps: int) -> float:
    """Train one seeded run into `workdir`; seconds taken."""
    job, length = ("pretrain_moe.py", ()) if name in MOE_RUNS else ("pretrain.py", (f"--config.train.steps={steps}",))
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / job),
               "--workdir", str(workdir), *length, "--config.train.eval_every=20", "--config.train.on_anomaly=skip",
               *overrides]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {name} run failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return time.perf_counter() - start


def judge(name: str, must: tuple[str, ...], diagnosis) -> tuple[bool, str]:
    """(passed, note) of one run's diagnosis."""
    alarms = [f.id for f in diagnosis.findings if f.severity != "info"]
    if not must:
        return not alarms, "no finding" if not alarms else "false alarm"
    if set(must) & set(alarms):
        return True, "named"
    rule = NEEDS.get(name)
    if rule in diagnosis.not_evaluated:
        return False, f"not evaluable: {diagnosis.not_evaluated[rule]}"
    return False, "missed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workdir", default="runs/seeded")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--reuse", action="store_true", help="diagnose existing runs instead of training")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(SEEDED)
    unknown = sorted(set(names) - set(SEEDED))
    if unknown:
        print(f"error: --only: unknown runs {unknown}; known: {', '.join(SEEDED)}", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        overrides, must = SEEDED[name]
        workdir = Path(args.workdir) / name
        seconds = 0.0 if args.reuse and (workdir / "summary.json").exists() else train(name, overrides, workdir,
                                                                                         args.steps)
        _, diagnosis = write_report(workdir)
        passed, note = judge(name, must, diagnosis)
        rows.append({"run": name, "overrides": " ".join(overrides) or "-", "must": list(must),
                     "found": [f"{f.id}({f.severity[0]})" for f in diagnosis.findings], "passed": passed,
                     "note": note, "train_s": round(seconds, 1)})
    print(f"{'run':11s} {'passed':6s} {'findings (c/w/i)':58s} note")
    for r in rows:
        print(f"{r['run']:11s} {str(r['passed']):6s} {', '.join(r['found']) or '-':58s} {r['note'][:90]}")
    print(json.dumps({"steps": args.steps, "runs": rows}))
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
