"""The README as a front page and the docs site's skeleton: fast checks on the files themselves (no mkdocs needed;
`make docs` builds the site strictly in CI, and `make docs-check` runs the pages' command blocks by hand)."""

import re
from pathlib import Path

import pytest

import docs_check

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
FENCED = re.compile(r"^ *```.*?^ *```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _relative_links(markdown: str) -> list[str]:
    """Targets of the inline links and images outside code, without anchors; external and in-page links left out."""
    prose = INLINE_CODE.sub("", FENCED.sub("", markdown))
    targets = [t.split("#")[0] for t in LINK.findall(prose)]
    return [t for t in targets if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_readme_is_a_front_page_of_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into docs/"


def test_the_readme_opens_with_the_two_set_up_commands():
    first_block = FENCED.search(README.read_text())
    assert first_block, "README.md has no code block"
    assert "make train" in first_block.group(0) and "make test" in first_block.group(0), first_block.group(0)


def test_every_relative_link_in_the_readme_points_to_a_file():
    links = _relative_links(README.read_text())
    assert links, "README.md links no docs pages"
    missing = [t for t in links if not (README.parent / t).exists()]
    assert not missing, missing


def test_every_page_of_the_docs_nav_exists_and_every_page_is_in_the_nav():
    pages = docs_check.nav_pages()
    assert "index.md" in pages and "benchmarks.md" in pages and "public-api.md" in pages, pages
    assert not [p for p in pages if not (DOCS / p).is_file()]
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert not sorted(set(on_disk) - set(pages)), "pages missing from mkdocs.yml's nav"


@pytest.mark.parametrize("page", docs_check.nav_pages())
def test_every_relative_link_of_a_docs_page_points_to_a_file(page):
    base = (DOCS / page).parent
    missing = [t for t in _relative_links((DOCS / page).read_text()) if not (base / t).resolve().exists()]
    assert not missing, missing


def test_every_image_under_docs_is_shown_by_a_page():
    shown = {(DOCS / page).parent.joinpath(t).resolve() for page in docs_check.nav_pages()
             for t in _relative_links((DOCS / page).read_text())}
    images = [p for p in DOCS.rglob("*") if p.suffix.lower() in {".png", ".svg", ".jpg", ".jpeg", ".gif"}]
    assert not [str(p.relative_to(ROOT)) for p in images if p.resolve() not in shown]


def test_docs_check_finds_the_command_blocks_and_every_skip_is_marked_with_a_reason():
    blocks = docs_check.all_blocks()  # raises on a marker that is not right before a bash block
    runnable = [b for b in blocks if b.skip is None]
    assert runnable and any("make train" in b.code for b in runnable)
    assert all(b.skip.strip() for b in blocks if b.skip is not None)
    assert not [b for b in blocks if not b.code.strip()], "an empty bash block"


def test_docs_check_rejects_a_skip_marker_that_marks_nothing(tmp_path):
    (tmp_path / "page.md").write_text("<!-- docs-check: skip (needs a GPU) -->\n\n```bash\nnvidia-smi\n```\n")
    with pytest.raises(ValueError, match="page.md:1"):
        docs_check.blocks("page.md", docs=tmp_path)
    (tmp_path / "page.md").write_text("<!-- docs-check: skip (needs a GPU) -->\n```bash\nnvidia-smi\n```\n"
                                      "```bash\nls\n```\n")
    assert [(b.line, b.skip) for b in docs_check.blocks("page.md", docs=tmp_path)] == [(2, "needs a GPU"), (5, None)]


def test_a_docs_block_runs_without_the_make_variables_of_the_docs_check_itself(tmp_path, monkeypatch, capfd):
    """`make docs-check ARGS="--from 4"` puts ARGS into MAKEFLAGS, which every make a block starts would inherit:
    the block's own `make train` then handed `--from 4` to the training script. Blocks run without them."""
    monkeypatch.setenv("MAKEFLAGS", " -- ARGS=--from\\ 4")
    monkeypatch.setenv("ARGS", "--from 4")
    block = docs_check.Block("page.md", 1, 'echo "[${MAKEFLAGS:-}|${ARGS:-}|$JAX_PLATFORMS]"', None)
    assert docs_check.run(block) == 0
    assert capfd.readouterr().out.strip() == "[||cpu]"
