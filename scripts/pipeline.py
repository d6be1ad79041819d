"""The whole life of a model on the shipped corpus, each stage starting from the previous stage's checkpoint:
prepare the data, pretrain, LoRA SFT, a reward model, then PPO on the SFT model rewarded by that reward model.
Prints one summary table (each stage's figure and wall time) and writes it to OUT/pipeline.json.

    python scripts/pipeline.py [--out runs/pipeline] [--steps N] [--until STAGE] [--corpus FILE]
    python scripts/pipeline.py --launcher slurm [--cpu_devices 8 | --gpus_per_node 8] [--priority ...]

Each stage is the same `scripts/train.py --config configs/<stage>.py` command a user would run (`make train`,
`make sft`, `make reward`, `make ppo`), with its data and run directories under OUT. On 8 fake CPU devices
(set here when no XLA_FLAGS are given) it takes about 31 minutes on a 2-core CPU; `--steps N` trains every stage
for N steps only, a quick check of the wiring; `--until STAGE` stops after that stage. A stage that fails stops the
pipeline with its exit code; the stages before it stay on disk.

`--launcher slurm` submits the stages as dependent SLURM jobs instead (jaxllm/cluster/chain.py): each starts only
after the one before completed (`--dependency=afterok`), so a failed stage cancels the rest; training stages run
through scripts/launch/slurm.sbatch (a preempted stage saves, requeues and resumes) on the nodes and devices the
flags of scripts/submit.py ask for (default here: one task of 8 CPU devices). The script waits for the chain and
prints the same table (`--no_wait`: print the job ids and return).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxllm.cluster.submit import add_request_arguments  # noqa: E402
from jaxllm.config.cli import fail, parser  # noqa: E402

CPU_FLAGS = "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=180"


def stages(out: Path, steps: int, corpus: Path) -> list[tuple[str, list[list[str]], callable]]:
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
        ("prepare", [py + [str(ROOT / "scripts" / "prepare_data.py"), "--input", str(corpus),
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


def run_local(chain, out: Path) -> tuple[list[dict], int]:
    """Each stage's commands in turn in this process's environment; the table's rows and the exit code."""
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS") or CPU_FLAGS,
           "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    rows = []
    for name, commands, figure in chain:
        started = time.perf_counter()
        for command in commands:
            print(f"[{name}] {' '.join(command)}", flush=True)
            with open(out / f"{name}.log", "a") as log:
                code = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            if code:
                print(f"error: stage {name} failed with exit code {code}; see {out / f'{name}.log'}", file=sys.stderr)
                return rows, code
        rows.append(row(name, figure, out, time.perf_counter() - started))
    return rows, 0


def run_slurm(chain, out: Path, args) -> tuple[list[dict], int]:
    """The stages as dependent SLURM jobs; waits for them (unless --no_wait) and returns the rows and exit code."""
    from jaxllm.cluster import slurm
    from jaxllm.cluster.chain import submit_chain, wait_chain
    from jaxllm.cluster.submit import request_from_args

    base = request_from_args(args, "", str(out), [])
    base.log_dir = str(out / "slurm-logs")
    try:
        jobs = submit_chain([(name, commands) for name, commands, _ in chain], base)
    except slurm.SlurmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return [], 2
    print("submitted: " + ", ".join(f"{name} {job}" for name, job in jobs.items()), flush=True)
    if args.no_wait:
        return [], 0
    figures = {name: figure for name, _, figure in chain}
    rows, failed = [], []

    def on_end(name: str, info: dict) -> None:
        if info["JobState"] == "COMPLETED":
            rows.append(row(name, figures[name], out, info["wall_s"]))
        else:
            failed.append((name, info))

    wait_chain(jobs, timeout=args.timeout_h * 3600, on_end=on_end)
    if failed:
        name, info = failed[0]
        code = int(info.get("ExitCode", "1:0").split(":")[0]) or 1
        log = out / "slurm-logs" / f"{base.name}-{name}-{jobs[name]}.out"
        later = [f"{n} {i['JobState']}" for n, i in failed[1:]]
        print(f"error: stage {name} failed (job {jobs[name]}: {info['JobState']}, exit code {code}); see {log}"
              + (f"; later stages: {', '.join(later)}" if later else ""), file=sys.stderr)
        return rows, code
    return rows, 0


def row(name: str, figure, out: Path, wall_s: float) -> dict:
    """A stage's line of the table: its figure (from its summary.json) and wall time."""
    result = figure(json.loads((out / name / "summary.json").read_text())) if figure else ""
    print(f"[{name}] done in {wall_s / 60:.1f} min {result}", flush=True)
    return {"stage": name, "result": result, "wall_s": round(wall_s, 1)}


def print_table(rows: list[dict]) -> None:
    width = max(len(r["result"]) for r in rows)
    print(f"\n{'stage':<10} {'result':<{width}} {'wall time':>10}")
    for r in rows:
        print(f"{r['stage']:<10} {r['result']:<{width}} {r['wall_s'] / 60:>8.1f} m")
    print(f"{'total':<10} {'':<{width}} {sum(r['wall_s'] for r in rows) / 60:>8.1f} m")


def main(argv=None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/pipeline", help="directory for every stage's data and run")
    ap.add_argument("--steps", type=int, default=0, help="train every stage for this many steps (0: the configs')")
    ap.add_argument("--until", default="ppo", help="the last stage to run (prepare, pretrain, sft, reward, ppo)")
    ap.add_argument("--corpus", default=str(ROOT / "data" / "shakespeare.jsonl.gz"), help="the pretraining corpus")
    ap.add_argument("--launcher", choices=("local", "slurm"), default="local")
    ap.add_argument("--no_wait", action="store_true", help="slurm: submit the chain and return")
    ap.add_argument("--timeout_h", type=float, default=48.0, help="slurm: hours to wait for the chain")
    add_request_arguments(ap)
    ap.set_defaults(cpu_devices=8, name="pipeline")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        fail(f"--out {out} is not empty: the pipeline starts from nothing (remove it or name another)")
    chain = stages(out, args.steps, Path(args.corpus).resolve())
    names = [name for name, _, _ in chain]
    if args.until not in names:
        fail(f"--until {args.until}: expected one of {names}")
    chain = chain[:names.index(args.until) + 1]
    out.mkdir(parents=True, exist_ok=True)
    rows, code = run_slurm(chain, out, args) if args.launcher == "slurm" else run_local(chain, out)
    if code or not rows:
        return code
    (out / "pipeline.json").write_text(json.dumps(rows, indent=2))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
