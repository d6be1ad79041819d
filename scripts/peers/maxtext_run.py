"""MaxText's pretraining step on CPU for the shapes of scripts/bench_peers.py; prints ONE JSON line last:
{"impl": "maxtext", "tokens_per_sec", "step_s", "compile_s", "params", "loss_first", "loss_last"}.

Runs in the MaxText environment `make bench-peers` builds (build/peers/maxtext: maxtext 0.2.5 without its TPU
extras, scripts/peers/maxtext-requirements.txt), never in jaxllm's. Usage:
    python scripts/peers/maxtext_run.py --layers 6 --dim 256 --heads 4 --kv_heads 4 --mlp_dim 688 --vocab 8000 \\
        --seq 256 --batch 8 --steps 18 --warmup 3 --dtype bfloat16 --devices 8

The model is MaxText's llama2 decoder block at the same shapes (untied head, SwiGLU, RMSNorm eps 1e-5, rope theta
10000, no dropout, no z-loss, no rematerialisation, layers scanned), float32 weights, AdamW (b1 0.9, b2 0.95, eps
1e-8, weight decay 0.1) after global-norm clipping at 1.0, synthetic data, pure data parallelism over `--devices`
forced host devices (`--batch` is the global batch). Step time: the median of MaxText's own "completed step: N,
seconds: X" log values past `--warmup` (the time between step dispatches; its loop reads metrics one step late,
so in the steady state that is the step time). compile_s: lowering and compiling the train step, and params:
MaxText's exact count, both read through two MaxText hooks wrapped here.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+),.* loss: ([0-9.naninf]+)")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 6), ("dim", 256), ("heads", 4), ("kv_heads", 4), ("mlp_dim", 688),
                          ("vocab", 8000), ("seq", 256), ("batch", 8), ("steps", 18), ("warmup", 3),
                          ("devices", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the child process: run MaxText
    return p.parse_known_args(argv)


def maxtext_args(a, run_dir: str) -> list[str]:
    """MaxText's key=value overrides of its base.yml for the model and run of `a`."""
    import maxtext

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    return [
        base, "run_name=peer", f"base_output_directory={run_dir}", "hardware=cpu", "dataset_type=synthetic",
        "enable_checkpointing=false", "skip_jax_distributed_system=true", f"steps={a.steps}",
        "log_period=1000000", "enable_tensorboard=false", "enable_goodput_recording=false",
        "monitor_goodput=false", "gcs_metrics=false", "save_config_to_gcs=false",
        "jax_cache_dir=",  # no persistent compilation cache: compile_s is a real compile
        "decoder_block=llama2", f"base_num_decoder_layers={a.layers}", f"base_emb_dim={a.dim}",
        f"base_num_query_heads={a.heads}", f"base_num_kv_heads={a.kv_heads}", f"head_dim={a.dim // a.heads}",
        f"base_mlp_dim={a.mlp_dim}", f"vocab_size={a.vocab}", f"max_target_length={a.seq}",
        'mlp_activations=["silu","linear"]', "logits_via_embedding=false", "normalization_layer_epsilon=1e-5",
        "rope_max_timescale=10000", "enable_dropout=false", "dropout_rate=0.0", "z_loss_multiplier=0.0",
        "attention=dot_product", "scan_layers=true", "remat_policy=none",
        "packing=false",  # one causal sequence per row
        f"dtype={a.dtype}", "weight_dtype=float32",
        "opt_type=adamw", "adam_b1=0.9", "adam_b2=0.95", "adam_eps=1e-8", "adam_weight_decay=0.1",
        "gradient_clipping_threshold=1.0", "learning_rate=3e-4",
        f"per_device_batch_size={a.batch // a.devices}", f"ici_data_parallelism={a.devices}",
        "ici_fsdp_parallelism=1", "ici_tensor_parallelism=1", "dcn_data_parallelism=1",
    ]


def drive(argv: list[str]) -> None:
    """In the child: MaxText's trainer, with its parameter count and train-step compile time printed."""
    from absl import app
    from maxtext.trainers.pre_train import train
    from maxtext.utils import max_utils, maxtext_utils

    count, dump, memory = (max_utils.calculate_num_params_from_pytree, maxtext_utils.maybe_dump_jaxpr,
                           max_utils.print_compiled_memory_stats)
    started = {}

    def counted(params):
        n = count(params)
        print(f"PEER_PARAMS {int(n)}", flush=True)
        return n

    def before_lowering(*args, **kwargs):  # MaxText calls it just before lowering its train step
        started.setdefault("t", time.perf_counter())
        return dump(*args, **kwargs)

    def after_compiling(*args, **kwargs):  # and this just after compiling it
        if kwargs.get("prefix") == "train" and "t" in started and "done" not in started:
            started["done"] = True
            print(f"PEER_COMPILE_S {time.perf_counter() - started['t']:.3f}", flush=True)
        return memory(*args, **kwargs)

    max_utils.calculate_num_params_from_pytree = counted
    maxtext_utils.maybe_dump_jaxpr = before_lowering
    max_utils.print_compiled_memory_stats = after_compiling
    sys.argv = ["train", *argv]
    app.run(train.main)


def _printed(log: str, key: str, cast):
    """The value the driver printed after `key`, or None."""
    return next((cast(line.split()[1]) for line in log.splitlines() if line.startswith(key)), None)


def summary(log: str, a) -> dict:
    """The JSON line of a MaxText log."""
    steps = [(int(step), float(seconds), float(loss)) for step, seconds, loss in STEP_LINE.findall(log)]
    timed = [seconds for step, seconds, _ in steps if step >= a.warmup]
    if not timed:
        raise SystemExit(f"no timed steps in MaxText's log; its end:\n{log[-3000:]}")
    step_s = statistics.median(timed)
    return {"impl": "maxtext", "tokens_per_sec": a.batch * a.seq / step_s, "step_s": step_s,
            "compile_s": _printed(log, "PEER_COMPILE_S", float), "params": _printed(log, "PEER_PARAMS", int),
            "loss_first": steps[0][2], "loss_last": steps[-1][2], "timed_steps": len(timed)}


def main(argv) -> int:
    a, rest = parse_args(argv)
    if a.driver:
        drive(rest)
        return 0
    env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu")  # MaxText's switch off Google Cloud
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={a.devices}".strip()
    with tempfile.TemporaryDirectory() as run_dir:
        done = subprocess.run([sys.executable, __file__, "--driver", *maxtext_args(a, run_dir)], env=env,
                              cwd=run_dir, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode:
        raise SystemExit(f"MaxText failed (exit {done.returncode}); its log ends:\n{log[-3000:]}")
    print(json.dumps(summary(log, a)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
