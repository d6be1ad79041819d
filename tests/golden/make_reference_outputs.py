"""Writes tests/golden/reference/: tiny inputs and what transformers, PEFT and TRL make of them, so the parity
tests run without torch (Python 3.12, where no CPU torch wheel can be installed).

    python tests/golden/make_reference_outputs.py            # rewrite tests/golden/reference/
    python tests/golden/make_reference_outputs.py --out DIR  # write elsewhere (tests/test_golden_files.py)

Needs the Python 3.11 test environment (torch, transformers, peft and trl at the versions pyproject.toml pins).
This script is the only writer of tests/golden/reference/; rerun it and commit the result when a reference
library is upgraded and tests/test_golden_files.py reports a difference. Everything is seeded, so a rerun with
the same libraries writes the same values. The files (float32 weights and inputs, float64 TRL outputs):

  llama/        LlamaForCausalLM (GQA 4, head_dim 6, Llama-3 RoPE scaling, untied, randomised norms):
                config.json, model.safetensors; reference.npz: ids, logits, greedy prompts / tokens of
                `generate`, and summed continuation log-probs of (context, continuation) pairs
  llama_tied/   a tied, multi-head (no GQA) LlamaForCausalLM: config.json, model.safetensors; reference.npz
  lora/         a PEFT LoRA adapter (all seven targets) on llama/: adapter_config.json,
                adapter_model.safetensors; reference.npz: the PEFT model's logits on llama's ids and the
                tensors merge_and_unload changes (every other tensor it leaves equal to llama's)
  trl/          cases.json (the loss, its arguments, its inputs' key); reference.npz: the inputs and TRL's
                outputs (DPO / robust DPO, IPO, Bradley-Terry, GRPO)
  MANIFEST.json every file's size and sha256 (tests/test_golden_files.py checks them)
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REFERENCE = Path(__file__).resolve().parent / "reference"

LLAMA = dict(vocab_size=64, hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=6, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
             tie_word_embeddings=False, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
LLAMA_TIED = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=True)
LORA = dict(r=8, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
NEW_TOKENS = 8
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42]]
# (context, continuation) pairs scored by summed log-probs, as jaxllm.eval.evaluate.continuation_logprobs does.
PAIRS = [([1, 17, 33], [9]), ([1, 4], [50, 2, 61, 7]), ([3, 3, 3, 3, 3, 3, 3, 3], [12, 40])]
GREEDY_MARGIN = 1e-3  # greedy steps need a top-1 / top-2 logit gap well above the tests' 1e-4 logits tolerance

P = 64  # preference pairs
B, T = 6, 12  # GRPO rows and completion length
INVALID_LOGPROB = 1.0  # TRL's padding value for log-probs
GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")


# ---------------------------------------------------------------------------------------------- models


def _llama(kwargs, seed):
    """A LlamaForCausalLM from `kwargs`, seeded, with its norms randomised (HF starts them at one)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _save(model, path: Path) -> None:
    model.save_pretrained(path)
    (path / "generation_config.json").unlink(missing_ok=True)  # not read by jaxllm


