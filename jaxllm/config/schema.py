"""Typed configuration: the ConfigDict from `configs/*.py` is validated once into frozen dataclasses.

Each section checks its own fields in its `check()`, next to them; `check_across` holds the checks that tie
sections together (the model and the batch against the mesh, ...), `fine_tuning.OBJECTIVE_CHECKS` the sections of the
objective that trains, and `probe_environment` what lies outside the config (files, packages, the backend).
Every check names the key it rejects (`mesh.tensor: ...`), so scripts can print one line and exit 2.
Functions downstream take only their own sub-config (`ModelConfig`, `OptimConfig`, ...).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any

import ml_collections

from jaxllm.config.families import FAMILIES
from jaxllm.config.families.blocks import Blocks
from jaxllm.config.presets import GPU_PRESETS, PRESETS
from jaxllm.config.fine_tuning import (OBJECTIVE_CHECKS, OBJECTIVES, DPOConfig, GRPOConfig, PPOConfig,
                                       PreferenceConfig, RewardConfig, RLConfig, RolloutConfig, SFTConfig)
from jaxllm.config.typed_config import ConfigError, build, check_choice, check_positive
from jaxllm.config.auto_precision import resolve_compute

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor", "stage")
DTYPES = ("float32", "bfloat16", "float16", "float64")
REMAT_POLICIES = ("none", "full", "save_dots", "minimal_with_context", "save_qkv_proj")
CONTEXT_ATTENTIONS = ("all_gather", "ring")  # model.context_attention (jaxllm/parallel/context.py)
GRAD_COMPRESSIONS = ("none", "powersgd")  # optim.grad_compression (jaxllm/optim/powersgd.py)
OFFLOADS = ("none", "host")  # optim.offload, model.remat_offload (jaxllm/parallel/offload.py)
ATTENTION_IMPLS = ("auto", "xla", "dot_product", "cudnn")
OPTIMIZERS = ("adamw", "lamb", "adafactor", "muon")  # optim.name (jaxllm/optim/chain.py, jaxllm/optim/muon.py)
SCHEDULES = ("cosine", "constant", "wsd")
MOE_DISPATCHES = ("dropless", "capacity")  # model.moe_dispatch (jaxllm/model/moe.py)
MOE_ROUTER_SCORES = ("softmax", "sigmoid")  # model.moe_router_scores (jaxllm/model/moe.py)
MOE_EXCHANGES = ("auto", "gather", "ragged")  # model.moe_exchange (jaxllm/parallel/experts.py)
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # model.rope_scaling (jaxllm.model.rope.RopeScaling)
QUANT_MODES = ("none", "int8", "fp8")  # precision.quant (jaxllm/model/quant.py)
LOSS_SCALE_MODES = ("none", "static", "dynamic")  # precision.loss_scale, besides "auto" (jaxllm/optim/loss_scale.py)
AUTO_VOCAB = 0  # model.vocab_size "auto": the tokenizer's size, padded (resolve_vocab_size)
VOCAB_MULTIPLE = 128  # "auto" pads to a multiple of this times mesh.tensor (Megatron's make-vocab-size-divisible-by)
AUTO_GRAD_ACCUM = 0  # optim.grad_accum "auto": the fewest micro-batches that fit (jaxllm/plan/auto_fit.py)
AUTO_REMAT = "auto"  # model.remat "auto": the least recomputation that fits (jaxllm/plan/auto_fit.py)
# keys that accept "auto" on the command line, and what it stores
AUTO_VALUES = {"model.vocab_size": AUTO_VOCAB, "optim.grad_accum": AUTO_GRAD_ACCUM, "model.remat": AUTO_REMAT}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the six mesh axes (their product is the device count, over all processes).

    `expert` (expert parallelism) splits a mixture of experts' experts (jaxllm/parallel/experts.py); everywhere
    else it splits the batch as data and fsdp do, so no device idles outside the expert layers.

    With several processes (hosts) the `dcn_*` sizes say how much of each axis crosses hosts: axis `a` is laid out
    as `dcn_a` host groups of `a / dcn_a` devices inside a host (a hybrid mesh), so axes with dcn size 1 stay on the
    fast intra-host links. All 0 (the default): the processes go on `data`, then `stage`, then `fsdp`; never on
    `tensor` unless asked for.

    `sequence_parallel` (Megatron-style sequence parallelism): the residual stream between the attention and MLP
    blocks (embedding output, layer outputs, the norms) is split along the sequence over `tensor` instead of
    being replicated there, so those activations take 1/tensor of the memory; the sequence is all-gathered
    before the q/k/v and gate/up projections and reduce-scattered after o_proj and down_proj (in place of the
    all-reduce). Same losses, same parameters and checkpoints. Needs `train.seq_len` divisible by `tensor`;
    with tensor = 1 it changes nothing.

    `context` (context parallelism, jaxllm/parallel/context.py) splits every activation's sequence dimension,
    attention included (`model.context_attention`); parameters are not split over it and their gradients reduce
    over it as over `data`. Needs `train.seq_len` divisible by 2 * context (the load-balanced layout).
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    dcn_data: int = 0
    dcn_fsdp: int = 0
    dcn_tensor: int = 0
    dcn_stage: int = 0
    sequence_parallel: bool = False
    expert: int = 1
    dcn_expert: int = 0
    context: int = 1
    dcn_context: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """The axis sizes in `MESH_AXES` order."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def batch_shards(self) -> int:
        """How many ways a batch's rows split: over data, fsdp and expert."""
        return self.data * self.fsdp * self.expert

    @property
    def dcn_shape(self) -> tuple[int, ...]:
        """How many host groups each axis spans (unset sizes count as 1)."""
        return tuple(max(getattr(self, f"dcn_{axis}"), 1) for axis in MESH_AXES)

    @property
    def host_shape(self) -> tuple[int, ...]:
        """The axis sizes inside one host (process)."""
        return tuple(size // dcn for size, dcn in zip(self.shape, self.dcn_shape))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics-independent options of the Llama-style decoder.

    `vocab_size` "auto" (stored as 0) is the tokenizer's size padded up to a multiple of 128 * mesh.tensor,
    resolved when the run opens its data (or, for a plan, reads the token store's manifest); padding ids are
    never sampled."""

    vocab_size: int = 4096
    dim: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    mlp_dim: int = 768
    rope_theta: float = 10000.0
    # RoPE rescaled to extend the context (jaxllm.model.rope.RopeScaling): "linear" divides every frequency by
    # rope_scaling_factor, "llama3" only the slow ones (Llama 3.1's bands), "yarn" ramps between the two and also
    # scales cos and sin; llama3 and yarn need rope_original_context, the context the model was trained at. An
    # imported checkpoint brings its own scaling ("none" here keeps it).
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_original_context: int = 0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # The architecture family (jaxllm/config/families/): the blocks its layers have beyond Llama's (`blocks`) and
    # its Hugging Face names. Presets of a family set it.
    family: str = "llama"
    # Attention sees at most this many positions back, itself included (0: the whole context); only families
    # whose blocks have it (Mistral).
    sliding_window: int = 0
    # With blocks.local_global: every global_every-th layer attends to the whole context, the others to the
    # sliding window, rotating with local_rope_theta (0: rope_theta); 0: every layer alike.
    global_every: int = 0
    local_rope_theta: float = 0.0
    # Attention scores scale by query_pre_attn_scalar ** -0.5 (Gemma's); 0: head_dim ** -0.5.
    query_pre_attn_scalar: int = 0
    init_std: float = 0.02
    remat: str = "none"  # or "auto": chosen before training by jaxllm/plan/auto_fit.py
    # "host": what `remat` saves for the backward pass (save_dots, minimal_with_context, save_qkv_proj) goes to
    # pinned host memory instead of staying on the device; "none": it stays (jaxllm/parallel/offload.py).
    remat_offload: str = "none"
    # Sequence positions per chunk of the output head's loss (jaxllm/model/head.py); 0: the whole sequence at once.
    loss_chunk: int = 0
    # auto: cudnn on GPUs when computing in bf16/fp16, else xla (see jaxllm.model.visibility.resolve_attention)
    attention: str = "auto"
    # Attention over a sequence split by mesh.context > 1 (jaxllm/parallel/context.py): "all_gather" gathers each
    # layer's keys and values over `context` (KV memory O(T)); "ring" passes key/value blocks around the devices
    # with an online softmax (KV memory O(T / context)). Either runs the einsum attention on each block.
    context_attention: str = "all_gather"
    # False: the training forward runs the stacked layers in an unrolled Python loop (transformer.unroll_layers;
    # within each stage under the pipeline) instead of lax.scan, so XLA can schedule and fuse across layers (on
    # GPUs); compile time grows with depth. Same parameters, checkpoints and results. KV-cache decoding scans.
    scan_layers: bool = True
    # Mixture of experts (jaxllm/model/moe.py; Mixtral, Qwen2-MoE, Qwen3-MoE): num_experts > 0 puts a router and
    # that many gated experts of mlp_dim hidden units each in place of every layer's MLP, experts_per_token of them
    # run per token, their router weights renormalised to sum to 1 when moe_renormalize (Mixtral always; Qwen's
    # norm_topk_prob). 0: a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 2
    moe_renormalize: bool = True
    # A shared expert beside the routed ones (Qwen2-MoE's shared_expert_intermediate_size): a gated MLP of this
    # many hidden units that every token runs, scaled by sigmoid(x @ shared_expert_gate); 0: none.
    moe_shared_mlp_dim: int = 0
    # How tokens reach their experts in training and evaluation: "dropless" (grouped matmuls over ragged groups)
    # or "capacity" (fixed buffers of moe_capacity_factor times an even share of the picks; overflow dropped).
    # Decoding is always dropless.
    moe_dispatch: str = "dropless"
    moe_capacity_factor: float = 1.25
    # How dropless dispatch's picks reach the devices of their experts under mesh.expert > 1
    # (jaxllm/parallel/experts.py): "gather" (the expert group's rows all-gathered, outputs reduce-scattered back),
    # "ragged" (only the picks move, by ragged all-to-all; on XLA:CPU, which lacks the op, an all-gather stands in),
    # "auto": ragged where the backend has the op (GPUs, TPUs) and the expert groups span hosts, else gather
    # (resolve_moe_exchange below says why). The same results either way.
    moe_exchange: str = "auto"
    # Weights of the router's auxiliary losses in the training loss (not in the reported loss, nor the held-out
    # one): load balancing as transformers' router_aux_loss_coef, and the ST-MoE z-loss.
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.0
    # The router's scores: "softmax" over the experts (Mixtral, the Qwens) or "sigmoid", each expert's own
    # (DeepSeek-V3); the chosen experts' scores weight their outputs, renormalised when moe_renormalize.
    moe_router_scores: str = "softmax"
    # Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias in the train state, added to the scores only
    # to choose the experts (never to weight them), moved after every step by this rate times sign(mean load -
    # the expert's load), outside the optimizer; 0: no bias. DeepSeek-V3: 0.001, with sigmoid scores and a tiny
    # auxiliary loss.
    moe_bias_update_rate: float = 0.0
    preset: str = ""

    @property
    def blocks(self) -> Blocks:
        """The optional parts of this family's decoder layer."""
        return FAMILIES[self.family].blocks

    def local_layers(self) -> tuple[bool, ...] | None:
        """Which layers are local (sliding window, local RoPE base), with global ones every `global_every`-th
        (Gemma 3: layers 6, 12, ... global); None when every layer is alike."""
        if not self.global_every:
            return None
        return tuple((i + 1) % self.global_every != 0 for i in range(self.num_layers))

    def check(self) -> None:
        """This section's fields, alone and together (the mesh, precision and pipeline: `check_across`)."""
        check_choice("model.family", self.family, tuple(FAMILIES))
        if self.sliding_window < 0:
            raise ConfigError("model.sliding_window", f"must be >= 0 (0: the whole context), got {self.sliding_window}")
        if self.sliding_window and not self.blocks.sliding_window:
            windowed = [name for name, f in FAMILIES.items() if f.blocks.sliding_window]
            raise ConfigError("model.sliding_window", f"family {self.family!r} has no sliding-window attention "
                                                      f"(families that have: {windowed})")
        if self.global_every < 0 or (self.global_every and not self.blocks.local_global):
            raise ConfigError("model.global_every", f"must be 0, or > 0 for a family with local and global layers "
                                                    f"(family {self.family!r}), got {self.global_every}")
        if self.global_every and not self.sliding_window:
            raise ConfigError("model.global_every", "local layers need a model.sliding_window > 0")
        for key in ("local_rope_theta", "query_pre_attn_scalar"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}", f"must be >= 0 (0: as Llama), got {getattr(self, key)}")
        for key in ("dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
            check_positive(f"model.{key}", getattr(self, key))
        if self.vocab_size != AUTO_VOCAB:
            check_positive("model.vocab_size", self.vocab_size)
        check_positive("model.rope_theta", self.rope_theta)
        self._check_rope_scaling()
        check_positive("model.norm_eps", self.norm_eps)
        check_choice("model.remat", self.remat, REMAT_POLICIES + (AUTO_REMAT,))
        check_choice("model.remat_offload", self.remat_offload, OFFLOADS)
        if self.remat_offload == "host" and self.remat == AUTO_REMAT:
            raise ConfigError("model.remat_offload", "'host' offloads what a named model.remat policy saves, and "
                                                     "model.remat=auto may choose none or full: name the policy")
        if self.remat_offload == "host" and self.remat in ("none", "full"):
            raise ConfigError("model.remat_offload", f"'host' offloads what model.remat saves by name, and "
                                                     f"model.remat={self.remat!r} saves nothing to offload (use "
                                                     f"save_dots, minimal_with_context or save_qkv_proj)")
        if self.loss_chunk < 0:
            raise ConfigError("model.loss_chunk", f"must be >= 0 (0: no chunking), got {self.loss_chunk}")
        check_choice("model.attention", self.attention, ATTENTION_IMPLS)
        check_choice("model.context_attention", self.context_attention, CONTEXT_ATTENTIONS)
        self._check_experts()
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("model.num_kv_heads", f"{self.num_kv_heads} must divide model.num_heads="
                                                    f"{self.num_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ConfigError("model.head_dim", f"must be even for rotary embeddings, got {self.head_dim}")

    def _check_rope_scaling(self) -> None:
        """rope_scaling_factor and rope_original_context go with a rope_scaling that reads them."""
        check_choice("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.rope_scaling == "none":
            for key, unset in (("rope_scaling_factor", 1.0), ("rope_original_context", 0)):
                if getattr(self, key) != unset:
                    raise ConfigError(f"model.{key}", f"is read only with model.rope_scaling set (linear, llama3 or "
                                                      f"yarn), got {getattr(self, key)} with rope_scaling=none")
            return
        if self.rope_scaling_factor < 1:
            raise ConfigError("model.rope_scaling_factor", f"must be >= 1 (how many times the original context the "
                                                           f"model reaches), got {self.rope_scaling_factor}")
        if self.rope_original_context < 0:
            raise ConfigError("model.rope_original_context", f"must be >= 0, got {self.rope_original_context}")
        if self.rope_scaling != "linear" and not self.rope_original_context:
            raise ConfigError("model.rope_original_context", f"model.rope_scaling={self.rope_scaling} needs the "
                                                             f"context the model was trained at (> 0), got "
                                                             f"{self.rope_original_context}")

    def _check_experts(self) -> None:
        if self.num_experts < 0:
            raise ConfigError("model.num_experts", f"must be >= 0 (0: a dense MLP), got {self.num_experts}")
        if bool(self.num_experts) != bool(self.blocks.experts):
            routed = [name for name, f in FAMILIES.items() if f.blocks.experts]
            raise ConfigError("model.num_experts", f"family {self.family!r} " + (
                f"is a mixture of experts: give it num_experts > 0, got {self.num_experts}" if self.blocks.experts
                else f"has a dense MLP: num_experts must be 0 (families with experts: {routed})"))
        if self.blocks.experts_renormalized and not self.moe_renormalize:
            raise ConfigError("model.moe_renormalize", f"family {self.family!r} always renormalises its top-k weights")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError("model.experts_per_token", f"must be between 1 and model.num_experts="
                                                         f"{self.num_experts}, got {self.experts_per_token}")
        if self.moe_shared_mlp_dim < 0 or bool(self.moe_shared_mlp_dim) != self.blocks.shared_expert:
            shared = [name for name, f in FAMILIES.items() if f.blocks.shared_expert]
            raise ConfigError("model.moe_shared_mlp_dim", f"family {self.family!r} " + (
                f"has a shared expert: give it moe_shared_mlp_dim > 0, got {self.moe_shared_mlp_dim}"
                if self.blocks.shared_expert else f"has no shared expert: moe_shared_mlp_dim must be 0 (families "
                                                  f"with one: {shared}), got {self.moe_shared_mlp_dim}"))
        check_choice("model.moe_dispatch", self.moe_dispatch, MOE_DISPATCHES)
        check_choice("model.moe_router_scores", self.moe_router_scores, MOE_ROUTER_SCORES)
        check_choice("model.moe_exchange", self.moe_exchange, MOE_EXCHANGES)
        if self.moe_bias_update_rate < 0 or (self.moe_bias_update_rate and not self.num_experts):
            raise ConfigError("model.moe_bias_update_rate", f"must be >= 0, and 0 without experts (model.num_experts="
                                                            f"{self.num_experts}), got {self.moe_bias_update_rate}")
        check_positive("model.moe_capacity_factor", self.moe_capacity_factor)
        for key in ("moe_aux_loss_coef", "moe_z_loss_coef"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}", f"must be >= 0 (0: off), got {getattr(self, key)}")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Mixed-precision policy: storage of parameters/optimizer state, matmul compute, and logits. `compute`
    "auto" picks bfloat16 where the hardware computes it natively, else float32 (jaxllm/config/auto_precision.py).
    float64 is a reference precision for numerical checks, not for speed: scripts/train.py turns on JAX's 64-bit
    mode for it (jaxllm/runtime/float64.py), and the model keeps its softmaxes, norms and router in float64.
    `loss_scale` (jaxllm/optim/loss_scale.py): "auto" (dynamic for float16 compute, else none), "dynamic", "static:<v>"
    or "none"; the dynamic scale doubles after `loss_scale_growth_interval` consecutive finite steps."""

    params: str = "float32"
    compute: str = "bfloat16"
    output: str = "float32"
    loss_scale: str = "auto"
    loss_scale_growth_interval: int = 2000
    # Quantised weight matmuls in training: "none", "int8" (qwix, forward and backward; jaxllm/model/quant.py), "fp8".
    quant: str = "none"

    def check(self) -> None:
        """The dtypes and the quantisation mode, and that they work together (the loss scale: `check_loss_scale`;
        fp8's backend: `check_quant_backend`)."""
        for key in ("params", "compute", "output"):
            check_choice(f"precision.{key}", getattr(self, key), DTYPES)
        check_choice("precision.quant", self.quant, QUANT_MODES)
        if self.quant != "none" and self.compute == "float16":
            # Measured (qwix 0.1.8, CPU, the default job's first step, loss scaling off): with float16 operands
            # the int8 backward dots give a gradient norm of 0.73 where float32, int8 in float32 and plain float16
            # give 3.21; the fp8 backward dots return float32 gradients for float16 operands, which the step
            # cannot even trace.
            raise ConfigError("precision.quant", f"{self.quant} needs precision.compute float32 or bfloat16 (with "
                                                 f"float16 its backward dots give wrong gradients)")
        if self.quant != "none" and "float64" in (self.params, self.compute):
            raise ConfigError("precision.quant", f"{self.quant} quantises float32 or bfloat16 matmuls, not float64 "
                                                 f"(float64 is the reference precision: quantisation off)")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer, learning-rate schedule, clipping and gradient accumulation."""

    name: str = "adamw"
    lr: float = 3e-4
    schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying at the end
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    grad_accum: int = 1  # "auto" (stored as 0): the fewest micro-batches that fit (jaxllm/plan/auto_fit.py)
    # "host": the optimizer state lives in pinned host memory and streams to the device for the update inside
    # the step (jaxllm/parallel/offload.py); "none": it stays on the device.
    offload: str = "none"
    # "powersgd": gradients cross the `data` mesh axis as rank-`powersgd_rank` PowerSGD factors with error
    # feedback, after `powersgd_start_step` uncompressed steps (jaxllm/optim/powersgd.py); "none": whole, as XLA
    # all-reduces them. 100 uncompressed steps: under AdamW each compressed step of early training costs
    # progress that is never made up (on the default job over data=8, 300 steps, rank 4 from step 10 / 50 / 100
    # ends 14.9% / 5.7% / 3.5% above the uncompressed held-out loss, scripts/bench_powersgd.py); torch's hook
    # likewise starts at step 1000 and advises >= 10% of the run and >= the LR warm-up.
    grad_compression: str = "none"
    powersgd_rank: int = 4
    powersgd_start_step: int = 100
    # ZeRO-1: the optimizer state split over the data-parallel replicas of each parameter (the batch mesh axes
    # data / fsdp / expert it is not split over); the gradients are reduce-scattered, each device updates its
    # share and the new parameters are all-gathered (jaxllm/train/step.py). Parameters stay where RULES put them.
    # On by default (false: each replica keeps and updates a whole copy of the optimizer state).
    zero1: bool = True
    # name="muon" (jaxllm/optim/muon.py): the hidden matrices' momentum (Nesterov) and Newton-Schulz iterations;
    # Keller Jordan's and Moonlight's 0.95 and 5. The other parameters take Adam with b1, b2 and eps above.
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5

    def check(self) -> None:
        """This section's fields (PowerSGD against the mesh: `check_across`)."""
        check_choice("optim.name", self.name, OPTIMIZERS)
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_choice("optim.offload", self.offload, OFFLOADS)
        check_positive("optim.lr", self.lr)
        if self.grad_accum != AUTO_GRAD_ACCUM:
            check_positive("optim.grad_accum", self.grad_accum)
        if self.warmup_steps < 0:
            raise ConfigError("optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError("optim.decay_fraction", f"must be in [0, 1], got {self.decay_fraction}")
        if self.clip_norm < 0:
            raise ConfigError("optim.clip_norm", f"must be >= 0 (0 disables clipping), got {self.clip_norm}")
        check_choice("optim.grad_compression", self.grad_compression, GRAD_COMPRESSIONS)
        check_positive("optim.powersgd_rank", self.powersgd_rank)
        if self.powersgd_start_step < 0:
            raise ConfigError("optim.powersgd_start_step", f"must be >= 0, got {self.powersgd_start_step}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError("optim.muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        check_positive("optim.muon_ns_steps", self.muon_ns_steps)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Length and shape of the run, and what it trains: `objective` "pretrain" (next-token prediction on a token
    store), "sft" (supervised fine-tuning, see SFTConfig), "reward" (a reward model on preference pairs, see
    PreferenceConfig and RewardConfig), "dpo" (direct preference optimisation, see DPOConfig), "grpo" (group
    relative policy optimisation on the policy's own rollouts, see GRPOConfig) or "ppo" (proximal policy
    optimisation with a critic, see PPOConfig). The end-of-run
    greedy sample continues `sample_prompt` (empty: the objective's own prompt) by `sample_tokens` tokens.

    `hang_timeout_s` (0: off): when no step completes for that long (the first step of the loop: twice that),
    every process that notices dumps its threads' stacks and exits with code 75 for the scheduler to requeue
    (jaxllm/runtime/watchdog.py). 30 minutes is far above a healthy step plus what runs between steps (evaluation, a
    checkpoint's blocking part, a rollback's restore) at any scale, and as long as NCCL's own default
    collective timeout; a false alarm costs a requeue, a silent hang the rest of the allocation."""

    objective: str = "pretrain"
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 1
    sample_tokens: int = 48
    sample_prompt: str = ""
    on_anomaly: str = "rollback"
    hang_timeout_s: float = 1800.0
    # optim.grad_accum / model.remat "auto" pick what fits memory_fraction x the device's memory, or x
    # memory_budget_gb (10^9 bytes per device; > 0 stands in for the device's limit, e.g. on a CPU).
    memory_budget_gb: float = 0.0
    memory_fraction: float = 0.9

    def check(self) -> None:
        """This section's fields (the batch against the mesh: `check_across`)."""
        if self.memory_budget_gb < 0:
            raise ConfigError("train.memory_budget_gb", f"must be >= 0 (0: the device's own limit), got "
                                                        f"{self.memory_budget_gb}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError("train.memory_fraction", f"must be in (0, 1], got {self.memory_fraction}")
        for key in ("steps", "batch_size", "seq_len", "eval_every", "log_every"):
            check_positive(f"train.{key}", getattr(self, key))
        if self.eval_batches < 0:
            raise ConfigError("train.eval_batches", f"must be >= 0, got {self.eval_batches}")
        check_choice("train.on_anomaly", self.on_anomaly, ANOMALY_POLICIES)
        if not self.hang_timeout_s >= 0:
            raise ConfigError("train.hang_timeout_s", f"must be >= 0 (0: no hang watchdog), got "
                                                      f"{self.hang_timeout_s}")
        check_choice("train.objective", self.objective, OBJECTIVES)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the token store lives and how it is read.

    `path`: the store (a directory, or an fsspec URL on a cold tier); a run's held-out batches and tokenizer
    come from it. `mixture` (empty: train on `path`): training reads a weighted mixture of stores instead,
    `"PATH:WEIGHT,PATH:WEIGHT,..."`, each with the tokenizer of `path`; each step's share of each store is
    logged as `data/mix/<store>` (jaxllm/data/pipeline.py's MixtureRows: exact per block of 4096 rows, a
    pure function of seed and step). `cache_dir` (empty: off; needed for URLs): every store is read through a
    local cache there, at most `cache_gb` of token chunks, evicted least recently used and shared by the
    node's processes, fetched `prefetch_steps` steps ahead of the loader (jaxllm/data/cold_cache.py)."""

    path: str = "build/data/shakespeare"
    num_workers: int = 0
    mixture: str = ""
    cache_dir: str = ""
    cache_gb: float = 20.0
    prefetch_steps: int = 8

    def check(self) -> None:
        if self.num_workers < 0:
            raise ConfigError("data.num_workers", f"must be >= 0, got {self.num_workers}")
        if not self.cache_gb > 0:
            raise ConfigError("data.cache_gb", f"must be > 0, got {self.cache_gb}")
        if self.prefetch_steps < 0:
            raise ConfigError("data.prefetch_steps", f"must be >= 0, got {self.prefetch_steps}")
        urls = [p for p in [self.path, *(p for p, _ in self.mixture_pairs())] if "://" in p]
        if urls and not self.cache_dir:
            raise ConfigError("data.cache_dir", f"{urls[0]} is a URL: stores on a cold tier are read through a "
                                                f"local cache; set data.cache_dir")

    def mixture_pairs(self) -> list[tuple[str, float]]:
        """`mixture` as [(store, weight), ...] ([] when unset)."""
        if not self.mixture.strip():
            return []
        pairs = []
        for entry in self.mixture.split(","):
            path, sep, weight = entry.strip().rpartition(":")
            try:
                value = float(weight) if sep and path else -1.0
            except ValueError:
                value = -1.0
            if not value > 0:
                raise ConfigError("data.mixture", f"{entry.strip()!r} is not PATH:WEIGHT with a weight > 0")
            pairs.append((path, value))
        return pairs


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in `<workdir>/checkpoints`: async saves every `every` steps, the last `keep` kept plus
    every `keep_every`-th step permanently (0: none). `restore_from` starts a new run from another run's
    checkpoint directory (or one step directory in it): parameters only, or everything with `restore_all`.

    `local_dir` (empty: off) puts a fast local tier in front (jaxllm/runs/tiers.py): saves land there (the last
    `local_keep` kept) and each `persist_every`-th step (0: every save) is copied to `<workdir>/checkpoints` in
    the background, which then keeps `keep` and `keep_every` as above; a resume takes the newest step that
    verifies on either tier."""

    every: int = 100
    keep: int = 3
    keep_every: int = 0
    async_save: bool = True
    restore_from: str = ""
    restore_all: bool = False
    local_dir: str = ""
    local_keep: int = 2
    persist_every: int = 0

    def check(self) -> None:
        """This section's fields (whether `restore_from` exists: `probe_environment`)."""
        check_positive("checkpoint.every", self.every)
        check_positive("checkpoint.keep", self.keep)
        check_positive("checkpoint.local_keep", self.local_keep)
        if self.keep_every < 0:
            raise ConfigError("checkpoint.keep_every", f"must be >= 0, got {self.keep_every}")
        if self.persist_every < 0 or self.persist_every % self.every:
            raise ConfigError("checkpoint.persist_every", f"must be 0 (every save) or a multiple of "
                                                          f"checkpoint.every={self.every}, got {self.persist_every}")


@dataclasses.dataclass(frozen=True)
class AnomalyConfig:
    """Anomaly detection (jaxllm/train/anomaly.py). A non-finite loss or gradient norm is an anomaly, and so is
    a loss spike: on the log scale, more than `z` standard deviations above the mean of the last `window` healthy
    steps (once `min_history` are known) and at least `loss_ratio` times their geometric mean. Gradient-norm
    spikes (`grad_z`, `grad_ratio`, the same way) are counted and reported, and acted on only with
    `act_on_grad_spike` (clipping already bounds them). Without `act_on_loss_spike` loss spikes are only
    reported too (preference losses near zero jump many times over from batch to batch in healthy runs). An
    anomaly is handled per `train.on_anomaly`."""

    window: int = 50
    min_history: int = 20
    z: float = 6.0
    loss_ratio: float = 1.5
    grad_z: float = 6.0
    grad_ratio: float = 4.0
    act_on_grad_spike: bool = False
    act_on_loss_spike: bool = True
    lr_factor: float = 0.5
    max_rollbacks: int = 3

    def check(self) -> None:
        check_positive("anomaly.window", self.window)
        check_positive("anomaly.z", self.z)
        check_positive("anomaly.grad_z", self.grad_z)
        for key in ("loss_ratio", "grad_ratio"):
            if not getattr(self, key) >= 1.0:
                raise ConfigError(f"anomaly.{key}", f"must be >= 1, got {getattr(self, key)}")
        if not 0.0 < self.lr_factor <= 1.0:
            raise ConfigError("anomaly.lr_factor", f"must be in (0, 1], got {self.lr_factor}")
        if self.max_rollbacks < 0:
            raise ConfigError("anomaly.max_rollbacks", f"must be >= 0, got {self.max_rollbacks}")


@dataclasses.dataclass(frozen=True)
class DebugConfig:
    """Fault injection for tests and drills (0: off). Each fires once per process, at that step.

    `hold_at_step`: after step K's metrics are written, the loop waits (up to 10 minutes) for SIGTERM/SIGINT
    before going on, so that a test's signal or kill always lands mid-run however fast the steps are. With several
    processes each holds, then they agree (any signalled: all stop at step K), as a scheduler signals every task.
    `stall_at_step`: the loop waits `stall_s` seconds for step K's metrics, as if step K hung on the devices
    (a drill for `train.hang_timeout_s`; the default outlasts any watchdog timeout worth drilling).
    Seeded pathologies for the diagnosis (scripts/seeded_pathologies.py), pretraining only: `zero_layer` (-1:
    off) starts that layer with every weight zero, a dead layer (all-zero weights get zero gradients, so it
    never trains); `data_sleep_s` sleeps that long before each train batch, a throttled loader; `router_scale`
    (a mixture of experts; 1: off) multiplies the routers' initial weights, a hot router that decides by wide
    margins from the first step (with model.moe_aux_loss_coef=0 its experts collapse: a few take most tokens).
    `kill_in_rollout` (PPO and GRPO): the job's last process SIGKILLs itself in iteration K's rollout, once its
    rows are sampled and before they are scored, while the others wait for it in the rollout's collectives (a
    host lost mid-rollout, for the peer watch; a restart without it resumes).
    `slow_persistent_mb_s` (0: off): the copies to the persistent checkpoint tier (`checkpoint.local_dir`) run at
    most this fast, a throttled shared filesystem (drills and scripts/bench_tiers.py); `slow_cold_mb_s` the
    same for the reads of token stores on a cold tier (`data.cache_dir`; scripts/bench_data.py).
    `emulate_fp8`: accept precision.quant=fp8 on a CPU, where XLA widens the float8 dots to float32: fp8's
    numerics without its speed, for convergence checks (scripts/bench_quant.py).
    """

    inject_nan_at_step: int = 0
    inject_spike_at_step: int = 0
    hold_at_step: int = 0
    stall_at_step: int = 0
    stall_s: float = 3600.0
    zero_layer: int = -1
    data_sleep_s: float = 0.0
    router_scale: float = 1.0
    emulate_fp8: bool = False
    kill_in_rollout: int = 0
    slow_persistent_mb_s: float = 0.0
    slow_cold_mb_s: float = 0.0

    def check(self) -> None:
        """This section's fields (`zero_layer` against the model: `check_across`)."""
        check_positive("debug.stall_s", self.stall_s)
        if not self.data_sleep_s >= 0:
            raise ConfigError("debug.data_sleep_s", f"must be >= 0 seconds, got {self.data_sleep_s}")
        check_positive("debug.router_scale", self.router_scale)
        if not self.slow_cold_mb_s >= 0:
            raise ConfigError("debug.slow_cold_mb_s", f"must be >= 0 MB/s (0: off), got {self.slow_cold_mb_s}")
        if not self.slow_persistent_mb_s >= 0:
            raise ConfigError("debug.slow_persistent_mb_s", f"must be >= 0 MB/s (0: off), got "
                                                            f"{self.slow_persistent_mb_s}")
        if self.kill_in_rollout < 0:
            raise ConfigError("debug.kill_in_rollout", f"must be an iteration >= 0 (0: off), got "
                                                       f"{self.kill_in_rollout}")


@dataclasses.dataclass(frozen=True)
class DiagnosticsConfig:
    """Per-layer statistics (jaxllm/observe/): every `every` steps (0: never) that step runs a second compiled
    variant of the train step, with the same update, that also measures per-layer and per-group norms of
    gradients, parameters and updates, activation statistics and the optimizer's second moments (`diag/...`
    records of metrics.jsonl). The production step is the same program whatever `every` is."""

    every: int = 50

    def check(self) -> None:
        if self.every < 0:
            raise ConfigError("diagnostics.every", f"must be >= 0 (0: off), got {self.every}")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Where each metrics record goes besides `<workdir>/metrics.jsonl` (always written): TensorBoard event files
    in `<workdir>/tb` (tensorboardX, no TensorFlow) with `tensorboard`, and a Weights & Biases run in project
    `wandb_project` with `wandb` (the optional `wandb` extra; offline into `<workdir>/wandb` unless WANDB_MODE
    asks otherwise and an API key is there). See jaxllm/observe/writers.py."""

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "jaxllm"


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A `jax.profiler` trace of `steps` train steps from step `start_step` (0: off) into `<workdir>/profile`
    (TensorBoard's profile plugin / xprof, and Perfetto: perfetto_trace.json.gz). See
    jaxllm/observe/profiler.py."""

    start_step: int = 0
    steps: int = 3

    def check(self) -> None:
        if self.start_step < 0:
            raise ConfigError("profile.start_step", f"must be >= 0 (0: no trace), got {self.start_step}")
        check_positive("profile.steps", self.steps)


# lora.base_quant: how a LoRA run's frozen base kernels are stored (jaxllm/model/base_quant.py)
BASE_QUANTS = ("none", "int8", "nf4")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Adapters of rank `rank` on `targets` (comma-separated projection names), scaled by alpha / rank (alpha /
    sqrt(rank) with `rslora`), with dropout `dropout` on their input. Rank 0 means full fine-tuning (no
    adapters). `base_quant` stores the frozen base's projection kernels quantised: "nf4" (QLoRA) or "int8"
    (jaxllm/model/base_quant.py)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.1
    targets: str = "q_proj,v_proj"
    rslora: bool = False
    base_quant: str = "none"

    @property
    def target_list(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def check(self) -> None:
        if self.rank < 0:
            raise ConfigError("lora.rank", f"must be >= 0 (0: full fine-tuning), got {self.rank}")
        if self.rank and self.alpha <= 0:
            raise ConfigError("lora.alpha", f"must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("lora.dropout", f"must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.target_list if t not in LORA_TARGETS]
        if unknown or (self.rank and not self.target_list):
            raise ConfigError("lora.targets", f"expected a comma-separated subset of {','.join(LORA_TARGETS)}, "
                                              f"got {self.targets!r}")
        check_choice("lora.base_quant", self.base_quant, BASE_QUANTS)
        if self.base_quant != "none" and not self.rank:
            raise ConfigError("lora.base_quant", f"{self.base_quant} stores a frozen base: it needs adapters "
                                                 "(lora.rank > 0); full fine-tuning trains the kernels in float")


ANOMALY_POLICIES = ("rollback", "skip", "abort")
# jaxllm/parallel/schedules.py's SCHEDULES (config sits below parallel, so the names are repeated, and a test
# holds them equal); the last three run the explicit forward-backward.
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1")
EXPLICIT_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline schedule over the `stage` mesh axis: p = mesh.stage stages, m micro-batches, r repeats.

    `schedule` (jaxllm/parallel/schedules.py): "gpipe" (r = 1) and "circular" (r > 1) run the layers as one
    forward scan and differentiate it (every micro-batch's stage inputs live until the backward); "1f1b",
    "interleaved_1f1b" (r > 1) and "zb_h1" run an explicit forward-backward (jaxllm/parallel/scheduled.py) that
    holds at most about p micro-batches per stage. Bubble (p-1)/(r*m+p-1); zb_h1's about a third of 1f1b's.
    "gpipe" with r > 1 is the circular schedule (the name it had before schedules had names).
    """

    microbatches: int = 1
    repeats: int = 1
    schedule: str = "gpipe"

    def check(self) -> None:
        """This section's fields (the schedule against the mesh and the model: `check_across`)."""
        check_positive("pipeline.microbatches", self.microbatches)
        check_positive("pipeline.repeats", self.repeats)
        check_choice("pipeline.schedule", self.schedule, PIPELINE_SCHEDULES)
        if self.schedule in ("circular", "interleaved_1f1b") and self.repeats == 1:
            raise ConfigError("pipeline.repeats", f"schedule {self.schedule!r} runs r > 1 chunks per stage, got 1")
        if self.schedule in ("1f1b", "zb_h1") and self.repeats > 1:
            raise ConfigError("pipeline.repeats", f"schedule {self.schedule!r} runs one chunk per stage, got "
                                                  f"{self.repeats} (interleaved_1f1b takes repeats)")


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Elastic recovery (docs/storage.md): `wait_s` > 0 lets a job whose process died, and did not come back
    within `wait_s` seconds, restart on the survivors (jaxllm/drill/elastic.py drives it), and lets a start on
    fewer devices than the mesh asks for run a smaller mesh: the `data` axis (then `fsdp`) shrinks by the
    missing factor and `optim.grad_accum` grows by it, so each device's micro-batch, the global batch and the
    data order stay those of the whole job (`elastic_shape`). 0: off, a restart waits for every process."""

    wait_s: float = 0.0

    def check(self) -> None:
        if not self.wait_s >= 0:
            raise ConfigError("elastic.wait_s", f"must be >= 0 seconds (0: off), got {self.wait_s}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """lm-evaluation-harness tasks run on the model in training (docs/evaluation.md): every `harness_every` steps
    (0: never) and after the last step, the tasks or groups `harness_tasks` names (comma-separated; task YAMLs
    are looked for in `harness_include_path` besides lm_eval's own), at most `harness_limit` documents each (0:
    all), `harness_batch_size` rows a forward pass. Their metrics go into metrics.jsonl and TensorBoard as
    `harness/<task>/<metric>`. Needs lm_eval (the eval extra) and a language model's objective."""

    harness_every: int = 0
    harness_tasks: str = ""
    harness_include_path: str = "eval_tasks"
    harness_limit: int = 0
    harness_batch_size: int = 16

    def tasks(self) -> list[str]:
        return [t.strip() for t in self.harness_tasks.split(",") if t.strip()]

    def check(self) -> None:
        for key in ("harness_every", "harness_limit"):
            if getattr(self, key) < 0:
                raise ConfigError(f"eval.{key}", f"must be >= 0 (0: {'off' if key == 'harness_every' else 'all'}), "
                                                 f"got {getattr(self, key)}")
        check_positive("eval.harness_batch_size", self.harness_batch_size)
        if self.harness_every and not self.tasks():
            raise ConfigError("eval.harness_tasks", "eval.harness_every needs the tasks to run (comma-separated "
                                                    "names, e.g. jaxllm_pack)")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole validated configuration of a run."""

    mesh: MeshConfig
    model: ModelConfig
    precision: PrecisionConfig
    optim: OptimConfig
    train: TrainConfig
    data: DataConfig
    pipeline: PipelineConfig = PipelineConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    anomaly: AnomalyConfig = AnomalyConfig()
    debug: DebugConfig = DebugConfig()
    diagnostics: DiagnosticsConfig = DiagnosticsConfig()
    lora: LoRAConfig = LoRAConfig()
    sft: SFTConfig = SFTConfig()
    preference: PreferenceConfig = PreferenceConfig()
    reward: RewardConfig = RewardConfig()
    dpo: DPOConfig = DPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    ppo: PPOConfig = PPOConfig()
    rl: RLConfig = RLConfig()
    metrics: MetricsConfig = MetricsConfig()
    profile: ProfileConfig = ProfileConfig()
    elastic: ElasticConfig = ElasticConfig()
    eval: EvalConfig = EvalConfig()
    workdir: str = "runs/pretrain"
    peak_flops: float = 0.0  # per device; 0 means: look it up by device kind
    # XLA compiler flags, name (without the leading --) -> value, put into XLA_FLAGS by the scripts before JAX
    # starts (jaxllm/runtime/xla_flags.py); the GPU presets in configs/gpu/ carry theirs with a reason for each.
    xla_flags: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def apply_preset(cd: ml_collections.ConfigDict, name: str) -> None:
    """Write a named model preset's shape fields into `cd.model` (later overrides still win).

    The GPU-sized presets also switch compute to bfloat16, the policy they are meant to train with.
    """
    if name not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    with cd.unlocked():
        for key, value in PRESETS[name].items():
            cd.model[key] = value
        cd.model.preset = name
        if name in GPU_PRESETS:
            cd.precision.compute = "bfloat16"


def resolve_vocab_size(cfg: Config, tokenizer_size: int, tokenizer: str) -> Config:
    """`cfg` with model.vocab_size "auto" set to `tokenizer_size` rounded up to a multiple of VOCAB_MULTIPLE *
    mesh.tensor; a set vocab_size smaller than the tokenizer's (file `tokenizer`) is a ConfigError."""
    if cfg.model.vocab_size == AUTO_VOCAB:
        multiple = VOCAB_MULTIPLE * cfg.mesh.tensor
        model = dataclasses.replace(cfg.model, vocab_size=-(-tokenizer_size // multiple) * multiple)
        return dataclasses.replace(cfg, model=model)
    if tokenizer_size > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than the tokenizer's "
                                              f"{tokenizer_size} tokens ({tokenizer})")
    return cfg


def elastic_shape(cfg: Config, num_devices: int) -> Config:
    """`cfg` for `num_devices` devices when it asks for more and allows elastic recovery (`elastic.wait_s` > 0):
    the mesh's `data` axis, then `fsdp`, divided by the missing factor and `optim.grad_accum` multiplied by it
    (the global batch and its rows are the config's; each device's micro-batch stays the same). Unchanged
    otherwise."""
    sizes = dict(zip(MESH_AXES, cfg.mesh.shape))
    if not cfg.elastic.wait_s or -1 in sizes.values() or math.prod(sizes.values()) <= num_devices:
        return cfg
    full = math.prod(sizes.values())
    if full % num_devices:
        raise ConfigError("elastic.wait_s", f"the mesh of {full} devices cannot shrink to {num_devices}: not a "
                                            f"divisor")
    missing = full // num_devices
    for axis in ("data", "fsdp"):
        taken = math.gcd(missing, sizes[axis])
        sizes[axis] //= taken
        missing //= taken
    if missing > 1:
        raise ConfigError("elastic.wait_s", f"the mesh {cfg.mesh.shape} cannot shrink to {num_devices} devices on "
                                            f"its data and fsdp axes")
    factor = full // num_devices
    # The hosts are fewer too: the survivors' layout over hosts is laid out anew (the dcn sizes' default).
    hosts = {f"dcn_{axis}": 0 for axis in MESH_AXES}
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **sizes, **hosts),
                               optim=dataclasses.replace(cfg.optim, grad_accum=cfg.optim.grad_accum * factor))


def resolve_mesh(mesh: MeshConfig, num_devices: int) -> MeshConfig:
    """Fill the one axis given as -1 so that the product equals `num_devices`, and check the product."""
    sizes = dict(zip(MESH_AXES, mesh.shape))
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(f"mesh.{fill[1]}", "only one mesh axis may be -1")
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{name}", f"must be a positive size or -1, got {size}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % known:
            raise ConfigError(
                f"mesh.{fill[0]}",
                f"cannot fill: {num_devices} devices are not divisible by the other axes' product {known}"
            )
        sizes[fill[0]] = num_devices // known
    product = math.prod(sizes.values())
    if product != num_devices:
        shape = "x".join(str(sizes[a]) for a in MESH_AXES)
        raise ConfigError("mesh", f"{'*'.join(MESH_AXES)} = {shape} = {product} but there are {num_devices} "
                                  f"devices{_cpu_devices_hint(product, num_devices)}")
    return dataclasses.replace(mesh, **sizes)


def _cpu_devices_hint(wanted: int, found: int) -> str:
    """On a CPU backend with fewer devices than the mesh asks for: how to get them (XLA fakes devices on
    request). JAX is looked up, not imported: a config is checked before anything starts JAX."""
    jax = sys.modules.get("jax")
    if jax is None or found >= wanted or jax.default_backend() != "cpu":
        return ""
    return (f" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={wanted} before the command makes "
            f"{wanted}, as make train does)")


BATCH_AXES = ("data", "fsdp", "expert")  # the axes a batch's rows split over, in order (parallel.sharding.RULES)
DCN_ORDER = ("data", "stage", "fsdp")  # axes that take processes when mesh.dcn_* are unset, in this order


def resolve_dcn(mesh: MeshConfig, num_processes: int) -> MeshConfig:
    """Fill the `dcn_*` sizes for `num_processes` hosts (see `MeshConfig`) and check they fit the axes."""
    given = {a: getattr(mesh, f"dcn_{a}") for a in MESH_AXES}
    for axis, dcn in given.items():
        if dcn < 0:
            raise ConfigError(f"mesh.dcn_{axis}", f"must be >= 0 (0: automatic), got {dcn}")
    sizes = dict(zip(MESH_AXES, mesh.shape))
    if any(given.values()):
        dcn = {a: max(d, 1) for a, d in given.items()}
    else:
        dcn, remaining = dict.fromkeys(MESH_AXES, 1), num_processes
        for axis in DCN_ORDER:
            dcn[axis] = math.gcd(sizes[axis], remaining)
            remaining //= dcn[axis]
        if remaining > 1:
            raise ConfigError(
                "mesh", f"cannot lay {num_processes} processes over data={sizes['data']}, stage={sizes['stage']}, "
                f"fsdp={sizes['fsdp']}; set mesh.dcn_* (their product must be the process count)")
    for axis in MESH_AXES:
        if sizes[axis] % dcn[axis]:
            raise ConfigError(f"mesh.dcn_{axis}", f"{dcn[axis]} does not divide mesh.{axis}={sizes[axis]}")
    if math.prod(dcn.values()) != num_processes:
        shape = "x".join(str(dcn[a]) for a in MESH_AXES)
        raise ConfigError("mesh", f"{'*'.join('dcn_' + a for a in MESH_AXES)} = {shape} but there are "
                          f"{num_processes} processes")
    _check_one_block_of_rows_a_process(sizes, dcn)
    return dataclasses.replace(mesh, **{f"dcn_{a}": d for a, d in dcn.items()})


def _check_one_block_of_rows_a_process(sizes: dict[str, int], dcn: dict[str, int]) -> None:
    """A process loads one contiguous block of each batch's rows (jaxllm/parallel/host_rows.py). The rows split
    over the batch axes in order, each axis host groups first: an axis that crosses hosts after a batch axis
    split within a host would give each process rows strided over the batch."""
    within = None  # the first batch axis split within a host
    for axis in BATCH_AXES:
        if dcn[axis] > 1 and within is not None:
            raise ConfigError(f"mesh.dcn_{axis}", f"{axis} across hosts needs mesh.{within} ({sizes[within]}) "
                                                  f"across hosts too, or 1 (each process loads one block of rows)")
        if sizes[axis] // dcn[axis] > 1:
            within = within or axis


# Each section's own check(); precision's is validate's.
SECTIONS_CHECKED_ALONE = ("model", "optim", "train", "data", "pipeline", "checkpoint", "anomaly", "debug",
                          "diagnostics", "profile", "lora", "elastic", "eval")
def _rollout_devices(cfg: Config, num_devices: int, num_processes: int | None) -> int:
    """The devices an RL run sets aside for its rollouts (RLConfig), checked against the devices there are; a
    plan (no processes) takes the mesh as written."""
    cfg.rl.check()
    aside = cfg.rl.set_aside(cfg.train.objective)
    if not aside or num_processes is None:
        return 0
    if aside % num_processes:
        raise ConfigError("rl.rollout_devices", f"{aside} rollout devices do not split over the {num_processes} "
                                                f"processes (each gives the same number)")
    if cfg.rl.max_staleness and num_processes > 1:
        # The rollout thread's cross-process sums (a collective over every device) would interleave with the
        # trainer's programs in another order on each process.
        raise ConfigError("rl.max_staleness", f"one step off runs on one process for now, not {num_processes}: "
                                              f"use rl.max_staleness=0 (on-policy)")
    if aside >= num_devices:
        raise ConfigError("rl.rollout_devices", f"{aside} of the {num_devices} devices leave none to train")
    return aside


def resolve_moe_exchange(mesh: MeshConfig) -> str:
    """`model.moe_exchange=auto` on `mesh` (its dcn sizes resolved, or 0 for a plan): "ragged" where the backend
    implements `jax.lax.ragged_all_to_all` (not XLA:CPU) and the expert groups span hosts (mesh.dcn_expert > 1),
    else "gather". Across hosts the ragged exchange moves 1.5-4x fewer bytes over the slow links and has been
    reported near their peak; within one host XLA:GPU's has been reported at a few percent of NVLink's bandwidth
    (openxla/xla#33386), where the gather's NCCL collectives run near it."""
    if mesh.dcn_expert <= 1:
        return "gather"
    import jax  # start-up speed: configs load and are checked before JAX does

    return "gather" if jax.default_backend() == "cpu" else "ragged"


def validate(cd: ml_collections.ConfigDict, num_devices: int, check_batch: bool = True,
             num_processes: int | None = 1) -> Config:
    """Turn a ConfigDict into a typed `Config`, raising `ConfigError` on the first problem: each section's own
    `check()`, then `check_across` the sections, the objective's sections, and `probe_environment`.

    `num_devices` is the device count the mesh must cover (for a dry run: the hypothetical cluster), spread over
    `num_processes` processes (None: do not lay the mesh out over hosts, as in a dry run).
    `check_batch=False` skips the batch-versus-mesh checks (a dry run plans parameters and optimizer state).
    """
    cfg = elastic_shape(build(Config, cd, auto=AUTO_VALUES), num_devices)
    mesh = resolve_mesh(cfg.mesh, num_devices - _rollout_devices(cfg, num_devices, num_processes))
    if num_processes is not None:
        mesh = resolve_dcn(mesh, num_processes)
    precision, model = cfg.precision, cfg.model
    if model.moe_exchange == "auto":
        model = dataclasses.replace(model, moe_exchange=resolve_moe_exchange(mesh))
    if precision.compute == "auto":  # resolved here, so everything downstream sees a real dtype
        precision = dataclasses.replace(precision, compute=resolve_compute()[0])
    for name in SECTIONS_CHECKED_ALONE:
        getattr(cfg, name).check()
    precision.check()
    precision = dataclasses.replace(precision, loss_scale=check_loss_scale(precision))
    if not str(cd.get("workdir", "")):
        raise ConfigError("workdir", "must not be empty")
    cfg = dataclasses.replace(cfg, mesh=mesh, model=model, precision=precision, xla_flags=_xla_flags(cfg.xla_flags))
    check_across(cfg, check_batch, num_processes)
    OBJECTIVE_CHECKS[cfg.train.objective](cfg)
    probe_environment(cfg)
    return cfg


def check_across(cfg: Config, check_batch: bool = True, num_processes: int | None = 1) -> None:
    """The checks that tie sections together: the model and the sequence against the mesh and the pipeline, the
    batch against the mesh, accumulation and micro-batches, attention against the compute dtype, PowerSGD against
    the mesh, and the debug faults against the model and the processes."""
    model, mesh, pipeline, train, optim, debug = cfg.model, cfg.mesh, cfg.pipeline, cfg.train, cfg.optim, cfg.debug
    if model.attention == "cudnn" and cfg.precision.compute not in ("bfloat16", "float16"):
        raise ConfigError("model.attention", f"'cudnn' needs precision.compute bfloat16 or float16, got "
                                             f"{cfg.precision.compute!r}")
    _check_model_on_mesh(model, mesh, train.seq_len)
    if cfg.eval.harness_every and train.objective == "reward":
        raise ConfigError("eval.harness_every", "harness tasks evaluate a language model; a reward model has none")
    if model.num_layers % (mesh.stage * pipeline.repeats):
        raise ConfigError("model.num_layers", f"{model.num_layers} layers are not divisible by "
                                              f"mesh.stage*pipeline.repeats={mesh.stage * pipeline.repeats}")
    if mesh.stage > 1 and pipeline.microbatches < mesh.stage:
        raise ConfigError("pipeline.microbatches", f"{pipeline.microbatches} micro-batches cannot fill {mesh.stage} "
                                                   f"stages (need at least mesh.stage)")
    _check_schedule(cfg)
    _check_compression(optim, mesh)
    _check_experts(cfg)
    _check_batch(train.batch_size, mesh, optim.grad_accum, pipeline.microbatches, check_batch)
    if not -1 <= debug.zero_layer < model.num_layers:
        raise ConfigError("debug.zero_layer", f"must be -1 (off) or a layer index below model.num_layers="
                                              f"{model.num_layers}, got {debug.zero_layer}")
    if debug.router_scale != 1 and not model.num_experts:
        raise ConfigError("debug.router_scale", f"scales a mixture of experts' routers; this model has none "
                                                f"(model.num_experts=0), got {debug.router_scale:g}")
    if debug.kill_in_rollout and train.objective not in ("ppo", "grpo"):
        raise ConfigError("debug.kill_in_rollout", f"kills a process in a PPO or GRPO rollout; train.objective is "
                                                   f"{train.objective!r}")
    for key in ("mixture", "cache_dir"):  # the other objectives prepare their own rows into data.path
        if getattr(cfg.data, key) and train.objective != "pretrain":
            raise ConfigError(f"data.{key}", f"reads token stores for pretraining; train.objective is "
                                             f"{train.objective!r}")


def _check_schedule(cfg: Config) -> None:
    """Interleaved 1F1B needs micro-batches in multiples of the stages."""
    pipeline, stages = cfg.pipeline, cfg.mesh.stage
    if pipeline.schedule not in EXPLICIT_SCHEDULES or stages == 1:
        return
    if pipeline.schedule == "interleaved_1f1b" and pipeline.microbatches % stages:
        raise ConfigError("pipeline.microbatches", f"interleaved_1f1b needs a multiple of mesh.stage={stages}, "
                                                   f"got {pipeline.microbatches}")


def _check_experts(cfg: Config) -> None:
    """A mixture of experts' experts take no adapters (yet): refused, not ignored."""
    if not cfg.model.num_experts:
        return
    on_experts = [t for t in cfg.lora.target_list if t in ("gate_proj", "up_proj", "down_proj")]
    if cfg.lora.rank and on_experts:
        raise ConfigError("lora.targets", f"{','.join(on_experts)} are a mixture of experts' projections here "
                                          f"(model.num_experts={cfg.model.num_experts}), which take no adapters: "
                                          f"target the attention (q_proj,k_proj,v_proj,o_proj)")


def _check_model_on_mesh(model: ModelConfig, mesh: MeshConfig, seq_len: int) -> None:
    """Heads, MLP, vocabulary and sequence split over `tensor`, the model dimension over `fsdp`."""
    if model.num_heads % mesh.tensor:
        raise ConfigError("model.num_heads", f"{model.num_heads} heads are not divisible by mesh.tensor={mesh.tensor}")
    if model.num_kv_heads % mesh.tensor:
        raise ConfigError("model.num_kv_heads", f"{model.num_kv_heads} kv heads are not divisible by "
                                                f"mesh.tensor={mesh.tensor}")
    for key in ("mlp_dim", "moe_shared_mlp_dim"):
        if getattr(model, key) % mesh.tensor:
            raise ConfigError(f"model.{key}", f"{getattr(model, key)} is not divisible by mesh.tensor={mesh.tensor}")
    if mesh.sequence_parallel and seq_len % mesh.tensor:
        raise ConfigError("mesh.sequence_parallel", f"splits the sequence over mesh.tensor={mesh.tensor}, which does "
                                                    f"not divide train.seq_len={seq_len}")
    if model.vocab_size % mesh.tensor:  # else embeddings and the head would silently stay whole on every device
        raise ConfigError("model.vocab_size", f"{model.vocab_size} is not divisible by mesh.tensor={mesh.tensor} "
                                              "(pad it, or use model.vocab_size=auto)")
    if mesh.expert > 1 and (not model.num_experts or model.num_experts % mesh.expert):
        raise ConfigError("mesh.expert", f"splits a mixture of experts' experts: model.num_experts="
                                         f"{model.num_experts} must be a positive multiple of mesh.expert="
                                         f"{mesh.expert}")
    if model.dim % mesh.fsdp:
        raise ConfigError("model.dim", f"{model.dim} is not divisible by mesh.fsdp={mesh.fsdp}")
    if mesh.context > 1:
        _check_context(model, mesh, seq_len)


def _check_context(model: ModelConfig, mesh: MeshConfig, seq_len: int) -> None:
    """The sequence splits into 2 * context chunks (each device an early and a late one), and attention is the
    context path's own."""
    if seq_len % (2 * mesh.context):
        raise ConfigError("mesh.context", f"splits train.seq_len={seq_len} into 2 * mesh.context = "
                                          f"{2 * mesh.context} chunks (an early and a late one per device): it must "
                                          "divide it")
    if mesh.sequence_parallel and seq_len % (mesh.context * mesh.tensor):
        raise ConfigError("mesh.sequence_parallel", f"splits the sequence over mesh.context*mesh.tensor="
                                                    f"{mesh.context * mesh.tensor}, which does not divide "
                                                    f"train.seq_len={seq_len}")
    if model.attention not in ("auto", "xla"):
        raise ConfigError("model.attention", f"{model.attention!r} does not run over a split sequence: with "
                                             f"mesh.context={mesh.context} attention is model.context_attention's "
                                             "(set model.attention to auto or xla)")


def _check_compression(optim: OptimConfig, mesh: MeshConfig) -> None:
    if optim.grad_compression != "powersgd":
        return
    if mesh.data == 1:
        raise ConfigError("optim.grad_compression", "powersgd compresses gradients across mesh.data, which is 1: "
                                                    "nothing to compress (use none)")


def _check_batch(batch_size: int, mesh: MeshConfig, grad_accum: int, microbatches: int, check_batch: bool) -> None:
    """The batch splits over the batch-sharded axes, into accumulation and pipeline micro-batches."""
    batch_shards = mesh.batch_shards if check_batch else 1
    if batch_size % batch_shards:
        raise ConfigError("train.batch_size", f"{batch_size} is not divisible by "
                                              f"mesh.data*mesh.fsdp*mesh.expert={batch_shards}")
    accum = max(grad_accum, 1)  # "auto" chooses among the counts that split the batch
    if batch_size % (accum * batch_shards):
        raise ConfigError("optim.grad_accum", f"train.batch_size={batch_size} does not split into {grad_accum} "
                                              f"micro-batches divisible by "
                                              f"mesh.data*mesh.fsdp*mesh.expert={batch_shards}")
    if check_batch and batch_size % (microbatches * accum):
        raise ConfigError("pipeline.microbatches", f"train.batch_size={batch_size} does not split into "
                                                   f"{microbatches} pipeline micro-batches (times "
                                                   f"optim.grad_accum={grad_accum})")


def probe_environment(cfg: Config) -> None:
    """What the config names outside itself: a checkpoint to start from, a reward model, the wandb package, a
    backend that runs fp8."""
    if cfg.checkpoint.restore_from and not Path(cfg.checkpoint.restore_from).exists():
        raise ConfigError("checkpoint.restore_from", f"no checkpoint at {cfg.checkpoint.restore_from}")
    rollouts = getattr(cfg, cfg.train.objective, None)  # an RL objective's section is named after it
    if isinstance(rollouts, RolloutConfig):
        rollouts.probe_reward_model(cfg.train.objective)
    if cfg.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.wandb", "needs the wandb package: pip install 'jaxllm[wandb]' (or set it false)")
    check_quant_backend(cfg.precision, cfg.debug.emulate_fp8)


def check_quant_backend(precision: PrecisionConfig, emulate_fp8: bool = False) -> None:
    """fp8 needs a GPU, unless `emulate_fp8` (debug.emulate_fp8) runs its numerics on a CPU."""
    if precision.quant == "fp8" and not emulate_fp8:
        import jax  # start-up speed: configs load and are checked before JAX does

        backend = jax.default_backend()
        if backend != "gpu":
            raise ConfigError("precision.quant", f"fp8 needs a GPU (this run's backend is {backend}); use int8 or none "
                                                 "(debug.emulate_fp8=true runs its numerics on a CPU, slowly)")


def resolve_loss_scale(spec: str, compute: str) -> str:
    """`precision.loss_scale` with "auto" resolved for `compute`, checked; a malformed one is a ConfigError."""
    none, static, dynamic = LOSS_SCALE_MODES
    if spec == "auto":
        return dynamic if compute == "float16" else none
    if spec in (none, dynamic):
        return spec
    kind, _, value = spec.partition(":")
    try:
        scale = float(value) if kind == static else math.nan
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError("precision.loss_scale", f"expected auto, dynamic, none or static:<positive scale>, "
                                                  f"got {spec!r}")
    return spec


def check_loss_scale(precision: PrecisionConfig) -> str:
    """`precision.loss_scale` resolved (`resolve_loss_scale`) once both loss-scaling keys are checked."""
    if precision.loss_scale_growth_interval <= 0:
        raise ConfigError("precision.loss_scale_growth_interval",
                          f"must be positive, got {precision.loss_scale_growth_interval}")
    return resolve_loss_scale(precision.loss_scale, precision.compute)


XLA_FLAG_NAME = re.compile(r"xla_[a-z0-9_]+")


def _xla_flags(flags) -> dict:
    """The `xla_flags` section as a plain dict; names and value types checked here, the names themselves against
    the installed XLA by the scripts (jaxllm.runtime.xla_flags.check_xla_flags)."""
    for name, value in flags.items():
        if not XLA_FLAG_NAME.fullmatch(name):
            raise ConfigError(f"xla_flags.{name}", "expected an XLA flag name (xla_..., without the leading --)")
        if not isinstance(value, (bool, int, float, str)):
            raise ConfigError(f"xla_flags.{name}", f"expected a bool, number or string, got {value!r}")
    return dict(flags.items())


def default_config_dict() -> ml_collections.ConfigDict:
    """A ConfigDict holding every field with its dataclass default; config files start from it."""
    sections = dict(mesh=MeshConfig, model=ModelConfig, precision=PrecisionConfig, optim=OptimConfig,
                    train=TrainConfig, data=DataConfig, pipeline=PipelineConfig, checkpoint=CheckpointConfig,
                    anomaly=AnomalyConfig, debug=DebugConfig, diagnostics=DiagnosticsConfig, lora=LoRAConfig,
                    sft=SFTConfig, preference=PreferenceConfig, reward=RewardConfig, dpo=DPOConfig, grpo=GRPOConfig,
                    ppo=PPOConfig, rl=RLConfig, metrics=MetricsConfig, profile=ProfileConfig,
                    elastic=ElasticConfig, eval=EvalConfig)
    cd = ml_collections.ConfigDict({name: dataclasses.asdict(cls()) for name, cls in sections.items()})
    cd.workdir = Config.workdir
    cd.peak_flops = Config.peak_flops
    cd.xla_flags = ml_collections.ConfigDict()
    return cd
