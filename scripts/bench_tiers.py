"""Step time with and without the persistent checkpoint copy (docs/storage.md):
`python scripts/bench_tiers.py [--steps 120] [--every 10] [--rounds 2] [--out build/bench_tiers]
[--slow_mb_s 100,10]`.

Trains the default job (configs/pretrain.py, after `make data`) as its own scripts/train.py process on 8 CPU
devices, saving every `--every` steps, once per setting, in one invocation:
- one tier: checkpoints straight to `<workdir>/checkpoints` (the baseline);
- two tiers: `checkpoint.local_dir` with the persistent copy at full speed;
- two tiers with the persistent tier throttled to each `--slow_mb_s` (MB/s; the seeds' HDD tier is 100 MB/s).
The settings run in turn, `--rounds` times (interleaved, so that drift of the machine hits all alike). For
each: the median and mean step time over every step of every round (the save steps included), the loop's
mean blocking time in a save, the copies made and their MB/s, and the mean step time against one tier's. Ends
with one JSON line.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


def train(workdir: Path, steps: int, every: int, extra: list[str]) -> dict:
    """One training process of the default job; its step times, save blocking times, copies and wall time."""
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / "pretrain.py"),
               "--workdir", str(workdir), f"--config.train.steps={steps}", f"--config.checkpoint.every={every}",
               "--config.train.eval_every=100000", "--config.train.sample_prompt=", *extra]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, **CPU))
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(command)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in records if "loss" in r][1:]  # the first step compiles
    summary = json.loads((workdir / "summary.json").read_text())
    copies = summary.get("checkpoint_copies", [])
    return dict(step_median_s=statistics.median(r["step_time_s"] for r in steps_logged),
                step_mean_s=statistics.fmean(r["step_time_s"] for r in steps_logged),
                save_block_mean_s=statistics.fmean(s["blocking_s"] for s in summary["checkpoint_saves"]),
                saves=len(summary["checkpoint_saves"]), copies=len(copies),
                copy_mb_s=statistics.fmean(c["mb_per_s"] for c in copies) if copies else None,
                checkpoint_mb=summary["checkpoint_saves"][-1]["bytes"] / 1e6, wall_s=wall)


def combine(rounds: list[dict]) -> dict:
    """One setting's rounds: step times over all of them (medians of the rounds' medians), summed counts."""
    mean = lambda key: statistics.fmean(r[key] for r in rounds if r[key] is not None) if any(
        r[key] is not None for r in rounds) else None
    return dict(step_median_s=statistics.median(r["step_median_s"] for r in rounds), step_mean_s=mean("step_mean_s"),
                save_block_mean_s=mean("save_block_mean_s"), saves=sum(r["saves"] for r in rounds),
                copies=sum(r["copies"] for r in rounds), copy_mb_s=mean("copy_mb_s"),
                checkpoint_mb=rounds[0]["checkpoint_mb"], wall_s=mean("wall_s"), rounds=len(rounds))


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="build/bench_tiers")
    p.add_argument("--slow_mb_s", default="100,10", help="throttled persistent tiers to measure, MB/s")
    args = p.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    settings = {"one tier": []}
    settings["two tiers"] = [f"--config.checkpoint.local_dir={out / 'local-full'}"]
    for rate in (r for r in args.slow_mb_s.split(",") if r):
        settings[f"two tiers, persistent {rate} MB/s"] = [f"--config.checkpoint.local_dir={out / f'local-{rate}'}",
                                                          f"--config.debug.slow_persistent_mb_s={rate}"]
    runs = {name: [] for name in settings}
    for round_ in range(args.rounds):
        for name, extra in settings.items():
            workdir = out / f"{name.replace(' ', '_').replace(',', '').replace('/', '')}-{round_}"
            runs[name].append(train(workdir, args.steps, args.every,
                                    [a.replace("local-", f"local-{round_}-") for a in extra]))
    results = {name: combine(rounds) for name, rounds in runs.items()}
    base = results["one tier"]["step_mean_s"]
    print(f"{'setting':36s} {'median s':>9s} {'mean s':>9s} {'vs one':>7s} {'save block s':>12s} {'copies':>7s} "
          f"{'copy MB/s':>9s} {'wall s':>7s}")
    for name, r in results.items():
        r["mean_vs_one_tier"] = r["step_mean_s"] / base
        copy = f"{r['copy_mb_s']:.0f}" if r["copy_mb_s"] else "-"
        print(f"{name:36s} {r['step_median_s']:9.4f} {r['step_mean_s']:9.4f} {r['mean_vs_one_tier']:7.3f} "
              f"{r['save_block_mean_s']:12.4f} {r['copies']:3d}/{r['saves']:<3d} {copy:>9s} {r['wall_s']:7.1f}")
    print(f"checkpoint size {results['one tier']['checkpoint_mb']:.1f} MB, {args.steps} steps, a save every "
          f"{args.every}")
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
