"""The whole life of a model on the shipped corpus, each stage starting from the previous stage's checkpoint:
prepare the data, pretrain, LoRA SFT, a reward model, then PPO on the SFT model rewarded by that reward model.
Prints one summary table (each stage's figure and wall time) and writes it to OUT/pipeline.json.

    python scripts/pipeline.py [--out runs/pipeline] [--steps N]

Each stage is the same `scripts/train.py --config configs/<stage>.py` command a user would run (`make train`,
`make sft`, `make reward`, `make ppo`), with its data and run directories under OUT. On 8 fake CPU devices
(set here when no XLA_FLAGS are given) it takes about 31 minutes on a 2-core CPU; `--steps N` trains every stage
for N steps only, a quick check of the wiring. A stage that fails stops the
pipeline with its exit code; the stages before it stay on disk.
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
CPU_FLAGS = "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=180"


def stages(out: Path, steps: int) -> list[tuple[str, list[list[str]], callable]]:
    """(name, commands, figure(summary) -> str) per stage; `steps` > 0 overrides every stage's train.steps."""
    data, py = out / "data", [sys.executable]
    length = [f"--config.train.steps={steps}"] if steps else []
    train = lambda config, workdir, *args: py + [str(ROOT / "scripts" / "train.py"), "--config",
                                                 str(ROOT / "configs" / f"{config}.py"), "--workdir",
                                                 str(out / workdir), *args, *length]
    sft_files = [f"--config.sft.train_file={data / 'sft_task' / 'train.jsonl'}",
                 f"--config.sft.eval_file={data / 'sft_task' / 'eval.jsonl'}",
                 f"--config.data.path={data / 'sft_task' / 'prepared'}"]
    pair_files = [f"--config.preference.train_file={data / 'preference' / 'train.jsonl'}",
                  f"--config.preference.eval_file={data / 'preference' / 'eval.jsonl'}",
                  f"--config.data.path={data / 'preference' / 'prepared'}"]
    prompt_files = [f"--config.ppo.train_file={data / 'sft_task' / 'train.jsonl'}",
                    f"--config.ppo.eval_file={data / 'sft_task' / 'eval.jsonl'}"]
    task = lambda s, name: s["task"]["tuned"]["all"][name]
    base_task = lambda s, name: s["task"]["base"]["all"][name]

    def sft_task(s: dict) -> str:
        """What a post-training stage did to the SFT task (exact match, perplexity of its held-out responses)."""
        if "sft_task" not in s:
            return "SFT task not reported"
        before, after = s["sft_task"]["base"]["all"], s["sft_task"]["tuned"]["all"]
        return (f"SFT task exact match {before['exact_match']:.1f}% -> {after['exact_match']:.1f}%, perplexity "
                f"{before['perplexity']:.1f} -> {after['perplexity']:.1f}")
    return [
        ("prepare", [py + [str(ROOT / "scripts" / "prepare_data.py"), "--input", str(ROOT / "data" / "shakespeare.jsonl.gz"),
                           "--output", str(data / "shakespeare"), "--vocab_size", "512"],
                     py + [str(ROOT / "scripts" / "make_sft_task.py"), "--out", str(data / "sft_task")],
                     py + [str(ROOT / "scripts" / "make_preference_set.py"), "--out", str(data / "preference")]],
         None),
        ("pretrain", [train("pretrain", "pretrain", f"--config.data.path={data / 'shakespeare'}")],
         lambda s: f"held-out loss {s['initial_eval_loss']:.3f} -> {s['final_eval_loss']:.3f}"),
        ("sft", [train("sft_lora", "sft", f"--config.checkpoint.restore_from={out / 'pretrain'}", *sft_files)],
         lambda s: f"exact match {s['task']['base']['all']['exact_match']:.1f}% -> {task(s, 'exact_match'):.1f}%"),
        ("reward", [train("reward", "reward", f"--config.checkpoint.restore_from={out / 'pretrain'}", *pair_files)],
         lambda s: f"pair accuracy {base_task(s, 'accuracy'):.1f}% -> {task(s, 'accuracy'):.1f}%"),
        ("ppo", [train("ppo", "ppo", f"--config.checkpoint.restore_from={out / 'sft'}",
                       f"--config.ppo.reward=rm:{out / 'reward'}", *prompt_files)],
         lambda s: (f"reward-model score {base_task(s, 'reward'):.3f} -> {task(s, 'reward'):.3f}, "
                    f"KL {task(s, 'kl'):.2f} nats; {sft_task(s)}")),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/pipeline", help="directory for every stage's data and run")
    ap.add_argument("--steps", type=int, default=0, help="train every stage for this many steps (0: the configs')")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        print(f"error: --out {out} is not empty: the pipeline starts from nothing (remove it or name another)",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS") or CPU_FLAGS,
           "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    rows = []
    for name, commands, figure in stages(out, args.steps):
        started = time.perf_counter()
        for command in commands:
            print(f"[{name}] {' '.join(command)}", flush=True)
            with open(out / f"{name}.log", "a") as log:
                code = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            if code:
                print(f"error: stage {name} failed with exit code {code}; see {out / f'{name}.log'}", file=sys.stderr)
                return code
        wall = time.perf_counter() - started
        result = figure(json.loads((out / name / "summary.json").read_text())) if figure else ""
        rows.append({"stage": name, "result": result, "wall_s": round(wall, 1)})
        print(f"[{name}] done in {wall / 60:.1f} min {result}", flush=True)
    (out / "pipeline.json").write_text(json.dumps(rows, indent=2))
    width = max(len(r["result"]) for r in rows)
    print(f"\n{'stage':<10} {'result':<{width}} {'wall time':>10}")
    for r in rows:
        print(f"{r['stage']:<10} {r['result']:<{width}} {r['wall_s'] / 60:>8.1f} m")
    print(f"{'total':<10} {'':<{width}} {sum(r['wall_s'] for r in rows) / 60:>8.1f} m")
    return 0


if __name__ == "__main__":
    sys.exit(main())
