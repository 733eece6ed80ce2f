"""Model configs of ``fixtures/models`` by name, for the suites."""

from __future__ import annotations

from pathlib import Path

from vramgate.models.config import ModelShape, load_model


class ModelLoader:
    """Loads a model config of ``<root>/fixtures/models`` by name: ``loader("deepseek-v3")``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, name: str) -> ModelShape:
        """The :class:`~vramgate.models.config.ModelShape` of model *name*."""
        return load_model(self.root, name)

    def path(self, name: str) -> Path:
        """The folder of model *name* (its ``config.json``), as vLLM takes it."""
        return load_model(self.root, name).path.parent
