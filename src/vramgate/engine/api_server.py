"""The serving subprocess: ``python -m vramgate.engine.api_server SERVER.json``, vLLM's OpenAI-compatible server
for one :class:`~vramgate.engine.spec.EngineSpec`.

It runs what ``vllm serve`` runs (``vllm.entrypoints.launchers.api_server.entry.main``: vLLM's own argument
parser, its ``validate_parsed_serve_args`` and ``run_server``), with three things only this process can do first:

- the engine arguments come from :func:`~vramgate.engine.arguments.engine_kwargs`, the one place that builds them
  for every engine of the gate, turned into the server's command line (:func:`serve_argv`); on CPU the serving
  configuration's ``cpu_memory_bytes`` becomes this NUMA node's fraction with vLLM's own reading of the node, on a
  GPU the device's memory is read through NVML, so this process creates no CUDA context;
- the model folder the server loads is written here (:func:`write_model_folder`): the fixture's ``config.json``
  and a word-level tokenizer over its vocabulary (Note [serving tokenizer]);
- the server ends with the gate: stopped by it (SIGINT, then its process group), or, where the gate is killed
  outright, by itself (Note [no child outlives its gate] in :mod:`vramgate.runtime.process`).

Note [serving tokenizer]: the fixture models have no tokenizer, and vLLM's benchmark client needs one for its
``random`` and ``sharegpt`` datasets (with ``--skip-tokenizer-init`` only ``timed_trace`` runs). A
``tokenizers`` WordLevel model with one word per token id (``w5`` is id 5; ``<unk>``, ``<s>``, ``</s>`` at the
config's ids), split on whitespace, makes every random prompt of N ids a text of N words that the server encodes
back into the same N ids. Server and client load the same folder (``--tokenizer``), so the token counts the
client reports are the engine's.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from vramgate.engine.arguments import engine_kwargs
from vramgate.engine.spec import EngineSpec
from vramgate.runtime import process

if __name__ == "__mp_main__":
    # A process vLLM spawned from this server (its engine core, the core's worker: vLLM's CPU platform spawns):
    # multiprocessing imports the server's main module first, under this name, before anything of vLLM. The ISA cap
    # (Note [ISA cap] in vramgate.machine.isa) must be in force here too, or the worker loads the machine's own
    # kernel library while the API server loaded the capped one.
    from vramgate.machine import isa as _isa

    _isa.apply_cap()
    # Note [CPU rotary layout] in vramgate.engine.cpu_rope: the engine core's worker runs the model here.
    from vramgate.engine import cpu_rope as _cpu_rope

    _cpu_rope.install()

#: Engine arguments the server command line does not take as they are (the server loads a tokenizer; a name
#: for the model is given on its own).
_NOT_FLAGS = frozenset({"model", "skip_tokenizer_init"})


def serve_argv(kwargs: dict[str, Any], model_dir: Path, *, host: str, port: int, served_name: str,
               options: Collection[str]) -> list[str]:
    """The server's command line for engine keyword arguments *kwargs*, given the option strings of vLLM's
    parser (*options*): each ``name=value`` as ``--name value``, True as ``--name``, False as ``--no-name`` where
    the parser takes it and left out where the flag only switches on, lists as repeated values, dicts as JSON.
    ValueError for an engine argument the server has no option for."""
    argv = ["--model", str(model_dir), "--host", host, "--port", str(port), "--served-model-name", served_name,
            "--tokenizer", str(model_dir)]
    for name, value in sorted(kwargs.items()):
        if name in _NOT_FLAGS or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if flag not in options:
            raise ValueError(f"engine argument {name}={value!r} has no option {flag} in vLLM's server")
        if isinstance(value, bool):
            negated = "--no-" + name.replace("_", "-")
            if value:
                argv.append(flag)
            elif negated in options:
                argv.append(negated)
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def write_model_folder(config_path: Path, out: Path) -> Path:
    """*out* with the fixture's ``config.json`` and a word-level tokenizer over its vocabulary (Note [serving
    tokenizer]); returns *out*."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = json.loads(config_path.read_text(encoding="utf-8"))
    vocab_size = int(config.get("text_config", config).get("vocab_size") or config["vocab_size"])
    special = {0: "<unk>"}
    for key, word in (("bos_token_id", "<s>"), ("eos_token_id", "</s>")):
        ids = config.get(key)
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and 0 <= i < vocab_size:
                special.setdefault(i, word)
    vocab = {special.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    (out / "config.json").write_text(config_path.read_text(encoding="utf-8"), encoding="utf-8")
    return out


def main(argv: list[str]) -> int:
    """Entry point: ``python -m vramgate.engine.api_server SERVER.json`` (``spec``, ``root``, ``config``,
    ``model_dir``, ``host``, ``port``, ``served_name``)."""
    if len(argv) != 1:
        print("usage: python -m vramgate.engine.api_server SERVER.json", file=sys.stderr)
        return 2
    process.end_with_parent()  # Note [no child outlives its gate]
    data = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    spec = EngineSpec.from_json(data["spec"], argv[0])
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # Note [KV budget] in vramgate.engine.worker
    from vramgate.machine import isa

    isa.apply_cap()  # Note [ISA cap]: before vLLM picks its kernel library
    model_dir = write_model_folder(Path(data["config"]), Path(data["model_dir"]))
    kwargs = engine_kwargs(spec, model_dir, cuda_context=False)
    server_argv = serve_argv(kwargs, model_dir, host=data["host"], port=int(data["port"]),
                             served_name=data["served_name"], options=server_options())
    print("vllm serve " + " ".join(server_argv), flush=True)
    from vllm.entrypoints.launchers.api_server import entry

    sys.argv = ["vllm serve", *server_argv]
    entry.main()  # what `vllm serve` runs: vLLM's parser, its checks, run_server
    return 0


def server_options() -> set[str]:
    """The option strings of vLLM's server parser (``make_arg_parser``: in ``vllm.entrypoints.launchers.cli_args``
    in vLLM 0.31 and 0.32, ``vllm.entrypoints.common.cli_args`` from 0.33)."""
    import importlib

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for name in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"):
        try:
            cli_args = importlib.import_module(name)
        except ImportError:
            continue
        parser = cli_args.make_arg_parser(FlexibleArgumentParser(description="vLLM server"))
        return {s for action in parser._actions for s in action.option_strings}
    raise ImportError("vLLM's server argument parser (make_arg_parser) is in none of the modules it was in")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
