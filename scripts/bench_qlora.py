"""Benchmark QLoRA (`lora.base_quant`): `python scripts/bench_qlora.py [--parts plan,load,sft] [--base runs/pretrain]
[--steps 200] [--config.x=v ...]`.

Three parts, each against its float baseline measured in the same run:

- plan: `--dry_run`'s per-device bytes of QLoRA SFT on `llama_8b` and `llama_70b` (bf16 compute; parameters in
  float32 as the presets have them, and in bfloat16), base in float / int8 / nf4, on one H200 and on 8 (fsdp=8),
  batch 8 x 256; nothing is allocated (the formula gives the temporaries).
- load: a Hugging Face base of ~150M parameters (random Llama, safetensors in 4 shards) loaded onto 8 CPU devices
  (fsdp=8) as float and as nf4, each in a fresh process: the peak resident memory of the process during the load
  (VmHWM reset before it, less VmRSS then; on a CPU device memory is host memory, and the safetensors files'
  mapped pages count too) and the base's bytes on the busiest device.
- sft: `make sft` (configs/sft_lora.py from `--base`, the default job's run) with lora.base_quant=none and nf4:
  the task's exact match and BLEU after training, the held-out loss, tokens/s and their ratio, and the frozen
  base's bytes per device. Extra `--config.` overrides go to both runs.

On CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8, as for `make sft`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "int8", "nf4")


def dry_run(*args: str) -> dict:
    """The per-device figures `scripts/train.py --dry_run` prints for configs/sft_lora.py with `args`."""
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / "sft_lora.py"),
               "--dry_run", *args]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench_qlora: {' '.join(args)}: the dry run failed:\n{proc.stderr[-2000:]}")
    lines = proc.stdout.splitlines()
    frozen = next(line for line in lines if line.startswith("per device: frozen"))
    total = next(line for line in lines if line.startswith("total per device:"))
    h200 = next(line for line in lines if line.startswith("H200"))
    return dict(frozen=frozen.split("frozen parameters ")[1].split(" +")[0], total=total.split(": ")[1],
                h200=h200.split(": ", 1)[1])


def plan_rows() -> list[dict]:
    """Per-device bytes of QLoRA SFT plans on llama_8b / llama_70b, one device and eight (fsdp)."""
    rows = []
    for preset in ("llama_8b", "llama_70b"):
        for devices in (1, 8):
            for params in ("float32", "bfloat16"):
                for mode in MODES:
                    figures = dry_run(f"--config.model.preset={preset}", f"--config.lora.base_quant={mode}",
                                      f"--config.precision.params={params}", "--config.train.batch_size=8",
                                      "--config.mesh.data=1", f"--config.mesh.fsdp={devices}", "--config.mesh.tensor=1")
                    rows.append(dict(preset=preset, devices=devices, params=params, base_quant=mode, **figures))
    return rows


def make_hf_base(path: Path) -> None:
    """A random ~150M-parameter Llama in Hugging Face's format, in 4 safetensors shards."""
    import jax

    from jaxllm.config.schema import ModelConfig, PrecisionConfig
    from jaxllm.interop import hf
    from jaxllm.model.build import build_model

    cfg = ModelConfig(vocab_size=8192, dim=1024, num_layers=8, num_heads=16, num_kv_heads=8, head_dim=64,
                      mlp_dim=4096)
    model = build_model(cfg, PrecisionConfig(params="float32", compute="float32"), jax.random.key(0))
    total = sum(x.nbytes for x in jax.tree.leaves(model))
    hf.save_pretrained(model, path, max_shard_bytes=total // 4 + 1)


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS now, VmHWM its peak), in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def load_once(path: str, mode: str) -> dict:
    """(in this process) Load the base at `path` onto fsdp=8 as `mode`; its memory figures."""
    import jax
    from flax import nnx

    from jaxllm.config.schema import LoRAConfig, MeshConfig, PrecisionConfig
    from jaxllm.interop import hf
    from jaxllm.model.build import build_model
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.runs import base_model
    from jaxllm.runs.loader import load_base

    base = base_model.locate(path)
    cfg = hf.config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    lora = LoRAConfig(rank=8, targets="q_proj,v_proj", base_quant=mode)
    precision = PrecisionConfig(params="float32", compute="float32")
    abstract = jax.eval_shape(lambda: nnx.split(build_model(cfg, precision, jax.random.key(0), lora=lora),
                                                nnx.LoRAParam, ...)[2])
    mesh = make_mesh(MeshConfig(data=1, fsdp=8))
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to what is resident now
    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        params, identity = load_base(base, abstract, mesh)
        jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM")
    per_device = {}
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return dict(base_quant=mode, peak_rise_mib=(peak - before) / 2**20, before_mib=before / 2**20,
                base_mib_per_device=max(per_device.values()) / 2**20, seconds=seconds, fingerprint=identity)


