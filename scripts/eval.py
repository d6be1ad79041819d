"""Evaluate a model: `python scripts/eval.py (--checkpoint DIR | --hf DIR) [--data STORE] [--choices FILE.jsonl]`.

--data STORE     held-out perplexity on a token store's split (token-weighted over loss_mask, packing-aware);
                 (with --checkpoint and no --choices it defaults to the training data store the checkpoint records)
--choices FILE   multiple-choice accuracy; JSON lines {"question", "choices": [...], "answer": index}, each
                 choice scored by the summed log-likelihood of its tokens after the question (also normalised
                 per character: mc_accuracy_norm, and per token: mc_accuracy_per_token)
Prints one JSON object.
"""

import json
import sys
from pathlib import Path

from jaxllm.cli import fail, parser


def main(argv):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="jaxllm checkpoint (workdir, checkpoints dir or step dir)")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--hf", default=None, help="Hugging Face model directory")
    p.add_argument("--data", default=None, help="token store for perplexity")
    p.add_argument("--split", default="eval")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_batches", type=int, default=None)
    p.add_argument("--choices", default=None, help="multiple-choice JSON-lines file")
    p.add_argument("--tokenizer", default=None, help="sentencepiece tokenizer.model (for --choices)")
    args = p.parse_args(argv)
    if (args.checkpoint is None) == (args.hf is None):
        fail("pass exactly one of --checkpoint and --hf")
    for name in ("seq_len", "batch_size"):
        if getattr(args, name) <= 0:
            fail(f"--{name} must be positive")

    from flax import nnx

    from jaxllm import evaluate, hf
    from jaxllm.checkpoint import CheckpointError
    from jaxllm.data.tokenizer import Tokenizer

    mesh = evaluate.single_device_mesh()
    recorded_data, tokenizer_file = None, None
    try:
        if args.checkpoint is not None:
            loaded = evaluate.load_checkpoint(args.checkpoint, args.step, mesh)
            graphdef, params = loaded.graphdef, loaded.params
            recorded_data = (loaded.config.get("data") or {}).get("path")
            tokenizer_file = loaded.tokenizer_path()
        else:
            graphdef, params = nnx.split(hf.from_pretrained(args.hf, mesh=mesh))
            if (Path(args.hf) / "tokenizer.model").is_file():
                tokenizer_file = Path(args.hf) / "tokenizer.model"
    except (FileNotFoundError, ValueError, CheckpointError, NotImplementedError) as exc:
        fail(str(exc))
    data = args.data or (recorded_data if args.choices is None else None)
    if data is None and args.choices is None:
        fail("nothing to evaluate: pass --data STORE and/or --choices FILE")
    if data is not None and args.tokenizer is None and (Path(data) / "tokenizer.model").is_file():
        tokenizer_file = Path(data) / "tokenizer.model"
    if args.tokenizer is not None:
        tokenizer_file = Path(args.tokenizer)

    result = {}
    try:
        if data is not None:
            ppl = evaluate.perplexity(graphdef, params, mesh, data, split=args.split, seq_len=args.seq_len,
                                      batch_size=args.batch_size, max_batches=args.max_batches)
            result.update(ppl)
        if args.choices is not None:
            if tokenizer_file is None or not Path(tokenizer_file).is_file():
                fail("--choices needs a tokenizer: pass --tokenizer FILE")
            items = evaluate.read_choices(args.choices)
            result.update(evaluate.multiple_choice(graphdef, params, mesh, Tokenizer.load(tokenizer_file), items))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        fail(str(exc))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
