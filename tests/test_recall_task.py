"""The recall task (vramgate.models.recall) and the committed recall models' files: what the answers are, and that
the checkpoints are the ones their recall.json describes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from vramgate.models import recall
from vramgate.models.recall_weights import ARCHS, CODE_DIMS, position_pairs

ROOT = Path(__file__).resolve().parents[1]
MODELS = {arch: ROOT / "fixtures/models" / f"recall-{arch}" for arch in ("llama", "llama-gqa", "deepseek-v2")}


def test_a_prompt_is_bos_content_sep_repeated_and_its_answer_continues_it() -> None:
    [short, long] = recall.prompts(3, [6, 1030])
    assert short[0] == recall.BOS and short[-1] == recall.SEP and len(short) == 6
    content = short[1:5]
    assert len(set(content)) == 4 and all(t >= recall.FIRST_CONTENT for t in content)
    assert recall.expected(short, 6) == [*content, recall.SEP, content[0]]
    assert recall.period_of(1030) == recall.MAX_PERIOD == long.index(recall.SEP) - 1
    assert recall.expected(long, 3) == long[5:8]  # the prompt already repeats: the answer continues the cycle


def test_prompts_are_a_function_of_seed_index_and_length() -> None:
    assert recall.prompts(1, [40, 300]) == recall.prompts(1, [40, 300])
    assert recall.prompts(1, [40, 300]) != recall.prompts(2, [40, 300])
    a, b = recall.prompts(1, [40, 40])
    assert a != b  # two requests of one length ask different things


def test_shared_prefixes_share_their_first_content_tokens() -> None:
    a, b = recall.prompts(0, [50, 60], [20, 20])
    assert a[:20] == b[:20] and a[20:25] != b[20:25]
    assert len(set(a[1:49])) == 48  # content tokens stay distinct within a period


def test_answers_are_judged_only_where_the_prompt_determines_them() -> None:
    assert recall.expected([recall.BOS], 4) is None
    assert recall.expected([recall.BOS, 9, 10], 2) is None  # no SEP yet: the period is unknown
    prompts = recall.prompts(0, [10, 20, 1])
    outputs = [recall.expected(prompts[0], 5), [4, 4, 4, 4, 4], [7]]
    assert recall.accuracy(prompts, outputs) == (0.5, 2)


def test_a_request_longer_than_the_vocabulary_allows_is_refused() -> None:
    with pytest.raises(recall.TaskError, match="distinct tokens"):
        recall.content(0, 0, recall.VOCAB)
    with pytest.raises(recall.TaskError, match="prompt length 0"):
        recall.prompts(0, [0])


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_the_committed_checkpoint_is_the_one_its_description_names(arch: str) -> None:
    folder = MODELS[arch]
    described = recall.RecallModel.read(folder)
    assert described is not None and described.task == "recall"
    weights = folder / described.weights
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == described.sha256, (
        f"{weights} is not the checkpoint {folder / recall.MODEL_FILE} describes: remake it with "
        f"`{described.command}` (and commit both)")
    assert described.accuracy == 1.0 and described.details["min_margin_logits"] >= 8
    assert json.loads((folder / "config.json").read_text()) == json.loads(json.dumps(ARCHS[arch].config()))


def test_a_folder_without_a_description_is_dummy_and_a_broken_one_says_where(tmp_path: Path) -> None:
    assert recall.RecallModel.read(ROOT / "fixtures/models/tiny-llama") is None
    (tmp_path / recall.MODEL_FILE).write_text('{"task": "recall"}')
    with pytest.raises(recall.TaskError, match=r"recall\.json: not a recall model's description"):
        recall.RecallModel.read(tmp_path)


def test_the_llama_keeps_enough_still_rotary_dimensions_for_its_codes() -> None:
    arch = ARCHS["llama"]
    pairs = position_pairs(arch)
    assert 2 * (arch.head_dim // 2 - pairs) >= CODE_DIMS + 1
    assert position_pairs(ARCHS["deepseek-v2"]) == ARCHS["deepseek-v2"].qk_rope // 2


def test_the_gqa_llama_keeps_the_llamas_kv_bytes_and_puts_its_circuit_where_a_wrong_head_mapping_breaks_it() -> None:
    plain, gqa = ARCHS["llama"], ARCHS["llama-gqa"]
    assert gqa.heads == 2 * gqa.kv_heads and (gqa.kv_heads, gqa.head_dim, gqa.layers) == (
        plain.kv_heads, plain.head_dim, plain.layers)
    group = gqa.heads // gqa.kv_heads
    used_kv = set()
    for layer in range(gqa.layers):
        q_head, kv_head = gqa.circuit_heads(layer)
        assert q_head // group == kv_head  # vLLM's (and the reference's) pairing of query and KV heads
        assert q_head % gqa.kv_heads != kv_head  # another pairing reads another KV head: the answers change
        used_kv.add(kv_head)
    assert used_kv == set(range(gqa.kv_heads))
    assert [plain.circuit_heads(layer) for layer in range(plain.layers)] == [(0, 0), (0, 0)]
