"""The calibration pages' commands give their tables: each ``vramgate calibrate paired analyze`` command a page in
``calibration/`` names, rerun on the stored trials, yields the rows of the page's first tables (a page whose trials
file has grown since names its trials with ``--indices``, one judged against stored baselines keeps a copy of them
for ``--baselines``, one of an earlier rule names it with ``--looks``). The noise model's columns are left out
(``--model-runs`` is dropped: they are seeded, but slow), and so are the commands that judge against the campaign's
own history (``--own-history``: up to minutes each)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "calibration"


def commands() -> list[tuple[str, list[str]]]:
    out = []
    for page in sorted(CALIBRATION.glob("*.md")):
        for line in re.findall(r"^vramgate calibrate paired analyze .*$", page.read_text(encoding="utf-8"), re.M):
            variants = [line]
            if "[" in line:  # "[--looks 2 --screen 0]": the page's tables under both rules
                variants = [re.sub(r"\s*\[.*\]", "", line), line.replace("[", "").replace("]", "")]
            for v in variants:
                args, keep, skip = shlex.split(v)[3:], [], False
                for a in args:
                    if skip:
                        skip = False
                    elif a in ("--model-runs", "--bootstrap"):
                        skip = True
                    else:
                        keep.append(a)
                if "--own-history" not in keep:
                    out.append((page.name, keep))
    return out


COMMANDS = commands()


def test_the_pages_name_commands() -> None:
    assert len(COMMANDS) >= 10
    assert {name for name, _ in COMMANDS} >= {"three-looks.md", "cpu-x86_64-avx512-bf16-amd-epyc-gate-runs.md"}


@pytest.mark.parametrize(("page", "args"), COMMANDS, ids=[f"{p}:{' '.join(a[2:]) or 'default'}" for p, a in COMMANDS])
def test_a_pages_command_gives_its_tables(page: str, args: list[str], monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from vramgate.tools.calibration.gate_paired import main

    monkeypatch.chdir(ROOT)
    assert main(args) == 0
    rows = [line.strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| profile") and line.count("|") == 9]
    assert rows
    on_page = {line.strip() for line in (CALIBRATION / page).read_text(encoding="utf-8").splitlines()}
    missing = [r for r in rows if r not in on_page]
    assert not missing, f"{page}: `{shlex.join(['vramgate calibrate paired', *args])}` gives rows the page lacks: " \
                        f"{missing}"
