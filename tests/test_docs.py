"""The README and docs/ hold together: every relative link resolves, and every docs page is reachable."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_every_relative_link_resolves() -> None:
    broken = [b for page in pages() for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    unlinked = [p.name for p in pages()[1:] if f"docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Title\n[a](missing.md) [b](#title) [c](#nope)\n")
    assert [b.split(": ", 1)[1] for b in broken_links(page, tmp_path)] == [
        "missing.md (no such file)", "#nope (no such heading)"]



def test_the_layout_module_table_is_the_modules() -> None:
    """docs/layout.md's module table is the one scripts/layout_table.py makes from the modules' docstrings: a
    module added, removed or re-described fails here until it is regenerated."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("layout_table", ROOT / "scripts" / "layout_table.py")
    assert spec is not None and spec.loader is not None
    layout_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout_table)
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    assert layout_table.render(text) == text, "docs/layout.md's module table is out of date: " \
                                               "python scripts/layout_table.py"
    rows = layout_table.table().splitlines()[2:]
    assert len(rows) == len([p for p in (ROOT / "src" / "vramgate").rglob("*.py") if p.name != "__main__.py"])
    assert all(not row.endswith("|  |") for row in rows), "a module without a docstring"