def _greedy(model):
    """transformers' greedy `generate` of NEW_TOKENS per prompt, checked against the argmax of full forward
    passes with a clear margin at every step (so float32 differences cannot flip a token)."""
    import torch

    tokens = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=0)
        new = out[0, len(prompt):].tolist()
        assert len(new) == NEW_TOKENS, new
        logits = _logits(model, [prompt + new])[0, len(prompt) - 1:-1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert (logits.argmax(-1) == new).all() and (top2[:, 1] - top2[:, 0] > GREEDY_MARGIN).all(), prompt
        tokens.append(new)
    lengths = [len(p) for p in PROMPTS]
    flat = np.zeros((len(PROMPTS), max(lengths)), np.int64)
    for i, p in enumerate(PROMPTS):
        flat[i, : len(p)] = p
    return dict(prompts=flat, prompt_lengths=np.asarray(lengths), greedy_tokens=np.asarray(tokens))


def _continuation_logprobs(model):
    """Summed float64 log-probs of each continuation given its context, from transformers' logits."""
    import torch

    out = []
    for ctx, cont in PAIRS:
        logits = torch.from_numpy(_logits(model, [ctx + cont])[0]).double()
        lp = torch.log_softmax(logits, dim=-1).numpy()
        out.append(sum(lp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))
    width = max(len(c) + len(x) for c, x in PAIRS)
    flat = np.zeros((len(PAIRS), width), np.int64)
    for i, (ctx, cont) in enumerate(PAIRS):
        flat[i, : len(ctx) + len(cont)] = ctx + cont
    return dict(pair_tokens=flat, pair_context_lengths=np.asarray([len(c) for c, _ in PAIRS]),
                pair_lengths=np.asarray([len(c) + len(x) for c, x in PAIRS]), pair_logprobs=np.asarray(out))


def write_llama(out: Path) -> None:
    """llama/ and llama_tied/: weights, config, logits; llama/ also greedy tokens and continuation log-probs."""
    ids = np.random.default_rng(0).integers(0, LLAMA_TIED["vocab_size"], size=(2, 12))
    for name, kwargs, seed in (("llama", LLAMA, 0), ("llama_tied", LLAMA_TIED, 1)):
        model = _llama(kwargs, seed)
        _save(model, out / name)
        arrays = dict(ids=ids, logits=_logits(model, ids))
        if name == "llama":
            arrays.update(_greedy(model), **_continuation_logprobs(model))
        np.savez(out / name / "reference.npz", **arrays)


def write_lora(out: Path) -> None:
    """lora/: a PEFT adapter with non-zero A and B on llama/, its logits and merge_and_unload's changed tensors."""
    import peft
    import torch
    from safetensors.numpy import load_file

    base = _llama(LLAMA, 0)
    torch.manual_seed(2)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**LORA)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: make the adapters matter
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out / "lora")
    (out / "lora" / "README.md").unlink(missing_ok=True)  # PEFT's model card
    config_file = out / "lora" / "adapter_config.json"  # PEFT writes target_modules in set order: made stable
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(dict(config, target_modules=sorted(config["target_modules"])), indent=2) + "\n")
    ids = np.load(out / "llama" / "reference.npz")["ids"]
    logits = _logits(model, ids)
    assert not np.allclose(logits, _logits(base, ids), atol=1e-2), "the adapters must change the model"
    merged = {k: v.numpy() for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}
    base_tensors = load_file(out / "llama" / "model.safetensors")
    assert sorted(merged) == sorted(base_tensors)
    changed = {k: v for k, v in merged.items() if not np.array_equal(v, base_tensors[k])}
    assert sorted(changed) == sorted(k for k in merged if k.split(".")[-2] in LORA["target_modules"]), changed
    np.savez(out / "lora" / "reference.npz", ids=ids, logits=logits, **{f"merged.{k}": v for k, v in changed.items()})


# ------------------------------------------------------------------------------------------------- TRL


def _t64(*arrays):
    import torch

    return [torch.from_numpy(np.asarray(a, np.float64)) for a in arrays]


def _trl_dpo(logps, **kw):
    """TRL's FusedLinearDPOFunction.preference_loss_fn on one chunk, in float64: mean loss, per-pair rewards."""
    import torch
    from trl.losses.dpo_loss import FusedLinearDPOFunction

    pc, pr, rc, rr = _t64(*logps)
    full_target = torch.zeros(2 * P, 1)  # only its shape[0] // 2 = n_pairs is read
    loss, cr, rj = FusedLinearDPOFunction.preference_loss_fn(pc, pr, full_target, rc, rr, **kw)
    return dict(loss=np.float64(loss.item()), chosen_rewards=cr.numpy(), rejected_rewards=rj.numpy())


