"""Stand-in modules for the tests of code that imports vLLM or torch where neither is installed (or not the CUDA
build): :func:`fake_modules` puts a dotted module tree into ``sys.modules`` for one test."""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from typing import Any

import pytest


def fake_modules(monkeypatch: pytest.MonkeyPatch, tree: Mapping[str, Mapping[str, Any]]) -> dict[str, types.ModuleType]:
    """Install the modules of *tree* (dotted name -> its attributes) for the test, and every package above them:
    each module is also an attribute of its parent, as after an import. The modules, by name."""
    modules: dict[str, types.ModuleType] = {}

    def module(name: str) -> types.ModuleType:
        if name not in modules:
            modules[name] = types.ModuleType(name)
            parent, _, leaf = name.rpartition(".")
            if parent:
                setattr(module(parent), leaf, modules[name])
        return modules[name]

    for name, attributes in tree.items():
        mod = module(name)
        for key, value in attributes.items():
            setattr(mod, key, value)
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return modules
