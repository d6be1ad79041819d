"""Sample from a model: `python scripts/generate.py (--hf DIR | --checkpoint DIR) --prompt "text" [...]`.

--hf DIR is a Hugging Face LlamaForCausalLM directory (config.json + safetensors); --checkpoint DIR is a jaxllm
checkpoint (a run's workdir, its checkpoints directory or one step directory; --step N picks a step), whose model
config is read from its metadata (parameters only are restored). The tokenizer is --tokenizer FILE (a sentencepiece
.model or a Hugging Face tokenizer.json), else the `tokenizer.json` or `tokenizer.model` in the HF directory, else
(checkpoints) the one of the training data store recorded in the checkpoint. With a tokenizer, --prompt is text
and the output is printed as text; without one, pass raw ids with --tokens "1,2,3" and the new ids are printed.
"""

import contextlib
import sys
from pathlib import Path

from jaxllm.config.cli import fail, parser


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.tokens is not None:
        try:
            return [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            fail(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if tokenizer is None:
        fail(f"--prompt needs a tokenizer (--tokenizer FILE, or a tokenizer.json or tokenizer.model in "
             f"{args.hf or args.checkpoint}); "
             "pass raw ids with --tokens instead")
    return [tokenizer.bos_id] + tokenizer.encode(args.prompt)


def main(argv):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--hf", help="Hugging Face model directory")
    p.add_argument("--checkpoint", help="jaxllm checkpoint (workdir, checkpoints directory or step directory)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.model (sentencepiece) or tokenizer.json")
    p.add_argument("--prompt", default=None)
    p.add_argument("--tokens", default=None, help="comma-separated prompt token ids (no tokenizer needed)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.hf is None) == (args.checkpoint is None):
        fail("pass exactly one of --hf DIR and --checkpoint DIR")
    if (args.prompt is None) == (args.tokens is None):
        fail("pass exactly one of --prompt and --tokens")

    import jax

    from jaxllm.interop import hf
    from jaxllm.model import sample
    from jaxllm.runs.checkpoint import CheckpointError
    from jaxllm.data.tokenizer import find_tokenizer_file, load_tokenizer
    from jaxllm.runs.loader import load_checkpoint
    from jaxllm.parallel.mesh import single_device_mesh

    loaded, mesh = None, None
    if args.checkpoint is not None:
        mesh = single_device_mesh()
        try:
            loaded = load_checkpoint(args.checkpoint, args.step, mesh)
        except (FileNotFoundError, CheckpointError) as exc:
            fail(str(exc))
    if args.tokenizer is not None:
        tokenizer_file = Path(args.tokenizer)
        if not tokenizer_file.is_file():
            fail(f"--tokenizer {tokenizer_file}: not found")
    elif loaded is not None:
        tokenizer_file = loaded.tokenizer_path()
    else:
        tokenizer_file = find_tokenizer_file(args.hf)
    try:
        tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file is not None else None
    except ValueError as exc:
        fail(str(exc))
    prompt = _prompt_ids(args, tokenizer)
    try:
        model = hf.from_pretrained(args.hf) if loaded is None else loaded.model
        stop_ids = (tokenizer.eos_id,) if tokenizer is not None else ()
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            new = sample.generate(model, [prompt], max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  stop_ids=stop_ids, seed=args.seed,
                                  vocab_limit=tokenizer.vocab_size if tokenizer is not None else None)[0]
    except (FileNotFoundError, ValueError, NotImplementedError) as exc:
        fail(str(exc))
    if tokenizer is not None and args.tokens is None:
        print(args.prompt + tokenizer.decode(new))
    else:
        print(",".join(str(t) for t in new))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
