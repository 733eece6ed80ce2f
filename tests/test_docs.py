"""The README and docs/ hold together: every relative link resolves, every docs page is reachable from the README's
map of the docs, the tox environments the pages list are tox.ini's, and the README stays short and keeps its
measured figures in one table."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

#: The README's length, at most: a page a new user reads in minutes (longer material has a page in docs/).
README_LINES = 160
#: The README's section that maps the docs; every page of docs/ is linked from it.
MAP_HEADING = "Documentation"
#: The README's one section that may hold measured figures: how long the gate takes, naming its machine.
TIMING_HEADING = "How long the gate takes"
#: A figure with a unit: seconds and their parts, bytes, a percentage, a ratio ("0.69x").
FIGURE = re.compile(
    r"(?<![\w.])\d+(?:[.,]\d+)*\s?(?:ms|µs|us|ns|min|s|h|KiB|MiB|GiB|TiB|kB|KB|MB|GB|TB|B|%|x|×)(?!\w)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code and emphasis marks and punctuation dropped (underscores and
    hyphens kept), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
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
    """The README, then every page of docs/, its folders' pages (a campaign's, under docs/campaigns/) included."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def without_code(text: str) -> str:
    """*text* with its fenced code blocks blanked (their lines kept, so line numbers stay)."""
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            out.append("")
        else:
            out.append("" if in_code else line)
    return "\n".join(out)


def sections(text: str) -> list[tuple[str, int, list[str]]]:
    """(heading, line number of the section's first line after its heading, lines) of each section of *text*,
    code blocks blanked; the lines before the first heading are the section ""."""
    found: list[tuple[str, int, list[str]]] = [("", 1, [])]
    for number, line in enumerate(without_code(text).splitlines(), 1):
        if re.match(r"#{1,6} ", line):
            found.append((line.lstrip("#").strip(), number + 1, []))
        else:
            found[-1][2].append(line)
    return found


def section(text: str, heading: str) -> str:
    """The lines of the first section of *text* whose heading starts with *heading* ("" when there is none)."""
    return next(("\n".join(lines) for title, _, lines in sections(text) if title.startswith(heading)), "")


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


def unmapped(readme: str, names: list[str]) -> list[str]:
    """The docs pages (file names) that the README's map of the docs does not link."""
    docs_map = section(readme, MAP_HEADING)
    return [n for n in names if f"(docs/{n})" not in docs_map and f"(docs/{n}#" not in docs_map]


def unreachable(readme: Path, wanted: list[Path]) -> list[Path]:
    """The pages of *wanted* that no chain of relative links reaches from the pages the README's map links."""
    seen: set[Path] = set()
    todo = [(readme.parent / t.partition("#")[0]).resolve()
            for t in LINK.findall(section(readme.read_text(encoding="utf-8"), MAP_HEADING))]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.is_file():
            continue
        seen.add(page)
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        todo += [(page.parent / t.partition("#")[0]).resolve() for t in LINK.findall(text)
                 if t.partition("#")[0] and not re.match(r"[a-z]+:", t)]
    return [p for p in wanted if p.resolve() not in seen]


def too_long(text: str, limit: int = README_LINES) -> str | None:
    """Why *text* is too long for the README, or None."""
    lines = len(text.splitlines())
    return f"{lines} lines, at most {limit}" if lines > limit else None


def stray_figures(text: str, allowed: str = TIMING_HEADING) -> list[str]:
    """Figures with a unit outside the section headed *allowed*, each as ``line N: 'figure' in 'line'``.

    The rule covers prose, lists and tables, the README's table of verdicts included. Fenced code blocks are left
    out: they quote commands, configuration and the gate's own output verbatim (a failure message's figures are
    what the gate prints, not a measurement the page reports; the matrix excerpt's budgets are settings, and
    ``tests/test_matrix.py`` holds the excerpt to its file)."""
    stray = []
    for title, start, lines in sections(text):
        if title and title.startswith(allowed):
            continue
        for offset, line in enumerate(lines):
            stray += [f"line {start + offset}: {m.group(0)!r} in {line.strip()!r}" for m in FIGURE.finditer(line)]
    return stray


