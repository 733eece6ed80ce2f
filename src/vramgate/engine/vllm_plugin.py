"""The gate's vLLM plugin: a ``vllm.general_plugins`` entry point (``pyproject.toml``) that installs the memory hooks
(:func:`vramgate.engine.memory_decision.install_hooks`) in every process where vLLM runs a model worker.

Note [hooks in every rank]: the hooks catch figures vLLM keeps only in locals (Note [automatic KV] in
:mod:`vramgate.engine.memory_decision`), so they must be installed in the process of each tensor-parallel rank.
A rank vLLM forks from the engine's process inherits what that process installed; a rank it spawns (it does when
CUDA is initialized in the parent, or when ``VLLM_WORKER_MULTIPROC_METHOD=spawn``) starts a fresh interpreter.
vLLM loads the ``vllm.general_plugins`` entry points in every process of its own, and runs each once per process
(``vllm.plugins.load_general_plugins``): in the engine arguments' ``__post_init__`` (the engine's process, where
a single rank runs in process), in ``EngineCore.__init__`` and in ``WorkerWrapperBase.init_worker``, before the
worker is made (all of the group, unless ``VLLM_PLUGINS`` names the ones to load: then it must name ``vramgate``).
``tests/test_vllm_memory_contracts.py`` pins those calls and the group's name.

vLLM loads every entry point of the group in every process, a team's own vLLM too where vramgate is installed,
so :func:`register` does nothing unless the engine process asked for the hooks (:data:`MEMORY_HOOKS_ENV`, set by
:mod:`vramgate.engine.worker` for a run without a KV budget, and inherited by the ranks vLLM starts). The entry
point is there only where vramgate is installed (``tox`` installs it); from a source tree the engine's process
installs the hooks itself, which reaches the ranks vLLM forks.

This module imports nothing of vLLM or torch; :func:`register` imports what the hooks need only when asked.
"""

from __future__ import annotations

import os

#: Set to ``1`` in an engine's process (and so in the ranks vLLM starts from it) to have the plugin install the
#: memory hooks (Note [hooks in every rank]).
MEMORY_HOOKS_ENV = "VRAMGATE_MEMORY_HOOKS"
#: Set to ``1`` in an engine's process to have the plugin give vLLM's CPU rotary kernel the layout it reads (Note
#: [CPU rotary layout] in :mod:`vramgate.engine.cpu_rope`) in every process of vLLM's, the ranks it spawns included.
ROPE_LAYOUT_ENV = "VRAMGATE_CPU_ROPE_LAYOUT"


def hooks_requested() -> bool:
    """Whether this process was asked for the memory hooks (:data:`MEMORY_HOOKS_ENV` is ``1``)."""
    return os.environ.get(MEMORY_HOOKS_ENV) == "1"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the memory hooks where the engine asked for them
    (Note [hooks in every rank]) and the CPU rotary kernel's layout (Note [CPU rotary layout] in
    :mod:`vramgate.engine.cpu_rope`); nothing elsewhere."""
    from vramgate.engine import diff_lines

    diff_lines.install()  # Note [diff ran]: nothing unless the run watches a profile's diff
    if os.environ.get(ROPE_LAYOUT_ENV) == "1":
        from vramgate.engine.cpu_rope import install as give_rope_layout

        give_rope_layout()
    if not hooks_requested():
        return
    from vramgate.engine.memory_decision import install_hooks

    install_hooks()
