"""Clean, deduplicate and tokenize raw text into a token store for training.

    python scripts/prepare_data.py --input data/shakespeare.jsonl.gz --output build/data/shakespeare --vocab_size 512

Inputs: files or directories of .txt / .jsonl (field "text") / .parquet (column "text"), text and JSON lines
optionally .gz / .zst. Stage thresholds (jaxllm/data/prep_config.py) can be set from a JSON file with
--data_config FILE and/or one by one, e.g. --clean.min_words=20 --dedup.threshold=0.7 --read.txt_split=blank_lines.
Re-running with the same inputs and settings prints "up to date"; an interrupted run resumes. Problems print
one `error: ...` line and exit 2.
"""
import sys

from jaxllm.config.cli import parser, split_overrides
from jaxllm.data.prep_config import load_config
from jaxllm.data.prepare import PrepareError, prepare
from jaxllm.config.typed_config import ConfigError


def main(argv=None) -> int:
    ap = parser(__doc__.split("\n\n")[0])  # usage errors: one line, exit 2
    ap.epilog = "Any --section.field=value sets a stage threshold (see prep_config.py)."
    ap.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories")
    ap.add_argument("--output", required=True, metavar="DIR", help="dataset directory to create")
    tok = ap.add_mutually_exclusive_group(required=True)
    tok.add_argument("--vocab_size", type=int, help="train a tokenizer with this vocabulary size")
    tok.add_argument("--tokenizer", metavar="FILE",
                     help="use this tokenizer instead of training one: a sentencepiece .model file or a Hugging Face "
                          "tokenizer.json (special ids from the tokenizer_config.json beside it)")
    ap.add_argument("--eval_fraction", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data_config", metavar="FILE", help="JSON file of stage thresholds, e.g. {\"clean\": {...}}")
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else argv, prefix="--")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.data_config, overrides)
        result = prepare(args.input, args.output, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
                         eval_fraction=args.eval_fraction, seed=args.seed, config=cfg)
    except (PrepareError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    if result.up_to_date:
        print(f"{result.output} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
