"""RL placements side by side, and the sampler against a bare decode loop (docs/rl-at-scale.md):
`python scripts/bench_rl.py [--objective grpo] [--base runs/sft_lora] [--iterations 12] [--out build/bench_rl]
[--placements colocated,disaggregated,one_step_off,continuous] [--skip_decode] [--continuous_decode]`.

Each placement trains `--iterations` iterations of `configs/<objective>.py` (the `make grpo` / `make ppo` job)
from `--base` (after `make sft`) as its own `scripts/train.py` process on 8 CPU devices:
- colocated: the job as shipped, mesh data=2, fsdp=2, tensor=2;
- disaggregated: 4 rollout devices + a data=1, fsdp=2, tensor=2 trainer mesh;
- one_step_off: the same with rl.max_staleness=1 and rl.tis_cap=2;
- continuous: colocated with <objective>.decode_slots = a quarter of an iteration's responses (continuous
  batching, jaxllm/model/continuous.py): its rollout tokens/s (real response tokens) against colocated's.
With --continuous_decode, the rollout alone on one device: continuous batching against every row at once and
against sequential batches of the same cache memory, at the job's response length and at 4x it.
From each run's metrics.jsonl and summary.json it prints the iteration's wall time and its split: rollout
(sampling; under one_step_off it runs beside the updates, and `wait` is what the trainer still waited for it),
scoring (reference, reward, critic), weight sync, the trainer's log-probs of the rows, and the update with the
rest of the loop (the iteration's time less what the trainer waited for the others); the held-out reward before
and after; the log-prob mismatch; and each placement's iteration time against colocated's, from the same
invocation.

Then the sampler's decode (jaxllm.model.sample.decode: top-k / top-p ready sorting, stop tokens, log-probs)
against a bare JAX KV-cache loop over the same model (the model's own decode step, a categorical draw, nothing
else) on one device, at the job's rollout shape: the sampler's overhead. Ends with one JSON line.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = {
    "colocated": [],
    "disaggregated": ["--config.rl.placement=disaggregated", "--config.rl.rollout_devices=4",
                      "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"],
    "one_step_off": ["--config.rl.placement=disaggregated", "--config.rl.rollout_devices=4",
                     "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
                     "--config.rl.max_staleness=1", "--config.rl.tis_cap=2"],
    "continuous": [],  # + the objective's decode_slots, set from the job's responses (`placement_args`)
}


def placement_args(name: str, objective: str, rows: int) -> list[str]:
    """The overrides of placement `name` for the `objective` job of `rows` responses an iteration."""
    if name == "continuous":
        return [f"--config.{objective}.decode_slots={max(1, rows // 4)}"]
    return PLACEMENTS[name]
CPU = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


def job(objective: str):
    """(the shipped job's ConfigDict, its rollout section, the responses an iteration samples)."""
    from jaxllm.config.cli import load_config_file

    cfg = load_config_file(str(ROOT / "configs" / f"{objective}.py"))
    section = cfg[objective]
    return cfg, section, section.prompts_per_iteration * (section.num_generations if objective == "grpo" else 1)


def run(objective: str, base: str, workdir: Path, steps: int, extra: list[str]) -> float:
    """One training process; its wall seconds."""
    config = str(ROOT / "configs" / f"{objective}.py")
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", config,
               "--workdir", str(workdir), f"--config.checkpoint.restore_from={base}", f"--config.train.steps={steps}",
               f"--config.checkpoint.every={steps}", *extra]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **CPU})
    if proc.returncode:
        sys.exit(f"error: {workdir.name} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def split(workdir: Path, iterations: int) -> dict:
    """Per-iteration means of a finished run's time split, its held-out reward and its mismatch."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    summary = json.loads((workdir / "summary.json").read_text())
    total = lambda key: sum(r.get(key, 0.0) for r in steps)
    task = summary["task"]
    ahead = any("rollout_wait_s" in r for r in steps)  # one step off: sampling and scoring ran beside updates
    waited = total("rollout_wait_s") if ahead else total("rollout_s") + total("scoring_s")
    critical = waited + total("weight_sync_s") + total("trainer_logps_s")
    return {"iteration_s": summary["train_s"] / iterations,
            "rollout_s": total("rollout_s") / iterations, "wait_s": total("rollout_wait_s") / iterations,
            "scoring_s": total("scoring_s") / iterations, "weight_sync_s": total("weight_sync_s") / iterations,
            "trainer_logps_s": total("trainer_logps_s") / iterations,
            "update_s": (summary["train_s"] - critical) / iterations,
            "reward_base": task["base"]["all"]["reward"], "reward_tuned": task["tuned"]["all"]["reward"],
            "logp_mismatch_mean": float(np.mean([r["logp_mismatch_mean"] for r in steps if "logp_mismatch_mean" in r])),
            "logp_mismatch_max": max(r["logp_mismatch_max"] for r in steps if "logp_mismatch_max" in r),
            "rollout_tokens_per_sec": float(np.mean([r["rollout_tokens_per_sec"] for r in steps
                                                     if r.get("rollout_tokens_per_sec")])),
            # The curve, one mean per iteration of the reward function's scores (PPO's "reward" has the KL in it).
            "train_reward": [float(np.mean([r.get("score", r["reward"]) for r in part]))
                             for part in np.array_split(np.asarray(steps, dtype=object), iterations)]}


def bare_decode(graphdef, new: int, temperature: float):
    """A jitted fn(params, tokens, start, key) -> [B, new] tokens: the model's KV-cache decode step in a
    fori_loop with a categorical draw, nothing else. Made once and called twice (the first call compiles)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxllm.model.sample import bucket
    from jaxllm.model.transformer import KVCache

    @jax.jit
    def loop(params, tokens, start, key):
        model = nnx.merge(graphdef, params)
        B, P = tokens.shape
        cache = KVCache.zeros(model.cfg, B, bucket(P + new), model.compute_dtype)
        layers = model.decode_layers()  # the model's own per-layer weights for decoding, as the sampler takes them
        logits, cache = model.decode(tokens, cache, 0, start, layers)
        draw = lambda logits, i: jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)
        out = jnp.zeros((B, new), jnp.int32).at[:, 0].set(draw(logits, 0))

        def body(i, carry):
            cache, out = carry
            logits, cache = model.decode(out[:, i - 1][:, None], cache, P + i - 1, start, layers)
            return cache, out.at[:, i].set(draw(logits, i))

        return jax.lax.fori_loop(1, new, body, (cache, out))[1]

    return loop


