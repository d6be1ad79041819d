"""Sample from a model: `python scripts/generate.py --hf DIR --prompt "text" [--max_new_tokens N ...]`.

DIR is a Hugging Face LlamaForCausalLM directory (config.json + safetensors). With a `tokenizer.model`
(sentencepiece) in DIR, --prompt is text and the output is printed as text; without one, pass raw ids with
--tokens "1,2,3" and the new ids are printed.
"""

import sys
from pathlib import Path

from jaxllm.cli import fail, parser


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.tokens is not None:
        try:
            return [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            fail(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if tokenizer is None:
        fail(f"--prompt needs a tokenizer.model in {args.hf}; pass raw ids with --tokens instead")
    return [tokenizer.bos_id] + tokenizer.encode(args.prompt)


def main(argv):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--hf", help="Hugging Face model directory")
    p.add_argument("--checkpoint", help="jaxllm checkpoint directory (not supported yet)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--tokens", default=None, help="comma-separated prompt token ids (no tokenizer needed)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.checkpoint is not None:
        fail("--checkpoint is not supported yet")
    if args.hf is None:
        fail("--hf DIR is required")
    if (args.prompt is None) == (args.tokens is None):
        fail("pass exactly one of --prompt and --tokens")

    from jaxllm import hf, sample
    from jaxllm.data.tokenizer import Tokenizer

    tokenizer_file = Path(args.hf) / "tokenizer.model"
    tokenizer = Tokenizer.load(tokenizer_file) if tokenizer_file.is_file() else None
    prompt = _prompt_ids(args, tokenizer)
    try:
        model = hf.from_pretrained(args.hf)
        stop_ids = (tokenizer.eos_id,) if tokenizer is not None else ()
        new = sample.generate(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, stop_ids=stop_ids, seed=args.seed)[0]
    except (FileNotFoundError, ValueError, NotImplementedError) as exc:
        fail(str(exc))
    if tokenizer is not None and args.tokens is None:
        print(args.prompt + tokenizer.decode(new))
    else:
        print(",".join(str(t) for t in new))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
