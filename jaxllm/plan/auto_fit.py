"""`optim.grad_accum=auto` and `model.remat=auto`: chosen before training from ahead-of-time compiles of the
train step (nothing allocated), the seed's dynamic batching done by the compiler.

Each candidate's compiled memory per device (arguments + outputs + temporaries - donated aliases, from
`memory_analysis()`) is compared with the budget: `train.memory_fraction` x the device's memory limit
(`bytes_limit` of its memory stats), or x `train.memory_budget_gb` where that is set (a CPU reports no limit).
`train.batch_size` stays the global batch whatever is chosen.

- grad_accum=auto: the fewest micro-batches that fit, among the counts that split the batch evenly over the
  batch mesh axes (and the pipeline's micro-batches): the micro-batch batch_size / grad_accum is as large as fits.
- remat=auto: the policy with the least recomputation that fits, in the order `REMAT_ORDER`.
- both: the remat policies first at grad_accum 1 (recomputing layers costs less than splitting the batch into
  smaller, less efficient matmuls), then, with `full` remat, more micro-batches.

Candidates are compiled in that order until one fits; the log shows the table of those compiled and the choice.
Only `train.objective=pretrain` is supported: its step is the one `jaxllm.plan.footprint.compiled_step` compiles.
"""

from __future__ import annotations

import dataclasses
import json

import jax

from jaxllm.config.schema import AUTO_GRAD_ACCUM, AUTO_REMAT, Config, ConfigError
from jaxllm.observe.sizes import GB
from jaxllm.plan.footprint import compiled_step

REMAT_ORDER = ("none", "save_dots", "minimal_with_context", "save_qkv_proj", "full")  # least recomputation first
def memory_budget(cfg: Config) -> int:
    """Bytes per device a candidate may use: memory_fraction x (memory_budget_gb, else the device's limit)."""
    train = cfg.train
    if train.memory_budget_gb > 0:
        limit = train.memory_budget_gb * GB
    else:
        stats = jax.local_devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit", 0)
        if not limit:
            raise ConfigError("train.memory_budget_gb", f"auto needs a memory limit and the {jax.default_backend()} "
                                                        "devices report none: set train.memory_budget_gb (GB per "
                                                        "device)")
    return int(limit * train.memory_fraction)


def accum_candidates(cfg: Config) -> list[int]:
    """Micro-batch counts that split `train.batch_size` evenly over the batch mesh axes (data x fsdp) and the
    pipeline's micro-batches, fewest first."""
    batch, shards = cfg.train.batch_size, cfg.mesh.batch_shards
    return [a for a in range(1, batch + 1)
            if batch % (a * shards) == 0 and batch % (a * cfg.pipeline.microbatches) == 0]


_MEASURED: dict[str, int] = {}  # configuration (as JSON) -> compiled bytes, for the life of the process


def step_device_bytes(cfg: Config) -> int:
    """Compiled memory per device of `cfg`'s train step: arguments + outputs + temporaries - donated aliases.
    Remembered per configuration for the life of the process: a compile is the costly part, and a process may
    choose for the same configuration more than once (a plan, then the run)."""
    settings = cfg.to_dict()
    settings.pop("workdir")
    for budget_key in ("memory_budget_gb", "memory_fraction"):
        settings["train"].pop(budget_key)
    key = json.dumps(settings, sort_keys=True)
    if key not in _MEASURED:
        m = compiled_step(cfg).memory_analysis()
        _MEASURED[key] = int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                             - m.alias_size_in_bytes)
    return _MEASURED[key]


def candidates(cfg: Config) -> list[tuple[str, int]]:
    """(model.remat, optim.grad_accum) to try, in the order of preference (see the module docstring)."""
    remats = REMAT_ORDER if cfg.model.remat == AUTO_REMAT else (cfg.model.remat,)
    accums = accum_candidates(cfg) if cfg.optim.grad_accum == AUTO_GRAD_ACCUM else [cfg.optim.grad_accum]
    return [(remat, accums[0]) for remat in remats] + [(remats[-1], accum) for accum in accums[1:]]


def with_setting(cfg: Config, remat: str, grad_accum: int) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat),
                               optim=dataclasses.replace(cfg.optim, grad_accum=grad_accum))


def format_table(rows: list[dict], budget: int) -> str:
    lines = [f"{'model.remat':<22} {'optim.grad_accum':>16} {'micro-batch':>11} {'GB per device':>14}  fits "
             f"{budget / GB:.3f} GB"]
    lines += [f"{r['remat']:<22} {r['grad_accum']:>16} {r['micro_batch']:>11} {r['bytes'] / GB:>14.4f}  "
              f"{'yes' if r['fits'] else 'no'}" for r in rows]
    return "\n".join(lines)


def choose(cfg: Config, log=print) -> Config:
    """`cfg` with `model.remat` and `optim.grad_accum` "auto" replaced by the first candidate whose compiled step
    fits `memory_budget`; unchanged when neither is "auto". A ConfigError when none fits."""
    auto = [key for key, on in (("model.remat", cfg.model.remat == AUTO_REMAT),
                                ("optim.grad_accum", cfg.optim.grad_accum == AUTO_GRAD_ACCUM)) if on]
    if not auto:
        return cfg
    if cfg.train.objective != "pretrain":
        raise ConfigError(auto[0], f"auto is supported for train.objective=pretrain, not {cfg.train.objective}: "
                                   "give a value")
    if cfg.mesh.num_devices > jax.device_count():
        raise ConfigError(auto[0], f"auto compiles the step on this machine, and the mesh needs "
                                   f"{cfg.mesh.num_devices} devices of the {jax.device_count()} here: give a value")
    budget = memory_budget(cfg)
    rows = []
    for remat, grad_accum in candidates(cfg):
        used = step_device_bytes(with_setting(cfg, remat, grad_accum))
        rows.append(dict(remat=remat, grad_accum=grad_accum, micro_batch=cfg.train.batch_size // grad_accum,
                         bytes=used, fits=used <= budget))
        if used <= budget:
            break
    limit = "train.memory_budget_gb" if cfg.train.memory_budget_gb > 0 else "the device's limit"
    log(f"{' and '.join(auto)}=auto: compiled memory per device of the candidates, in order of preference "
        f"(budget: train.memory_fraction={cfg.train.memory_fraction} x {limit})\n{format_table(rows, budget)}")
    chosen = rows[-1]
    if not chosen["fits"]:
        smallest = min(r["bytes"] for r in rows)
        raise ConfigError(auto[0], f"no candidate fits {budget / GB:.3f} GB per device (the smallest needs "
                                   f"{smallest / GB:.3f} GB): raise mesh.fsdp, or lower train.batch_size or "
                                   "train.seq_len")
    log(f"chose model.remat={chosen['remat']}, optim.grad_accum={chosen['grad_accum']} (micro-batch "
        f"{chosen['micro_batch']} of train.batch_size={cfg.train.batch_size})")
    return with_setting(cfg, chosen["remat"], chosen["grad_accum"])