def _trl_ipo(logps, lengths, beta):
    """TRL 1.13.0 DPOTrainer._compute_loss's "ipo" branch (trl/trainer/dpo_trainer.py lines 1435-1440,
    1478-1489, 1672-1673), transcribed: it only runs inside a whole trainer. Per-pair losses and rewards."""
    import torch

    chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps = _t64(*logps)
    completion_mask = torch.from_numpy((np.arange(40) < np.concatenate(lengths)[:, None]).astype(np.float64))
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
    chosen_avg_score = chosen_logratios / chosen_mask.sum(dim=1).clamp(min=1.0)
    rejected_avg_score = rejected_logratios / rejected_mask.sum(dim=1).clamp(min=1.0)
    per_sequence_loss = (chosen_avg_score - rejected_avg_score - 1 / (2 * beta)) ** 2
    return dict(losses=per_sequence_loss.numpy(), chosen_rewards=(beta * chosen_logratios).numpy(),
                rejected_rewards=(beta * rejected_logratios).numpy())


def _trl_bradley_terry(rc, rr, margin, center):
    """TRL 1.13.0 RewardTrainer.compute_loss's formula (trl/trainer/reward_trainer.py lines 760-766), float64."""
    import torch

    chosen, rejected = _t64(rc, rr)
    diff = chosen - rejected - (_t64(margin)[0] if margin is not None else 0.0)
    loss = -torch.nn.functional.logsigmoid(diff).mean()
    if center is not None:
        loss += center * torch.mean((chosen + rejected) ** 2)
    return dict(loss=np.float64(loss.item()))