def load_rows(tmp: Path) -> list[dict]:
    make_hf_base(tmp / "hf")
    rows = []
    for mode in ("none", "nf4"):  # each in a fresh process: ru_maxrss is the process's peak
        proc = subprocess.run([sys.executable, __file__, "--load-once", str(tmp / "hf"), mode], capture_output=True,
                              text=True, env=os.environ)
        if proc.returncode:
            sys.exit(f"bench_qlora: loading as {mode} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def sft_run(mode: str, base: str, steps: int, workdir: Path, overrides: list[str]) -> dict:
    """`make sft` with lora.base_quant=`mode`: its summary's figures."""
    command = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / "sft_lora.py"),
               "--workdir", str(workdir), f"--config.checkpoint.restore_from={base}", f"--config.train.steps={steps}",
               f"--config.lora.base_quant={mode}", *overrides]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench_qlora: the {mode} SFT run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((workdir / "summary.json").read_text())
    task = summary["task"]["tuned"]
    plan = subprocess.run([*command, "--dry_run"], capture_output=True, text=True).stdout
    frozen = next((line for line in plan.splitlines() if line.startswith("per device: frozen")), "")
    return dict(base_quant=mode, exact_match=task["all"]["exact_match"], form=task["form"]["exact_match"],
                bleu=task["next_line"]["bleu"], eval_loss=summary["final_eval_loss"],
                tokens_per_sec=summary["tokens_per_sec"], frozen=frozen.split("+")[0].replace("per device: ", ""))


def main(argv: list[str]) -> None:
    if argv[:1] == ["--load-once"]:
        print(json.dumps(load_once(argv[1], argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="plan,load,sft")
    parser.add_argument("--base", default=str(ROOT / "runs" / "pretrain"), help="the SFT base (make train's run)")
    parser.add_argument("--steps", type=int, default=200, help="SFT steps (make sft's 200)")
    args, overrides = parser.parse_known_args(argv)
    parts = args.parts.split(",")
    figures = {}
    if "plan" in parts:
        figures["plan"] = plan_rows()
        print(f"{'preset':<11}{'devices':>8}{'params':>10}{'base':>6}{'frozen':>13}{'total':>13}  H200 141 GB")
        for r in figures["plan"]:
            print(f"{r['preset']:<11}{r['devices']:>8}{r['params']:>10}{r['base_quant']:>6}{r['frozen']:>13}"
                  f"{r['total']:>13}  {r['h200']}")
    with tempfile.TemporaryDirectory(prefix="bench-qlora-") as tmp:
        if "load" in parts:
            figures["load"] = load_rows(Path(tmp))
            print(f"{'base':<6}{'peak rise MiB':>15}{'base MiB/device':>17}{'seconds':>9}")
            for r in figures["load"]:
                print(f"{r['base_quant']:<6}{r['peak_rise_mib']:>15.0f}{r['base_mib_per_device']:>17.1f}"
                      f"{r['seconds']:>9.1f}")
        if "sft" in parts:
            runs = [sft_run(mode, args.base, args.steps, Path(tmp) / mode, overrides) for mode in ("none", "nf4")]
            figures["sft"] = runs
            print(f"{'base':<6}{'exact %':>9}{'form %':>8}{'BLEU':>8}{'eval loss':>11}{'tokens/s':>10}"
                  f"{'/ float':>9}  frozen per device")
            for r in runs:
                print(f"{r['base_quant']:<6}{r['exact_match']:>9.2f}{r['form']:>8.2f}{r['bleu']:>8.4f}"
                      f"{r['eval_loss']:>11.4f}{r['tokens_per_sec']:>10.0f}"
                      f"{r['tokens_per_sec'] / runs[0]['tokens_per_sec']:>9.3f}  {r['frozen']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main(sys.argv[1:])
