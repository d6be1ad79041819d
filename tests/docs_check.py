"""Run the command blocks of the documentation (`make docs-check`; by hand, not in CI).

Every ```bash block of the pages that mkdocs.yml's nav names is run, page by page in nav order and block by block
in page order, from the repository root with the virtual environment's `bin/` first on PATH and the same 8 fake CPU
devices as `make train`. A block that cannot run here is marked as skipped, with the reason, by an HTML comment
on the line right before its fence:

    <!-- docs-check: skip (needs a GPU) -->

Blocks depend on earlier ones (`make sft` needs `make train`'s run), so the pages are run in order and the first
failure stops the run. Output examples are plain ``` blocks (no language) and Python examples ```python blocks:
neither is run.

    python tests/docs_check.py            # run every block that is not skipped
    python tests/docs_check.py --list     # only list the blocks, with their pages, lines and what would run
    python tests/docs_check.py --page objectives.md --from 2   # one page, from its second runnable block
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = re.compile(r"^<!--\s*docs-check:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
CPU_DEVICES = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=180",
    "JAX_PLATFORMS": "cpu",
}


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # path under docs/
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason, when marked as skipped


def nav_pages(mkdocs_yml: Path = ROOT / "mkdocs.yml") -> list[str]:
    """The pages mkdocs.yml's nav names, in order (read as text: no YAML parser needed)."""
    pages, in_nav = [], False
    for line in mkdocs_yml.read_text().splitlines():
        if re.match(r"^nav:\s*$", line):
            in_nav = True
            continue
        if in_nav and line and not line.startswith((" ", "\t", "#")):
            break
        found = re.search(r"(?:^|[\s:])([\w./-]+\.md)\s*$", line) if in_nav else None
        if found:
            pages.append(found.group(1))
    return pages


def blocks(page: str, docs: Path = ROOT / "docs") -> list[Block]:
    """The fenced code blocks of one page with language `bash`, each with its skip marker's reason, if any.

    A skip marker that is not right before a bash block is an error (it would silently mark nothing)."""
    lines = (docs / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        marker = SKIP.match(lines[i].strip())
        if marker:
            fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if not fence or fence.group("lang") != "bash":
                raise ValueError(f"{page}:{i + 1}: a docs-check skip marker must be right before a ```bash block")
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: unclosed code block")
        if fence.group("lang") == "bash":
            before = SKIP.match(lines[i - 1].strip()) if i > 0 else None
            found.append(Block(page, i + 1, "\n".join(lines[i + 1:end]) + "\n",
                               before.group("reason").strip() if before else None))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in nav_pages() for b in blocks(page)]


# What `make docs-check ARGS=...` hands down to every make it starts: without them a block's own `make train`
# would get the docs check's ARGS (`--from 4`) as the training script's arguments.
MAKE_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL", "ARGS")


def run(block: Block) -> int:
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES} | CPU_DEVICES
    venv_bin = ROOT / ".venv" / "bin"
    if venv_bin.is_dir():
        env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list the blocks and exit")
    parser.add_argument("--page", help="run only this page (a path under docs/, e.g. objectives.md)")
    parser.add_argument("--from", dest="start", type=int, default=1,
                        help="start at this runnable block of the selection (1-based)")
    args = parser.parse_args(argv)
    try:
        selected = [b for b in all_blocks() if args.page in (None, b.page)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.page and not selected:
        print(f"error: no bash blocks on {args.page!r} (pages: {', '.join(nav_pages())})", file=sys.stderr)
        return 2
    runnable = [b for b in selected if b.skip is None]
    if args.list:
        n = 0
        for b in selected:
            if b.skip is None:
                n += 1
            status = f"run #{n}" if b.skip is None else f"skip ({b.skip})"
            first = b.code.strip().splitlines()[0] if b.code.strip() else ""
            print(f"docs/{b.page}:{b.line}: {status}: {first}")
        print(f"{len(runnable)} blocks to run, {len(selected) - len(runnable)} skipped")
        return 0
    todo = runnable[args.start - 1:]
    for k, b in enumerate(todo, args.start):
        print(f"\n=== docs-check {k}/{len(runnable)}: docs/{b.page}:{b.line}\n{b.code}", flush=True)
        t0 = time.monotonic()
        rc = run(b)
        print(f"=== exit {rc} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            print(f"docs-check: the block at docs/{b.page}:{b.line} failed (exit {rc}); rerun from it with "
                  f"--page {b.page} or --from {k}", file=sys.stderr)
            return 1
    print(f"\ndocs-check: {len(todo)} blocks passed, {len(selected) - len(runnable)} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
