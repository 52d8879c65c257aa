"""The docs' links into markdown files land on a heading that exists, and the code points into
docs/ARCHITECTURE.md, never into a design file a reader of the repository does not have."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/ARCHITECTURE.md", "docs/PERFORMANCE.md", "charts/ppserve/README.md"]
LINK = re.compile(r"\]\(([^)\s#]*\.md)?#([^)\s]+)\)")
COMMENT_POINTER = re.compile(r"docs/ARCHITECTURE\.md#([\w-]+)")
DESIGN_CITATION = re.compile("DESIGN" + "( §|,)")  # split: this file must not match itself


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_links_land_on_headings(doc):
    path = ROOT / doc
    for target, anchor in LINK.findall(path.read_text()):
        file = (path.parent / target).resolve() if target else path
        assert anchor in anchors(file), f"{doc}: no heading #{anchor} in {file.name}"


def test_code_points_into_the_architecture_doc():
    known = anchors(ROOT / "docs" / "ARCHITECTURE.md")
    for d in ("app", "stages", "tests"):
        for f in sorted((ROOT / d).rglob("*.py")):
            text = f.read_text()
            rel = f.relative_to(ROOT)
            assert not DESIGN_CITATION.search(text), f"{rel} cites a design file readers lack"
            for anchor in COMMENT_POINTER.findall(text):
                assert anchor in known, f"{rel}: no heading #{anchor} in docs/ARCHITECTURE.md"