def timing_drift(readme: str, running: str) -> list[str]:
    """The figures of the README's timing section that docs/running.md's current table ("How long it takes") does
    not have, and what else is wrong with the section."""
    mine, theirs = section(readme, TIMING_HEADING), section(running, "How long it takes")
    figures = [m.group(0) for m in FIGURE.finditer(mine)]
    problems = [] if figures else ["the README's timing section names no figure"]
    if "docs/running.md#how-long-it-takes" not in mine:
        problems.append("the README's timing section does not link docs/running.md#how-long-it-takes")
    return problems + [f"{f}: not in docs/running.md's table" for f in figures if f not in theirs]


def tox_sections(tox_ini: Path = ROOT / "tox.ini") -> tuple[list[str], set[str]]:
    """tox.ini's ``envlist`` in order, and the names of its ``[testenv:NAME]`` sections."""
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(tox_ini, encoding="utf-8")
    envlist = [e.strip() for e in re.split(r"[,\s]+", ini["tox"]["envlist"]) if e.strip()]
    return envlist, {s.split(":", 1)[1] for s in ini.sections() if s.startswith("testenv:")}


def tox_problems(text: str, tox_ini: Path = ROOT / "tox.ini") -> list[str]:
    """Where a page's section "The tox environments" differs from tox.ini: the environments its sentence "`tox`
    alone runs ..." names (backticked, in order) against ``envlist``, and the first column of its table against the
    ``[testenv:NAME]`` sections."""
    envlist, named = tox_sections(tox_ini)
    body = section(text, "The tox environments")
    sentence = re.search(r"`tox` alone runs (.*?)[(.;]", body, re.S)
    default = re.findall(r"`([\w-]+)`", sentence.group(1)) if sentence else []
    table = re.findall(r"^\| `([\w-]+)` \|", body, re.M)
    problems = [] if default == envlist else [f"`tox` alone runs {default}; tox.ini's envlist is {envlist}"]
    if sorted(table) != sorted(named):
        problems.append(f"the table lists {sorted(table)}; tox.ini's [testenv:NAME] sections are {sorted(named)}")
    return problems


def test_every_relative_link_resolves() -> None:
    broken = [b for page in pages() for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Title\n## Measured: `record_samples`\n[a](missing.md) [b](#title) [c](#nope)\n"
                    "[d](#measured-record_samples)\n")
    assert [b.split(": ", 1)[1] for b in broken_links(page, tmp_path)] == [
        "missing.md (no such file)", "#nope (no such heading)"]


def test_every_docs_page_is_linked_from_the_readmes_map() -> None:
    """Each page of docs/ is linked from the README's map; a page in a folder of docs/ (a campaign's) is reached
    from it through the pages it links."""
    names = [p.name for p in pages()[1:] if p.parent == ROOT / "docs"]
    missing = unmapped((ROOT / "README.md").read_text(encoding="utf-8"), names)
    assert not missing, f"docs pages the README's map ({MAP_HEADING!r}) does not link: {missing}"
    lost = unreachable(ROOT / "README.md", pages()[1:])
    assert not lost, f"docs pages no link reaches from the README's map: {[str(p.relative_to(ROOT)) for p in lost]}"


def test_the_reach_checker_sees_a_page_no_link_reaches(tmp_path: Path) -> None:
    (tmp_path / "docs" / "deep").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# R\n## Documentation\n- [a](docs/a.md)\n## Later\n[c](docs/deep/c.md)\n")
    (tmp_path / "docs" / "a.md").write_text("[b](deep/b.md#x)\n```\n[c](deep/c.md)\n```\n")
    for name in ("b", "c"):
        (tmp_path / "docs" / "deep" / f"{name}.md").write_text(f"# {name}\n[back](../a.md)\n")
    wanted = [tmp_path / "docs" / "a.md", tmp_path / "docs" / "deep" / "b.md", tmp_path / "docs" / "deep" / "c.md"]
    assert unreachable(tmp_path / "README.md", wanted) == [tmp_path / "docs" / "deep" / "c.md"]


def test_the_map_checker_sees_an_unmapped_page() -> None:
    readme = ("# R\nSee [a](docs/a.md) and [b](docs/b.md).\n## Documentation\n- [a](docs/a.md#x)\n- [c](docs/c.md)\n"
              "## Later\n- [b](docs/b.md)\n")
    assert unmapped(readme, ["a.md", "b.md", "c.md"]) == ["b.md"]


def test_the_readme_is_short() -> None:
    problem = too_long((ROOT / "README.md").read_text(encoding="utf-8"))
    assert problem is None, f"README.md: {problem}: move the detail to a page of docs/ and link it"


