"""Evaluate a model: `python scripts/eval.py (--checkpoint DIR | --hf DIR) [--data STORE] [--choices FILE.jsonl]
[--task FILE.jsonl] [--reward FILE.jsonl]`.

--data STORE     held-out perplexity on a token store's split (token-weighted over loss_mask, packing-aware);
                 (with --checkpoint and no --choices it defaults to the training data store the checkpoint records)
--choices FILE   multiple-choice accuracy; JSON lines {"question", "choices": [...], "answer": index}, each
                 choice scored by the summed log-likelihood of its tokens after the question (also normalised
                 per character: mc_accuracy_norm, and per token: mc_accuracy_per_token)
--task FILE      generation task, as SFT reports it: JSON lines {"prompt", "response"} or {"messages": [...]} (an
                 optional "task" groups them), rendered with --template (default: the checkpoint's sft.template,
                 else alpaca); greedy responses of up to --max_new_tokens are scored by exact match and sacrebleu's
                 corpus BLEU, per task and over all ("task" in the output)
--reward FILE    pair accuracy of a reward model (a reward run's checkpoint, or a LlamaForSequenceClassification
                 --hf directory) on preference pairs: JSON lines {"prompt", "chosen", "rejected"} (an optional
                 "kind" groups them), tokenised as the run's training pairs were (its preference.template,
                 train.seq_len); accuracy per kind, over all and on the length-matched subset ("reward")
A LoRA fine-tuning checkpoint is evaluated with its adapters on the base model it records.
Prints one JSON object; its "units" entry says what the numbers are (UNITS below): every accuracy and exact
match in percent, BLEU on sacrebleu's 0-100 scale (null for answers too short to be free text), loss in nats.
"""

import json
import sys
from pathlib import Path

from jaxllm.config.cli import fail, parser

UNITS = ("accuracies and exact_match: percent (0-100); bleu: sacrebleu corpus BLEU (0-100), null where the "
         "references are not free text (a median under 4 words); loss: nats per token")


