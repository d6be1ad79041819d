"""Convert between Hugging Face directories (Llama, Qwen2, Qwen3, Mistral, Gemma 3:
docs/models.md) and jaxllm checkpoints.

  python scripts/convert_hf.py import --hf DIR --out CKPT_DIR [--dtype float32]
      Writes step 0 of a jaxllm checkpoint (parameters from DIR, a fresh AdamW state) that a run can start
      from with `--config.checkpoint.restore_from=CKPT_DIR` (use a matching --config.model.*). A
      *ForSequenceClassification directory (one label) becomes a reward-model checkpoint.
  python scripts/convert_hf.py export --checkpoint CKPT [--step N] --out DIR [--adapter_only]
      CKPT is a run's workdir, its checkpoints directory or one step directory; the model config is read from
      the checkpoint's metadata and only the parameters are read. DIR loads with
      `transformers.AutoModelForCausalLM.from_pretrained` (a reward model's with
      `AutoModelForSequenceClassification`: the family's *ForSequenceClassification, pad_token_id the
      tokenizer's). A LoRA fine-tuning run is exported merged into its base, or with --adapter_only as the
      adapter alone in PEFT's format (`peft.PeftModel.from_pretrained`).
      The run's tokenizer is written beside it (jaxllm/interop/tokenizer_export.py): `AutoTokenizer` on DIR
      gives the run's own ids, BOS first (a sentencepiece model also as a tokenizer.json); config.json records
      the tokenizer's bos/eos/pad ids, so `generate` stops at the run's EOS.
"""

import dataclasses
import sys
from pathlib import Path

from jaxllm.config.cli import fail, parser


def do_import(args) -> int:
    import jax
    from flax import nnx

    from jaxllm.interop import hf
    from jaxllm.runs.checkpoint import Checkpointer, CheckpointError
    from jaxllm.config.schema import OptimConfig, PrecisionConfig
    from jaxllm.data.tokenizer import find_tokenizer_file
    from jaxllm.parallel.mesh import single_device_mesh
    from jaxllm.model.reward import RewardModel
    from jaxllm.optim.chain import make_optimizer
    from jaxllm.objectives.pretrain import lm_objective
    from jaxllm.objectives.reward import reward_model_objective
    from jaxllm.train.state import init_objective_state

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        fail(f"--out {out} exists and is not empty")
    try:
        model = hf.from_pretrained(args.hf, dtype=args.dtype)
    except (FileNotFoundError, ValueError, NotImplementedError, KeyError) as exc:
        fail(str(exc))
    cfg = model.cfg
    if model.rope_scaling is not None:  # the run config records it (model.rope_scaling), where it can
        fields = model.rope_scaling.model_config_fields()
        if fields is None:
            fail(f"{args.hf} uses a RoPE scaling that model.rope_scaling cannot spell ({model.rope_scaling}); "
                 "not converted")
        cfg = dataclasses.replace(cfg, **fields)
    precision = PrecisionConfig(params=args.dtype)
    optim = OptimConfig()
    tx = make_optimizer(optim, 1)
    mesh = single_device_mesh()
    reward = isinstance(model, RewardModel)
    objective = (reward_model_objective if reward else lm_objective)(cfg, precision)
    with jax.set_mesh(mesh):
        state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed=0)
        params = jax.device_put(nnx.state(model, nnx.Param), shardings.params)
        state = state.replace(params=params, opt_state=jax.jit(tx.init, out_shardings=shardings.opt_state)(params))
    meta = {"config": {"model": dataclasses.asdict(cfg), "precision": dataclasses.asdict(precision),
                       "optim": dataclasses.asdict(optim), "train": {"objective": "reward" if reward else "pretrain"}},
            "source": str(Path(args.hf).absolute())}
    tokenizer = find_tokenizer_file(args.hf)
    if tokenizer is not None:
        meta["tokenizer"] = str(tokenizer.absolute())
    try:
        checkpointer = Checkpointer(out, keep=1, log=lambda *_: None)
        checkpointer.save(0, state, {}, meta)
        checkpointer.wait()
        checkpointer.close()
    except CheckpointError as exc:
        fail(str(exc))
    print(f"wrote {out.absolute()}/0 ({sum(x.size for x in jax.tree.leaves(params)):,} parameters) from {args.hf}")
    return 0


def do_export(args) -> int:
    from jaxllm.interop import hf
    from jaxllm.interop.tokenizer_export import save_tokenizer
    from jaxllm.runs.checkpoint import CheckpointError
    from jaxllm.runs.loader import load_checkpoint

    try:
        loaded = load_checkpoint(args.checkpoint, args.step)
    except (FileNotFoundError, ValueError, CheckpointError) as exc:
        fail(str(exc))
    if args.adapter_only and loaded.model.lora is None:
        fail(f"--adapter_only: {loaded.path} holds a whole model, not LoRA adapters")
    tokenizer, ids = loaded.tokenizer_path(), {"pad_token_id": 0}  # without a tokenizer: jaxllm's pad id
    if tokenizer is not None:  # written first: a tokenizer that cannot be exported stops before the weights
        try:
            tok = save_tokenizer(tokenizer, args.out)
        except (FileNotFoundError, ValueError) as exc:
            fail(str(exc))
        ids = {"pad_token_id": tok.pad_id, "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    hf.save_pretrained(loaded.model, args.out, max_shard_bytes=args.max_shard_bytes, adapter_only=args.adapter_only,
                       **ids)
    print(f"wrote {Path(args.out).absolute()} from {loaded.path}")
    return 0


def main(argv):
    p = parser(__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command")
    imp = sub.add_parser("import", help="Hugging Face directory -> jaxllm checkpoint")
    imp.add_argument("--hf", required=True)
    imp.add_argument("--out", required=True)
    imp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    exp = sub.add_parser("export", help="jaxllm checkpoint -> Hugging Face directory")
    exp.add_argument("--checkpoint", required=True)
    exp.add_argument("--step", type=int, default=None)
    exp.add_argument("--out", required=True)
    exp.add_argument("--max_shard_bytes", type=int, default=None)
    exp.add_argument("--adapter_only", action="store_true", help="a LoRA run's adapter alone, in PEFT's format")
    for sp in (imp, exp):  # subcommand usage errors follow the one-line convention too
        sp.error = lambda message: fail(message)
    args = p.parse_args(argv)
    if args.command is None:
        fail("expected a command: import or export")
    return do_import(args) if args.command == "import" else do_export(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
