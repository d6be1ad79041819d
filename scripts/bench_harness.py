"""Benchmark the lm-evaluation-harness backend: `python scripts/bench_harness.py [--checkpoint runs/pretrain]
[--tasks jaxllm_pack] [--limit N] [--batch_size 16] [--by_task] [--table RUN ...]`.

Speed: the task pack (eval_tasks/) on one model through jaxllm's backend (jaxllm/eval/harness.py, on every device)
and through lm_eval's own `hf` backend (torch, on this machine's CPU threads) on the same checkpoint exported with
scripts/convert_hf.py, both at the run's length (`max_length`, the run's train.seq_len) and batch size: requests
answered per second of evaluation (model loading excluded), jaxllm's first pass (compiling included) and a second
(compiled), and their ratio to the hf backend's, all measured in this run. A "request" is one the harness sends
the model: a loglikelihood (one per choice), a rolling document, a generation. `--by_task` measures each of the
pack's four kinds of task on its own too (one JSON line each).

Table (`--table RUN ...`): the pack's metrics for each run (e.g. runs/pretrain runs/sft_lora runs/dpo runs/grpo),
through jaxllm's backend, as a Markdown table.

Run from the repository root (the pack's data files are named from it), on CPU with
XLA_FLAGS=--xla_force_host_platform_device_count=8 as `make eval` does. Prints one JSON object (speed) and the table.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
# The metrics the table shows, per task (the pack's README says what each measures).
COLUMNS = (("jaxllm_shakespeare_ppl", "bits_per_byte"), ("jaxllm_shakespeare_ppl", "word_perplexity"),
           ("jaxllm_shakespeare_mc", "acc"), ("jaxllm_shakespeare_mc", "acc_norm"),
           ("jaxllm_shakespeare_cloze", "acc"), ("jaxllm_shakespeare_cloze", "perplexity"),
           ("jaxllm_sft_form", "exact_match"), ("jaxllm_sft_title", "exact_match"),
           ("jaxllm_sft_next_line", "exact_match"), ("jaxllm_sft_next_line", "bleu"))


BY_TASK = ("jaxllm_shakespeare_ppl", "jaxllm_shakespeare_mc", "jaxllm_shakespeare_cloze", "jaxllm_sft_generate")


def evaluate(model, tasks: list[str], limit: int | None, task_manager) -> tuple[dict, int, float]:
    """(lm_eval's results, requests answered, seconds) of one evaluation of `model`."""
    import lm_eval

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=task_manager, limit=limit,
                                  log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    seconds = time.perf_counter() - start
    requests = sum(len(sample["resps"]) for samples in out["samples"].values() for sample in samples)
    return out["results"], requests, seconds


def speed(args, task_manager) -> dict:
    from lm_eval.models.huggingface import HFLM

    from jaxllm.eval import harness

    ours = harness.JaxLLM(checkpoint=args.checkpoint, batch_size=args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_hf.py"), "export", "--checkpoint",
                        args.checkpoint, "--out", tmp], check=True, capture_output=True)
        theirs = HFLM(pretrained=tmp, max_length=ours.max_length, batch_size=args.batch_size, dtype="float32",
                      device="cpu")
    tasks, limit = args.tasks.split(","), args.limit or None
    rows = {}
    for name, model in (("jaxllm_first", ours), ("jaxllm", ours), ("hf", theirs)):
        results, requests, seconds = evaluate(model, tasks, limit, task_manager)
        rows[name] = {"requests": requests, "seconds": round(seconds, 2), "requests_per_s": requests / seconds}
    hf_rate = rows["hf"]["requests_per_s"]
    return {"checkpoint": args.checkpoint, "tasks": tasks, "limit": limit, "batch_size": args.batch_size,
            "max_length": ours.max_length, **rows,
            "ratio_jaxllm_to_hf": rows["jaxllm"]["requests_per_s"] / hf_rate,
            "ratio_jaxllm_first_to_hf": rows["jaxllm_first"]["requests_per_s"] / hf_rate}


def table(runs: list[str], args, task_manager) -> str:
    from jaxllm.eval import harness

    lines = ["| run | " + " | ".join(f"{task.removeprefix('jaxllm_')} {metric}" for task, metric in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for run in runs:
        model = harness.JaxLLM(checkpoint=run, batch_size=args.batch_size)
        results, _, _ = evaluate(model, ["jaxllm_pack"], args.limit or None, task_manager)
        cells = [results.get(task, {}).get(f"{metric},none") for task, metric in COLUMNS]
        lines.append(f"| {run} (max_length {model.max_length}) | " +
                     " | ".join("-" if v is None else f"{v:.4g}" for v in cells) + " |")
    return "\n".join(lines)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="runs/pretrain")
    p.add_argument("--tasks", default="jaxllm_pack")
    p.add_argument("--limit", type=int, default=0, help="documents per task (0: all)")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--table", nargs="*", default=None, help="runs whose pack metrics to tabulate")
    p.add_argument("--no_speed", action="store_true")
    p.add_argument("--by_task", action="store_true", help="the speed of each kind of task too")
    args = p.parse_args(argv)
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=str(ROOT / "eval_tasks"), include_defaults=False)
    if not args.no_speed:
        print(json.dumps(speed(args, task_manager)), flush=True)
    if args.by_task:
        for task in BY_TASK:
            print(json.dumps(speed(argparse.Namespace(**{**vars(args), "tasks": task}), task_manager)), flush=True)
    if args.table:
        print(table(args.table, args, task_manager))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
