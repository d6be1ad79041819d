"""Tokenize raw text into a token store for training.

    python scripts/prepare_data.py --input data/shakespeare.jsonl.gz --output build/data/shakespeare --vocab_size 4096

Inputs: .jsonl / .jsonl.gz (field "text"), .txt (one document per file), or directories of them. Re-running
with the same inputs and arguments prints "up to date". Problems print one `error: ...` line and exit 2.
"""
import argparse
import sys

from jaxllm.data.prepare import PrepareError, prepare


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories")
    ap.add_argument("--output", required=True, metavar="DIR", help="token store directory to create")
    tok = ap.add_mutually_exclusive_group(required=True)
    tok.add_argument("--vocab_size", type=int, help="train a tokenizer with this vocabulary size")
    tok.add_argument("--tokenizer", metavar="FILE", help="use this sentencepiece model instead of training")
    ap.add_argument("--eval_fraction", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        result = prepare(args.input, args.output, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
                         eval_fraction=args.eval_fraction, seed=args.seed)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result.up_to_date:
        print(f"{result.output} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