def main(argv):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="jaxllm checkpoint (workdir, checkpoints dir or step dir)")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--hf", default=None, help="Hugging Face model directory")
    p.add_argument("--data", default=None, help="token store for perplexity")
    p.add_argument("--split", default="eval")
    p.add_argument("--seq_len", type=int, default=None,
                   help="rows for --data and the model's length for --task (default: the checkpoint's, else 128)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_batches", type=int, default=None)
    p.add_argument("--choices", default=None, help="multiple-choice JSON-lines file")
    p.add_argument("--tokenizer", default=None, help="tokenizer.model or tokenizer.json (for --choices, --task)")
    p.add_argument("--task", default=None, help="generation-task JSON-lines file (exact match, BLEU)")
    p.add_argument("--reward", default=None, help="preference-pairs JSON-lines file (reward-model pair accuracy)")
    p.add_argument("--template", default=None, choices=("alpaca", "chatml", "model"))
    p.add_argument("--max_new_tokens", type=int, default=None)
    args = p.parse_args(argv)
    if (args.checkpoint is None) == (args.hf is None):
        fail("pass exactly one of --checkpoint and --hf")
    for name in ("seq_len", "batch_size", "max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            fail(f"--{name} must be positive")

    from flax import nnx

    from jaxllm.eval import evaluate
    from jaxllm.interop import hf
    from jaxllm.parallel.mesh import single_device_mesh
    from jaxllm.runs.checkpoint import CheckpointError
    from jaxllm.runs.loader import load_checkpoint
    from jaxllm.data.tokenizer import find_tokenizer_file, load_tokenizer

    mesh = single_device_mesh()
    recorded_data, tokenizer_file, recorded = None, None, {}
    try:
        if args.checkpoint is not None:
            loaded = load_checkpoint(args.checkpoint, args.step, mesh)
            graphdef, params, recorded = loaded.graphdef, loaded.params, loaded.config
            if (recorded.get("train") or {}).get("objective", "pretrain") == "pretrain":
                recorded_data = (recorded.get("data") or {}).get("path")
            tokenizer_file = loaded.tokenizer_path()
        else:
            graphdef, params = nnx.split(hf.from_pretrained(args.hf, mesh=mesh))
            tokenizer_file = find_tokenizer_file(args.hf)
    except (FileNotFoundError, ValueError, CheckpointError, NotImplementedError) as exc:
        fail(str(exc))
    asked = args.choices is not None or args.task is not None or args.reward is not None
    data = args.data or (recorded_data if not asked else None)
    if data is None and not asked:
        fail("nothing to evaluate: pass --data STORE, --choices FILE, --task FILE and/or --reward FILE")
    seq_len = args.seq_len or (recorded.get("train") or {}).get("seq_len", 128)
    if data is not None and args.tokenizer is None and find_tokenizer_file(data) is not None:
        tokenizer_file = find_tokenizer_file(data)
    if args.tokenizer is not None:
        tokenizer_file = Path(args.tokenizer)

    result = {"units": UNITS}
    try:
        if data is not None:
            ppl = evaluate.perplexity(graphdef, params, mesh, data, split=args.split, seq_len=seq_len,
                                      batch_size=args.batch_size, max_batches=args.max_batches)
            result.update(ppl)
        if args.choices is not None:
            if tokenizer_file is None or not Path(tokenizer_file).is_file():
                fail("--choices needs a tokenizer: pass --tokenizer FILE")
            items = evaluate.read_choices(args.choices)
            result.update(evaluate.multiple_choice(graphdef, params, mesh, load_tokenizer(tokenizer_file), items))
        if args.task is not None:
            result["task"] = _task(args, graphdef, params, mesh, tokenizer_file, recorded.get("sft") or {}, seq_len)
        if args.reward is not None:
            result["reward"] = _reward(args, graphdef, params, mesh, tokenizer_file, recorded.get("preference") or {},
                                       seq_len)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        fail(str(exc))
    print(json.dumps(result))
    return 0


def _task(args, graphdef, params, mesh, tokenizer_file, recorded_sft: dict, seq_len: int) -> dict:
    from jaxllm.data.sft import task_examples
    from jaxllm.data.sft_template import TemplateError, stop_ids
    from jaxllm.data.tokenizer import load_tokenizer
    from jaxllm.eval.task_eval import evaluate_task

    if tokenizer_file is None or not Path(tokenizer_file).is_file():
        fail("--task needs a tokenizer: pass --tokenizer FILE")
    if not Path(args.task).is_file():
        fail(f"--task: no such file {args.task}")
    tokenizer = load_tokenizer(tokenizer_file)
    template = args.template or recorded_sft.get("template", "alpaca")
    try:
        examples, skipped = task_examples(args.task, tokenizer, template)
        stops = stop_ids(template, tokenizer)
    except TemplateError as exc:
        fail(str(exc))
    for line in skipped:
        print(f"skipped {line['file']} line {line['line']}: {line['reason']}", file=sys.stderr)
    if not examples:
        fail(f"--task: no usable examples in {args.task}")
    max_new = args.max_new_tokens or recorded_sft.get("max_new_tokens", 32)
    return evaluate_task(graphdef, params, mesh, tokenizer, examples, max_new_tokens=max_new, max_len=seq_len,
                         stop_ids=stops)


def _reward(args, graphdef, params, mesh, tokenizer_file, recorded: dict, seq_len: int) -> dict:
    from flax import nnx

    from jaxllm.data.preference import encode_pairs, packed_pairs, read_pairs
    from jaxllm.data.sft_template import TemplateError
    from jaxllm.data.tokenizer import load_tokenizer
    from jaxllm.model.reward import RewardModel
    from jaxllm.objectives import pair_eval
    from jaxllm.objectives.reward import pair_rewards

    if not isinstance(nnx.merge(graphdef, params), RewardModel):
        fail("--reward needs a reward model: a train.objective=reward checkpoint or a LlamaForSequenceClassification "
             "--hf directory")
    if tokenizer_file is None or not Path(tokenizer_file).is_file():
        fail("--reward needs a tokenizer: pass --tokenizer FILE")
    if not Path(args.reward).is_file():
        fail(f"--reward: no such file {args.reward}")
    skipped = []
    records = list(read_pairs(Path(args.reward), skipped))
    for line in skipped:
        print(f"skipped {line['file']} line {line['line']}: {line['reason']}", file=sys.stderr)
    K = recorded.get("pairs_per_row", 1)
    try:
        enc = encode_pairs(records, load_tokenizer(tokenizer_file), args.template or recorded.get("template", "alpaca"),
                           seq_len, recorded.get("overlong", "truncate"))
    except TemplateError as exc:
        fail(str(exc))
    if not enc.pairs:
        fail(f"--reward: no usable pairs in {args.reward}")
    rows, pairs = packed_pairs(enc, seq_len, 0, K)
    scored = pair_eval.score_rows(graphdef, params, mesh, rows, args.batch_size,
                                  lambda model, batch: dict(zip(("chosen", "rejected"), pair_rewards(model, batch, K)[:2])))
    chosen, rejected = (pair_eval.per_pair(pairs, scored[s]) for s in ("chosen", "rejected"))
    return dict(pair_eval.accuracy_report(pairs, {"accuracy": chosen > rejected}), skipped_lines=len(skipped),
                dropped=enc.dropped)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
