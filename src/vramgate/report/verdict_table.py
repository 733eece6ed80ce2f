"""The profile table every report opens with (Note [profile verdict] in :mod:`vramgate.core.verdicts`): one row per
optimization profile, one cell per standard check, as ``report.md``, the terminal and the HTML page show it.

A cell that did not judge says why in a numbered note under the table; a failing cell names the tests that failed
it. The notes are the same text in every renderer (:func:`cell_notes`).
"""

from __future__ import annotations

import html

from vramgate.core.verdicts import CHECK_HELP, COLUMNS, Cell, ProfileRow

#: A cell's mark, by state: emoji in report.md (GitHub draws them), signs every font has on the HTML page.
MARKS = {"passed": "✅", "failed": "❌", "not judged": "⚪", "nightly": "🌙", "left out": "➖"}
HTML_MARKS = {"passed": "✓", "failed": "✗", "not judged": "not judged", "nightly": "nightly", "left out": "left out"}
#: The legend under the table.
LEGEND = ("✅ passed · ❌ failed · ⚪ not judged here (the note says why) · 🌙 judged by the nightly tier (tox -e "
          "cpu-full) · ➖ left out of this run")
#: The doc that says what each check runs.
DOC = "docs/profiles.md#the-profile-verdict"


def cell_notes(rows: list[ProfileRow]) -> tuple[dict[tuple[str, str], int], list[str]]:
    """The numbered notes of the table: ``{(profile, check): n}`` and the notes' texts (note n is ``texts[n - 1]``).
    Cells with the same text share a note."""
    index: dict[tuple[str, str], int] = {}
    texts: list[str] = []
    for row in rows:
        for check in COLUMNS:
            text = note_text(row.cells[check])
            if text is None:
                continue
            if text not in texts:
                texts.append(text)
            index[(row.profile, check)] = texts.index(text) + 1
    return index, texts


def note_text(cell: Cell) -> str | None:
    """What a cell's note says: why it did not judge, or which tests failed it; None for a plain pass."""
    why = "; ".join(cell.reasons)
    if cell.state == "passed":
        if cell.not_judged:
            return f"passed in {len(cell.tests)} of {len(cell.tests) + cell.not_judged} cases; the others: {why}"
        return why or None
    if cell.state == "failed":
        return "failed by " + ", ".join(f"`{t}`" for t in cell.tests)
    return why or cell.state


def short(cell: Cell, marks: dict[str, str] = MARKS) -> str:
    """The cell's mark and count: ``✅``, ``✅ 2/3``, ``❌``, ``⚪``, ``🌙`` (*marks*: :data:`HTML_MARKS` on a page)."""
    mark = marks[cell.state]
    if cell.state in ("passed", "failed") and cell.not_judged:
        return f"{mark} {len(cell.tests)}/{len(cell.tests) + cell.not_judged}"
    return mark


#: A row's verdict as report.md and the HTML page show it (emoji there, signs every font has here).
VERDICTS = {"regression": ("❌ regression", "✗ regression"), "safe on what ran": ("✅ safe", "✓ safe"),
            "safe pre-merge": ("✅ safe pre-merge, 🌙 rest nightly", "✓ safe pre-merge, rest nightly"),
            "partly judged": ("⚠️ partly judged", "⚠ partly judged")}


def verdict_mark(row: ProfileRow) -> str:
    """The row's verdict as the table's second column shows it."""
    return VERDICTS[row.verdict][0]


def html_verdict(row: ProfileRow) -> str:
    """The row's verdict on the HTML page."""
    return VERDICTS[row.verdict][1]


