"""Render a launch template: `python scripts/launch/render.py {slurm,jobset} [--set key=value ...] [-- overrides]`.

  slurm   scripts/launch/slurm.sbatch  (submit the output with `sbatch`)
  jobset  scripts/launch/jobset.yaml   (apply the output with `kubectl apply -f`)

Everything after `--` is passed to scripts/train.py (e.g. `--config.train.steps=10000`). `--list` prints the
parameters and their defaults. Output goes to stdout, or to `--out FILE` (never over an existing file unless
`--force`).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from jaxllm.cluster.templates import PARAMS, TEMPLATES, render  # noqa: E402
from jaxllm.config.cli import UsageError, fail, parser  # noqa: E402


def main(argv: list[str]) -> int:
    argv = list(argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = parser(__doc__.splitlines()[0])
    p.add_argument("target", choices=sorted(TEMPLATES))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a template parameter")
    p.add_argument("--out", default=None, help="write here instead of stdout")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--list", action="store_true", help="print the parameters and their defaults")
    args = p.parse_args(argv)
    if args.list:
        for key, (default, _, meaning) in PARAMS.items():
            print(f"{key:14s} {str(default):32s} {meaning}")
        return 0
    try:
        values = {}
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise UsageError(f"--set {item}: expected KEY=VALUE")
            values[key] = value
        text = render(args.target, values, train_args)
        if args.out and Path(args.out).exists() and not args.force:
            raise UsageError(f"--out {args.out}: exists (pass --force to overwrite)")
    except UsageError as exc:
        fail(str(exc))
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
