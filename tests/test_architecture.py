"""The package's layers, as README "Architecture" states them: each imports only the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "vramgate"

#: Layers from the bottom up; a module may import its own layer and those listed before it.
LAYERS = [
    "core", "machine", "store", "models", "workloads", "profiles", "matrix", "runtime", "sim", "engine", "tp",
    "report", "pytest_plugin", "testing", "tools",
]
#: The package's front door and its compatibility aliases may use any layer.
FACADES = {"vramgate", "vramgate.__main__"}
#: The most lines a module may have without its docstring saying why it is longer.
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    if module in FACADES:
        return None
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        raise AssertionError(f"{module} is in no layer: add it to a layer folder (README 'Architecture')")
    return parts[1]


def imports(module: str, path: Path, *, top_level_only: bool = False) -> set[str]:
    """The vramgate modules *module* imports (``from vramgate.x import y`` counts ``vramgate.x.y`` when that
    is a module)."""
    known = modules()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "vramgate")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise AssertionError(f"{module}: relative import; write 'from vramgate... import'")
            if node.module.split(".")[0] != "vramgate":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m in known and m != module}


def test_every_module_is_in_a_layer() -> None:
    for module in modules():
        layer_of(module)


def test_no_module_imports_a_layer_above_its_own() -> None:
    wrong = []
    for module, path in modules().items():
        mine = layer_of(module)
        if mine is None:
            continue
        for dep in sorted(imports(module, path)):
            theirs = layer_of(dep)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                wrong.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert not wrong, "imports against the layers (README 'Architecture'):\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    """Imports form no cycle, module-level or lazy (inside a function): what two modules both need lives below
    both (``vramgate.runtime.exits`` below the child mechanisms, say)."""
    graph = {m: imports(m, p) for m, p in modules().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d):], d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_long_modules_say_why() -> None:
    long = []
    for module, path in modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Longer than" not in doc:
                long.append(f"{module}: {text.count(chr(10))} lines")
    assert not long, f"modules over {MAX_LINES} lines whose docstring does not say why ('Longer than ...'):\n" + \
        "\n".join(long)


def undocumented(module: str, path: Path) -> list[str]:
    """The public names of *module* without a docstring: the module itself, its module-level functions and
    classes, and the methods of its public classes (dunder methods excepted)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    missing = [] if module.split(".")[-1].startswith("_") or ast.get_docstring(tree) else [module]
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if not isinstance(node, defs) or node.name.startswith("_"):
            continue
        if ast.get_docstring(node) is None:
            missing.append(f"{module}.{node.name}")
        if isinstance(node, ast.ClassDef):
            missing += [f"{module}.{node.name}.{m.name}" for m in node.body
                        if isinstance(m, defs) and not m.name.startswith("_") and ast.get_docstring(m) is None]
    return missing


def test_public_names_have_docstrings() -> None:
    missing = [name for module, path in modules().items() for name in undocumented(module, path)]
    assert not missing, "public names without a docstring:\n" + "\n".join(missing)


def test_the_rules_see_a_violation(tmp_path: Path) -> None:
    """The checker itself: an upward import is found."""
    path = tmp_path / "m.py"
    path.write_text("from vramgate.tools.cli import main\n")
    assert "vramgate.tools.cli" in imports("vramgate.core.fake", path)


def test_the_docstring_rule_sees_a_gap(tmp_path: Path) -> None:
    """The checker itself: an undocumented public function and method are found, private names are not."""
    path = tmp_path / "m.py"
    path.write_text('"""A module."""\n\n\ndef f() -> None:\n    pass\n\n\ndef _g() -> None:\n    pass\n\n\n'
                    'class C:\n    """A class."""\n\n    def to_json(self) -> None:\n        pass\n\n'
                    '    def __repr__(self) -> str:\n        return ""\n')
    assert undocumented("vramgate.core.fake", path) == ["vramgate.core.fake.f", "vramgate.core.fake.C.to_json"]


def test_suites_import_only_the_gate_and_its_testing_layer() -> None:
    """A suite builds on ``vramgate`` (the gate fixture's object), ``vramgate.testing`` (the fixtures' classes and
    the marks) and its topic modules (``vramgate.testing.engines``: helpers and the names of the layers below that
    suites use) only: the modules behind them may split or move."""
    root = PACKAGE.parents[1]
    wrong = []
    for path in sorted((root / "suites").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                topic = name.startswith("vramgate.testing.") and name.count(".") == 2
                if name.split(".")[0] == "vramgate" and name not in ("vramgate", "vramgate.testing") and not topic:
                    wrong.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    assert not wrong, "suites import from vramgate, vramgate.testing and its modules only:\n" + "\n".join(wrong)


def test_the_testing_facade_holds_the_fixtures_classes_and_the_marks() -> None:
    """``vramgate.testing`` itself names what the suites' plugin hands out (each fixture's class), the matrix
    mark's case and suite declaration, and the gate's session; the rest lives in its topic modules."""
    import vramgate.testing
    from vramgate.testing import fixtures

    handed_out = {n.id for f in ast.parse(Path(fixtures.__file__).read_text(encoding="utf-8")).body
                  if isinstance(f, ast.FunctionDef) and f.returns for n in ast.walk(f.returns)
                  if isinstance(n, ast.Name)}  # each fixture's class, Iterator[Engine]'s too
    assert set(vramgate.testing.__all__) - handed_out == {"MatrixCase", "gate_session", "matrix_suite"}
    assert len(vramgate.testing.__all__) == 10


def test_the_package_says_it_is_typed_and_ships_its_default_matrix() -> None:
    """PEP 561: ``py.typed`` ships with the package, so users' type checkers read the typed fixtures; so do the
    built-in default matrix (package data, read with importlib.resources) and the calibration's own plants (a
    manifest and its diffs each, which ``vramgate calibrate`` applies in a team's project)."""
    import tomllib

    from vramgate.tools.calibration.engine_latency import PLANTED_EXACT, PLANTS

    assert (PACKAGE / "py.typed").is_file() and (PACKAGE / "matrix" / "default.toml").is_file()
    pyproject = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    data = pyproject["tool"]["setuptools"]["package-data"]["vramgate"]
    assert data == ["py.typed", "matrix/default.toml", "tools/calibration/plants/*/*"]
    plants = {c["plant"] for c, _ in PLANTED_EXACT.values() if "plant" in c}
    for plant in plants:  # PLANTS is where vramgate is installed (a wheel under tox): its package data shipped
        shipped = sorted(f.name for f in (PLANTS / plant).iterdir())
        assert shipped == sorted(f.name for f in PACKAGE.glob(f"{data[2][:-3]}{plant}/*")), plant
        assert "manifest.toml" in shipped and any(name.endswith(".patch") for name in shipped), shipped
    assert plants