def markdown_lines(rows: list[ProfileRow]) -> list[str]:
    """The table as GitHub-flavoured markdown, with its legend and notes."""
    if not rows:
        return []
    index, texts = cell_notes(rows)
    out = [f"### Profiles: is each optimization safe to merge? ([what each check runs]({DOC}))", "",
           "| profile | verdict | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = []
        for check in COLUMNS:
            n = index.get((row.profile, check))
            cells.append(short(row.cells[check]) + (f" <sup>{n}</sup>" if n else ""))
        out.append(f"| `{row.profile}` | {verdict_mark(row)} | " + " | ".join(cells) + " |")
    out += ["", LEGEND, ""]
    for n, text in enumerate(texts, 1):
        out.append(f"{n}. {text.replace('|', '/')}")
    out.append("")
    passed = [(row.profile, check, row.cells[check]) for row in rows for check in COLUMNS
              if row.cells[check].state == "passed"]
    if passed:
        out += ["<details><summary>The tests that passed each cell</summary>", ""]
        out += [f"- `{p}` · {check}: " + ", ".join(f"`{t}`" for t in cell.tests) for p, check, cell in passed]
        out += ["", "</details>", ""]
    return out


def terminal_lines(rows: list[ProfileRow], verbose: bool = False) -> list[str]:
    """The table as plain text lines for the terminal summary: the grid, then why each cell that did not pass did
    not (the passing tests too when *verbose*)."""
    if not rows:
        return []
    words = {"passed": "pass", "failed": "FAIL", "not judged": "not judged", "nightly": "nightly",
             "left out": "left out"}
    index, texts = cell_notes(rows)
    width = max(len(r.profile) for r in rows) + 2
    head = "profile".ljust(width) + "verdict".ljust(17) + "".join(c.ljust(16) for c in COLUMNS)
    out = ["profiles (one row per optimization; docs/profiles.md, 'The profile verdict'):", head.rstrip()]
    for row in rows:
        line = row.profile.ljust(width) + row.verdict.ljust(17)
        for check in COLUMNS:
            cell = row.cells[check]
            text = words[cell.state]
            if cell.state in ("passed", "failed") and cell.not_judged:
                text += f" {len(cell.tests)}/{len(cell.tests) + cell.not_judged}"
            n = index.get((row.profile, check))
            line += (text + (f" [{n}]" if n else "")).ljust(16)
        out.append(line.rstrip())
    for n, text in enumerate(texts, 1):
        out.append(f"  [{n}] {text.replace('`', '')}")
    if verbose:
        for row in rows:
            for check in COLUMNS:
                cell = row.cells[check]
                if cell.state == "passed":
                    out.append(f"  {row.profile} {check}: passed by {', '.join(cell.tests)}")
    return out


def html_lines(rows: list[ProfileRow]) -> list[str]:
    """The table as an HTML section: each cell's title holds its note and tests."""
    if not rows:
        return []
    index, texts = cell_notes(rows)
    e = html.escape
    legend = ("✓ passed · ✗ failed · not judged here (the note says why) · nightly: judged by the nightly tier (tox -e "
              "cpu-full) · left out of this run")
    out = ['<section class="profiles"><h2>Profiles: is each optimization safe to merge?</h2>',
           f'<p class="legend">{e(legend)}. <a href="{e(DOC)}">What each check runs</a>.</p>',
           '<table class="profiles"><thead><tr><th>profile</th><th>verdict</th>'
           + "".join(f'<th title="{e(CHECK_HELP[c])}">{e(c)}</th>' for c in COLUMNS) + "</tr></thead><tbody>"]
    for row in rows:
        cells = []
        for check in COLUMNS:
            cell = row.cells[check]
            n = index.get((row.profile, check))
            title = "\n".join(([texts[n - 1]] if n else []) + ([f"{cell.state}: {', '.join(cell.tests)}"]
                                                               if cell.tests else []))
            note = f"<sup>{n}</sup>" if n else ""
            cls = cell.state.replace(" ", "-")
            cells.append(f'<td class="{cls}" title="{e(title)}">{e(short(cell, HTML_MARKS))}{note}</td>')
        out.append(f'<tr class="{"failed" if row.failed else ""}"><td><code>{e(row.profile)}</code></td>'
                   f"<td>{e(html_verdict(row))}</td>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    if texts:
        out.append('<ol class="notes">' + "".join(f"<li>{e(t.replace('`', ''))}</li>" for t in texts) + "</ol>")
    out.append("</section>")
    return out
