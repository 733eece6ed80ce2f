"""The recall task: what the gate's recall models answer, and what their answers should be.

Note [recall task]: an engine's outputs mean something only if its model's weights do; with
``load_format="dummy"`` every prompt gets a 2-token loop, and a patch that corrupts the KV cache or the attention
leaves them unchanged. The models in ``fixtures/models/recall-*`` (their weights: Note [recall weights] in
:mod:`vramgate.models.recall_weights`) answer one synthetic task, cyclic copying: a prompt is the first L tokens of

    BOS  c_1 ... c_P  SEP  c_1 ... c_P  SEP  c_1 ...

where ``c`` is P distinct content tokens, and the answer is the sequence's next tokens. Answering token t needs
the token one period back (distance P + 1, up to hundreds or thousands of tokens, across many KV blocks) and the
one just before it: an attention patch with a wrong scale, a block manager that hands a request's block to another
or drops an old one, a recompute after preemption that loses a block, all change the answers.

The period of a request of prompt length L is ``min(L - 2, MAX_PERIOD)``: a prompt of up to ``MAX_PERIOD + 2``
tokens is ``BOS c SEP`` and its answer is a copy of the whole prompt; a longer one already repeats. Everything is a
pure function of (seed, request index, lengths): the engine and the checks compute the same prompts. A request's
shared prefix (``prefix_len``) shares its first content tokens with every other request of the workload.

Answers are judged where they are determined: a prompt shorter than 3 tokens has no period yet, and its answer is
not judged (:func:`expected` returns None).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Vocabulary of the recall models: ids 0-3 special, 4.. content.
VOCAB = 2048
PAD, BOS, EOS, SEP = 0, 1, 2, 3
FIRST_CONTENT = 4
#: The longest period a prompt gets.
MAX_PERIOD = 1024
#: The file beside a recall model's config that says which task it answers and how it was made.
MODEL_FILE = "recall.json"


class TaskError(ValueError):
    """A recall model's description that cannot be read, or a request the task cannot make a prompt for."""


def sequence(content: Sequence[int], length: int) -> list[int]:
    """The first *length* tokens of ``BOS (content SEP)*``."""
    period = [*content, SEP]
    out = [BOS]
    while len(out) < length:
        out.extend(period[: length - len(out)])
    return out


def period_of(prompt_len: int) -> int:
    """The content length of a prompt of *prompt_len* tokens (0: too short to have one)."""
    return max(0, min(prompt_len - 2, MAX_PERIOD))


def content(seed: int, index: int, period: int, shared: Sequence[int] = ()) -> list[int]:
    """*period* distinct content tokens for request *index*; the first ones are *shared* (a shared prefix)."""
    if period > VOCAB - FIRST_CONTENT:
        raise TaskError(f"period {period} needs more distinct tokens than the vocabulary has ({VOCAB})")
    head = list(shared[:period])
    rng = random.Random(f"recall-{seed}-{index}")
    rest = [t for t in rng.sample(range(FIRST_CONTENT, VOCAB), period + len(head)) if t not in set(head)]
    return head + rest[: period - len(head)]


def prompts(seed: int, lengths: Sequence[int], prefix_lens: Sequence[int] | None = None) -> list[list[int]]:
    """Prompt token ids for requests of *lengths* (and shared prefixes of *prefix_lens* tokens, BOS included)."""
    prefix_lens = list(prefix_lens) if prefix_lens is not None else [0] * len(lengths)
    if len(prefix_lens) != len(lengths):
        raise TaskError(f"{len(lengths)} prompt lengths but {len(prefix_lens)} prefix lengths")
    longest = max((min(p, length) - 1 for p, length in zip(prefix_lens, lengths, strict=True)), default=0)
    shared = random.Random(f"recall-{seed}-prefix").sample(range(FIRST_CONTENT, VOCAB), max(0, min(longest,
                                                                                                MAX_PERIOD)))
    out = []
    for i, (length, prefix) in enumerate(zip(lengths, prefix_lens, strict=True)):
        if length < 1:
            raise TaskError(f"request {i}: prompt length {length} < 1")
        period = period_of(length)
        out.append(sequence(content(seed, i, period, shared[: max(0, prefix - 1)]), length))
    return out


def expected(prompt: Sequence[int], n: int) -> list[int] | None:
    """The *n* tokens that answer *prompt*, or None where the prompt does not determine them."""
    if len(prompt) < 3 or prompt[0] != BOS:
        return None
    try:
        first_sep = list(prompt).index(SEP)
    except ValueError:
        return None
    period = list(prompt[1:first_sep])
    return sequence(period, len(prompt) + n)[len(prompt):]


def accuracy(prompts_: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> tuple[float, int]:
    """Exact-match accuracy of *outputs* over the requests whose answer is determined, and how many those are."""
    judged = right = 0
    for prompt, out in zip(prompts_, outputs, strict=True):
        want = expected(prompt, len(out))
        if want is None:
            continue
        judged += 1
        right += list(out) == want
    return (right / judged if judged else 0.0), judged


@dataclass(frozen=True)
class RecallModel:
    """What ``recall.json`` says of a recall model: its task, the command and seed that made it, its file's hash
    and the accuracy it was made with."""

    task: str
    weights: str
    sha256: str
    command: str
    seed: int
    accuracy: float
    details: dict[str, Any]

    @classmethod
    def read(cls, model_dir: Path) -> RecallModel | None:
        """The description in *model_dir*, or None when the model there has no weights of its own (dummy)."""
        path = model_dir / MODEL_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(task=str(data["task"]), weights=str(data["weights"]), sha256=str(data["sha256"]),
                       command=str(data["command"]), seed=int(data["seed"]), accuracy=float(data["accuracy"]),
                       details=dict(data.get("details", {})))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TaskError(f"{path}: not a recall model's description ({exc})") from exc