def decode_overhead(base: str, shape: tuple[int, int, int]) -> dict:
    """New tokens/s of the sampler's decode and of the bare loop, one device, the job's rollout shape (every
    row runs all `max_new_tokens`: no stop ids, so both loops do the same number of steps)."""
    import jax

    from jaxllm.model.sample import decode, left_pad
    from jaxllm.runs.loader import load_checkpoint

    rows, prompt, new = shape
    loaded = load_checkpoint(base)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 256, size=int(n))) for n in rng.integers(prompt // 2, prompt, size=rows)]
    tokens, start = left_pad(prompts, rows, prompt)
    key = jax.random.key(0)

    def timed(fn):
        jax.block_until_ready(fn())
        began = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - began

    sampler = timed(lambda: decode(loaded.graphdef, loaded.params, tokens, start, max_new_tokens=new,
                                   temperature=1.0, key=key)[0])
    loop = bare_decode(loaded.graphdef, new, 1.0)
    bare = timed(lambda: loop(loaded.params, tokens, start, key))
    return {"rows": rows, "prompt": prompt, "new": new, "sampler_tokens_per_sec": rows * new / sampler,
            "bare_tokens_per_sec": rows * new / bare, "sampler_over_bare": bare / sampler}


def continuous_against_bucketed(base: str, section, rows: int, max_new: int) -> dict:
    """Rollout tokens/s (response tokens up to each row's stop) on one device, the job's prompts and sampling
    with `max_new` new tokens at most (the policy of `base` stops where its template's turn ends, so responses
    are of uneven length): every row at once (the default), the rows in sequential batches of a quarter of them
    (the same cache memory as the continuous run), and continuous batching through a quarter of them and through
    all of them (its machinery without refills). Each way draws other samples (its own keys), so the lengths
    differ a little between them."""
    import jax

    from jaxllm.data.prompts import read_prompts
    from jaxllm.data.sft_template import stop_ids
    from jaxllm.data.tokenizer import load_tokenizer
    from jaxllm.model.sample import left_pad
    from jaxllm.objectives.rl import prompt_bucket
    from jaxllm.objectives.rollout import rollout
    from jaxllm.runs.base_model import locate
    from jaxllm.runs.loader import load_checkpoint

    loaded, located = load_checkpoint(base), locate(base)
    tokenizer = load_tokenizer(section.tokenizer or located.tokenizer)
    prompts = read_prompts(section.train_file, section.eval_file, section.eval_fraction, 0, tokenizer,
                           section.template, section.max_prompt_tokens, log=lambda *_: None)["train"][:rows]
    P = prompt_bucket(max(len(p["prompt_ids"]) for p in prompts), section.max_prompt_tokens)
    stops, quarter = stop_ids(section.template, tokenizer), max(1, rows // 4)

    def sample(group, slots):
        outs = []
        for first in range(0, rows, group):
            tokens, start = left_pad([p["prompt_ids"] for p in prompts[first:first + group]], group, P)
            outs.append(rollout(loaded.graphdef, loaded.params, tokens, start, max_new_tokens=max_new,
                                temperature=section.temperature, stop_ids=stops, key=jax.random.key(first),
                                vocab_limit=tokenizer.vocab_size, slots=slots).mask[:, :max_new])
        return float(sum(np.asarray(m).sum() for m in outs))

    result = {}
    for name, group, slots in (("every_row_at_once", rows, 0), ("batches_of_a_quarter", quarter, 0),
                               ("continuous_a_quarter", rows, quarter), ("continuous_every_row", rows, rows)):
        sample(group, slots)  # compiles
        began = time.perf_counter()
        tokens = sample(group, slots)
        result[name] = tokens / (time.perf_counter() - began)
    return result


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objective", choices=("grpo", "ppo"), default="grpo")
    p.add_argument("--base", default="runs/sft_lora")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--out", default="build/bench_rl")
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--skip_decode", action="store_true")
    p.add_argument("--continuous_decode", action="store_true",
                   help="also continuous batching against every row at once and sequential batches (one device)")
    args = p.parse_args(argv)
    chosen = [c for c in args.placements.split(",") if c]  # --placements= : the decode comparison alone
    if any(c not in PLACEMENTS for c in chosen) or not Path(args.base).exists() or args.iterations < 2:
        sys.exit(f"error: --placements from {sorted(PLACEMENTS)}, --base an existing run (make sft), "
                 f"--iterations >= 2; got {args.placements!r}, {args.base!r}, {args.iterations}")
    cfg, section, rows = job(args.objective)
    per = section.epochs * rows // cfg.train.batch_size
    results = {}
    for name in chosen:
        workdir = Path(args.out) / f"{args.objective}_{name}"
        if workdir.exists():
            shutil.rmtree(workdir)
        wall = run(args.objective, args.base, workdir, per * args.iterations,
                   placement_args(name, args.objective, rows))
        results[name] = {"wall_s": wall, **split(workdir, args.iterations)}
        r = results[name]
        print(f"{name:>13}: iteration {r['iteration_s']:.2f}s: rollout {r['rollout_s']:.2f}, scoring "
              f"{r['scoring_s']:.2f} (one step off: beside the updates, the trainer waited {r['wait_s']:.2f}), "
              f"sync {r['weight_sync_s']:.3f}, trainer log-probs {r['trainer_logps_s']:.2f}, update and the rest "
              f"{r['update_s']:.2f}; held-out reward {r['reward_base']:.3f} -> {r['reward_tuned']:.3f}; mismatch "
              f"{r['logp_mismatch_mean']:.1e} mean, {r['logp_mismatch_max']:.1e} max; sampler "
              f"{r['rollout_tokens_per_sec']:,.0f} tokens/s", flush=True)
        print(f"{'':>13}  train reward by iteration: {' '.join(f'{x:.2f}' for x in r['train_reward'])}", flush=True)
    if "colocated" in results:
        for name, r in results.items():
            r["iteration_vs_colocated"] = r["iteration_s"] / results["colocated"]["iteration_s"]
            r["rollout_tokens_per_sec_vs_colocated"] = (r["rollout_tokens_per_sec"]
                                                        / results["colocated"]["rollout_tokens_per_sec"])
            print(f"{name:>13}: iteration time x{r['iteration_vs_colocated']:.2f} of colocated's, rollout tokens/s "
                  f"x{r['rollout_tokens_per_sec_vs_colocated']:.2f}")
    out = {"bench": "rl", "objective": args.objective, "iterations": args.iterations, "placements": results}
    if args.continuous_decode:
        out["continuous_decode"] = {}
        for new in (section.max_new_tokens, 4 * section.max_new_tokens):  # the job's, and a longer tail
            out["continuous_decode"][new] = decode = continuous_against_bucketed(args.base, section, rows, new)
            print(f"rollout tokens/s, one device, {rows} rows, up to {new} new tokens: " + ", ".join(
                f"{k} {v:,.0f} (x{v / decode['every_row_at_once']:.2f})" for k, v in decode.items()), flush=True)
    if not args.skip_decode:
        from jaxllm.objectives.rl import prompt_bucket

        shape = (rows, prompt_bucket(section.max_prompt_tokens, section.max_prompt_tokens), section.max_new_tokens)
        out["decode"] = decode = decode_overhead(args.base, shape)
        print(f"decode at {shape[0]} rows x {shape[1]}+{shape[2]}: sampler {decode['sampler_tokens_per_sec']:,.0f} "
              f"tokens/s, bare loop {decode['bare_tokens_per_sec']:,.0f} (sampler at "
              f"{decode['sampler_over_bare']:.2f}x the bare loop's speed)", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
