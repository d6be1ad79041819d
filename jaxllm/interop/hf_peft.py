"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), both ways.

PEFT stores lora_A [r, in_features] and lora_B [out_features, r] per layer and projection. jaxllm's A [L, in.., r]
and B [L, r, out..] are laid out like kernels whose output (A) or input (B) is the rank, so the same layout
transforms as the base weights apply (`jaxllm.interop.table.Transform`), one declarative row per tensor kind.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxllm.config.schema import LORA_TARGETS, LoRAConfig
from jaxllm.interop.table import SPLIT_IN_HEADS, SPLIT_OUT_HEADS, TRANSPOSE, Row
from jaxllm.model.lora import MODULE_OF

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's name of the wrapped LlamaForCausalLM


def adapter_rows(targets):
    """`jaxllm.interop.table.Row`s of the A and B tensors of `targets`."""
    rows = []
    for t in targets:
        module = MODULE_OF[t]
        a_layout = SPLIT_IN_HEADS if t == "o_proj" else TRANSPOSE  # o_proj's input is (N, H)
        b_layout = SPLIT_OUT_HEADS if t in ("q_proj", "k_proj", "v_proj") else TRANSPOSE
        base = f"{PREFIX}model.layers.{{i}}.{module}.{t}"
        rows.append(Row(f"{base}.lora_A.weight", ("layers", module, f"{t}_lora", "a"), a_layout))
        rows.append(Row(f"{base}.lora_B.weight", ("layers", module, f"{t}_lora", "b"), b_layout))
    return tuple(rows)


def read_config(path: Path) -> LoRAConfig:
    """The LoRAConfig of a PEFT adapter directory; a one-line error for what jaxllm cannot represent."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found (expected a PEFT adapter directory)")
    cfg = json.loads(file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {cfg.get('peft_type')!r}, only LORA adapters are supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = [t for t in targets if t not in LORA_TARGETS]
    if unsupported or not targets:
        raise ValueError(f"{file}: target_modules {targets} (supported: {', '.join(LORA_TARGETS)})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise ValueError(f"{file}: {key} is not supported (per-module ranks or extra trained modules)")
    if cfg.get("bias", "none") != "none" or cfg.get("use_dora") or cfg.get("fan_in_fan_out"):
        raise ValueError(f"{file}: only plain LoRA (bias none, no DoRA, fan_in_fan_out false) is supported")
    if not (Path(path) / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{Path(path) / WEIGHTS_FILE}: not found (only safetensors adapters are supported)")
    return LoRAConfig(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout", 0.0)),
                      targets=",".join(t for t in LORA_TARGETS if t in targets),
                      rslora=bool(cfg.get("use_rslora", False)))


def config_json(cfg: LoRAConfig, base_model: str = "") -> dict:
    """PEFT's adapter_config.json for `cfg`."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout, "target_modules": list(cfg.target_list), "use_rslora": cfg.rslora,
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True,
        "inference_mode": True, "base_model_name_or_path": base_model,
    }