def test_the_length_checker_sees_a_long_readme() -> None:
    assert too_long("line\n" * README_LINES) is None
    assert too_long("line\n" * (README_LINES + 1)) == f"{README_LINES + 1} lines, at most {README_LINES}"


def test_the_readme_has_no_measured_figure_outside_its_timing_table() -> None:
    stray = stray_figures((ROOT / "README.md").read_text(encoding="utf-8"))
    assert not stray, (f"figures with a unit outside the README's section {TIMING_HEADING!r} (each measured figure "
                       "has one page in docs/; link it):\n" + "\n".join(stray))


def test_the_figure_checker_sees_a_stray_figure() -> None:
    text = ("# T\nIt took 358 s, 0.69x the old, and 12.5% less; 2 GiB.\n\n| a | b |\n|---|---|\n| x | 64 MiB |\n"
            "```\nnow 73,728 B (72.00 KiB): +12.50%\n```\n## How long the gate takes\n| run | 533 s |\n"
            "## Then\nvLLM 0.32.0, Python 3.11, 2-core machines, an h100x8 box, 8 steps, 1,000 requests.\n")
    assert stray_figures(text) == [
        "line 2: '358 s' in 'It took 358 s, 0.69x the old, and 12.5% less; 2 GiB.'",
        "line 2: '0.69x' in 'It took 358 s, 0.69x the old, and 12.5% less; 2 GiB.'",
        "line 2: '12.5%' in 'It took 358 s, 0.69x the old, and 12.5% less; 2 GiB.'",
        "line 2: '2 GiB' in 'It took 358 s, 0.69x the old, and 12.5% less; 2 GiB.'",
        "line 6: '64 MiB' in '| x | 64 MiB |'"]


def test_the_readmes_timings_are_running_mds() -> None:
    """The README's timing table repeats the current one of docs/running.md, not another run's."""
    problems = timing_drift((ROOT / "README.md").read_text(encoding="utf-8"),
                            (ROOT / "docs" / "running.md").read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_the_timing_checker_sees_another_runs_figure() -> None:
    running = "## How long it takes\n| `tox` | 533 s |\n## Earlier\n| `tox` | 825 s |\n"
    readme = ("## How long the gate takes\n| `tox` | 533 s |\n| `cpu` | 825 s |\n"
              "[r](docs/running.md#how-long-it-takes)\n")
    assert timing_drift(readme, running) == ["825 s: not in docs/running.md's table"]
    assert timing_drift("## How long the gate takes\nfast\n", running) == [
        "the README's timing section names no figure",
        "the README's timing section does not link docs/running.md#how-long-it-takes"]


def test_the_tox_environments_listed_are_tox_inis() -> None:
    """README.md and docs/running.md list every [testenv:NAME] of tox.ini, no other, and say what `tox` alone runs
    as its envlist has it."""
    problems = [f"{page}: {p}" for page in ("README.md", "docs/running.md")
                for p in tox_problems((ROOT / page).read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_the_tox_checker_sees_a_missing_environment(tmp_path: Path) -> None:
    ini = tmp_path / "tox.ini"
    ini.write_text("[tox]\nenvlist = lint, unit,\n    cpu\n[testenv]\n[testenv:lint]\n[testenv:unit]\n"
                   "[testenv:cpu]\n[testenv:gpu]\n")
    assert tox_sections(ini) == (["lint", "unit", "cpu"], {"lint", "unit", "cpu", "gpu"})
    good = ("## The tox environments\n\n`tox` alone runs `lint`, `unit` and `cpu` (its envlist).\n\n| env | what |\n"
            "|---|---|\n| `lint` | l |\n| `unit` | u |\n| `cpu` | c |\n| `gpu` | g |\n")
    assert tox_problems(good, ini) == []
    bad = good.replace("`lint`, `unit` and `cpu`", "`lint` and `cpu`").replace("| `gpu` | g |\n", "") + \
        "\n## Next\n| `gpu` | another section's table |\n"
    assert tox_problems(bad, ini) == [
        "`tox` alone runs ['lint', 'cpu']; tox.ini's envlist is ['lint', 'unit', 'cpu']",
        "the table lists ['cpu', 'lint', 'unit']; tox.ini's [testenv:NAME] sections are ['cpu', 'gpu', 'lint', 'unit']"]


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