def _grpo_batch(seed):
    """float32 [B, T] ragged mask (row 0 full, the last row one token) and log-probs with TRL's padding value,
    and [B] advantages."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0], lengths[-1] = T, 1
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    logp = -rng.uniform(0.05, 4.0, (B, T))
    old = logp + rng.normal(0, 0.3, (B, T))  # ratios spread past 1 +- 0.28, so some tokens clip
    ref = logp + rng.normal(0, 0.5, (B, T))

    def pad(x):
        return np.where(mask > 0, x, INVALID_LOGPROB).astype(np.float32)

    return dict(mask=mask, logp=pad(logp), old=pad(old), ref=pad(ref),
                advantages=rng.normal(0, 1, B).astype(np.float32))


def _trl_grpo(batch, **kw):
    """TRL 1.13.0's FusedLinearGRPOFunction.ppo_loss_fn (token-level importance sampling), float64: loss and,
    with beta, its first metric (the masked mean of the k3 KL)."""
    import torch
    from trl.losses.grpo_loss import FusedLinearGRPOFunction

    t = {k: torch.from_numpy(np.asarray(batch[k], np.float64)) for k in batch}
    loss, metrics = FusedLinearGRPOFunction.ppo_loss_fn(
        per_token_logps=t["logp"], attention_mask=t["mask"], advantages=t["advantages"],
        full_attention_mask=t["mask"], ref_per_token_logps=t["ref"], old_per_token_logps=t["old"],
        epsilon_low=0.2, max_completion_length=T + 4, **kw)  # T + 4: dr_grpo divides by the configured maximum
    out = dict(loss=np.float64(loss.item()))
    if kw["beta"]:
        out["kl"] = np.float64(metrics[0].item())
    return out


def write_trl(out: Path) -> None:
    """trl/: the inputs, cases.json and TRL's outputs for each case."""
    rng = np.random.default_rng(1)
    inputs = dict(logps=-rng.uniform(5, 60, size=(4, P)).astype(np.float32),
                  ipo_lengths=rng.integers(0, 41, size=(2, P)), rewards=rng.normal(0.5, 2.0, (3, P)).astype(np.float32))
    inputs["ipo_lengths"][:, :2] = 0  # both sides clamp a zero length to one
    inputs["rewards"][2] = np.abs(inputs["rewards"][2])  # margins
    for seed in (0, 3):
        inputs.update({f"grpo{seed}.{k}": v for k, v in _grpo_batch(seed).items()})
    cases, arrays = [], dict(inputs)

    def add(name, loss, kwargs, result, data=None):
        cases.append(dict(name=name, loss=loss, kwargs=kwargs, data=data))
        arrays.update({f"{name}.{k}": v for k, v in result.items()})

    logps = inputs["logps"]
    flipped = logps[[1, 0, 3, 2]]
    for beta in (0.1, 0.5):
        for loss_type, ls in (("sigmoid", 0.0), ("robust", 0.0), ("robust", 0.1), ("robust", 0.3)):
            kw = dict(beta=beta, loss_type=loss_type, label_smoothing=ls)
            add(f"dpo_{loss_type}_ls{ls}_beta{beta}", "dpo", kw, _trl_dpo(logps, **kw))
        # TRL's sigmoid ignores label_smoothing: cDPO is (1 - ls) L(chosen, rejected) + ls L(rejected, chosen).
        add(f"dpo_sigmoid_flipped_beta{beta}", "dpo_flipped", dict(beta=beta), _trl_dpo(flipped, beta=beta))
        for with_lengths in (True, False):
            lengths = inputs["ipo_lengths"] if with_lengths else np.ones((2, P), np.int64)
            add(f"ipo_lengths{int(with_lengths)}_beta{beta}", "ipo", dict(beta=beta, with_lengths=with_lengths),
                _trl_ipo(logps, lengths, beta))
    rc, rr, m = inputs["rewards"]
    for margin in (False, True):
        for center in (None, 0.01):
            add(f"bt_margin{int(margin)}_center{center}", "bradley_terry", dict(margin=margin, center_coef=center),
                _trl_bradley_terry(rc, rr, m if margin else None, center))
    for seed in (0, 3):
        batch = {k: inputs[f"grpo{seed}.{k}"] for k in ("mask", "logp", "old", "ref", "advantages")}
        for loss_type in GRPO_LOSS_TYPES:
            for beta in (0.0, 0.04):
                for eps_high in (0.2, 0.28):
                    kw = dict(loss_type=loss_type, beta=beta, epsilon_high=eps_high)
                    add(f"grpo{seed}_{loss_type}_beta{beta}_eps{eps_high}", "grpo",
                        dict(kw, max_completion_length=T + 4), _trl_grpo(batch, **kw), data=f"grpo{seed}")
    (out / "trl").mkdir()
    (out / "trl" / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")
    np.savez(out / "trl" / "reference.npz", **arrays)


# ---------------------------------------------------------------------------------------------- driver


def manifest(root: Path) -> dict:
    """{relative path: {"bytes", "sha256"}} of every file under `root` but MANIFEST.json."""
    return {str(p.relative_to(root)): dict(bytes=p.stat().st_size, sha256=hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "MANIFEST.json"}


def write_reference(out: Path) -> None:
    """Write every reference file into `out` (which must not exist yet), then its MANIFEST.json."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order on every machine
    try:
        out.mkdir(parents=True)
        write_llama(out)
        write_lora(out)
        write_trl(out)
    finally:
        torch.set_num_threads(threads)
    (out / "MANIFEST.json").write_text(json.dumps(manifest(out), indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REFERENCE, help=f"output directory (default {REFERENCE})")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="golden-"))
    try:  # written aside, then swapped in: a failure leaves the old files as they were
        write_reference(tmp / "reference")
        if args.out.exists():
            shutil.rmtree(args.out)
        shutil.copytree(tmp / "reference", args.out)
    finally:
        shutil.rmtree(tmp)
    total = sum(f["bytes"] for f in json.loads((args.out / "MANIFEST.json").read_text()).values())
    print(f"wrote {args.out}: {total:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
