"""Request traces imported from files: each format's requests and length statistics, the options (cap, sample,
seed), bad input named by file, line and field, and the ``vramgate trace import`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramgate.tools.cli import main as cli_main
from vramgate.workloads import WorkloadError, build
from vramgate.workloads.traces import LengthStats, estimate_tokens, guess_format, import_trace, read_trace

#: Three requests: 10 words in (13 tokens at 1.3 per word), 20 out (26); 2 in (3), 1 out (1); exact counts 40
#: in, 100 out. The system turn and the unanswered prompt make none.
SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "human", "value": "one two three four five six seven eight nine ten"},
        {"from": "gpt", "value": " ".join(["word"] * 20)},
        {"from": "human", "value": "hi there"},
        {"from": "gpt", "value": "ok"},
    ]},
    {"id": "b", "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "x", "num_tokens": 40},
        {"from": "gpt", "value": "y", "num_tokens": 100},
    ]},
    {"id": "c", "conversations": [{"from": "human", "value": "unanswered"}]},
]

#: vLLM's custom dataset lines: 4 words (5 tokens) out 10; 8 words (10 tokens) out 30; an exact prompt of 700.
JSONL = '{"prompt": "a b c d", "output_tokens": 10}\n{"prompt": "a b c d e f g h", "output_len": 30}\n\n' \
        '{"prompt_len": 700, "output_tokens": "50"}\n'

CSV = "input_len,output_len,arrival_s,model\n100,20,10.5,x\n300,40,11.0,y\n50,5,12.25,z\n"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def pairs(path: Path, **kwargs: object) -> list[tuple[int, int]]:
    workload, _ = import_trace(path, **kwargs)  # type: ignore[arg-type]
    return [(r.prompt_len, r.output_len) for r in workload.requests]


def test_sharegpt_pairs_turns_and_estimates_tokens(tmp_path: Path) -> None:
    path = write(tmp_path / "chats.json", json.dumps(SHAREGPT))
    workload, summary = import_trace(path)
    assert [(r.prompt_len, r.output_len) for r in workload.requests] == [(13, 26), (3, 1), (40, 100)]
    assert (workload.name, workload.arrivals, summary.count, summary.read, summary.format) == \
        ("chats", "offline", 3, 3, "sharegpt")
    assert summary.prompt == LengthStats(mean=pytest.approx(56 / 3), p50=13, p90=pytest.approx(34.6),
                                         p99=pytest.approx(39.46), max=40)
    assert summary.output == LengthStats(mean=pytest.approx(127 / 3), p50=26, p90=pytest.approx(85.2),
                                         p99=pytest.approx(98.52), max=100)
    assert summary.arrivals_span_s == 0.0
    assert pairs(path, tokens_per_word=1.0) == [(10, 20), (2, 1), (40, 100)]


def test_token_estimate() -> None:
    assert [estimate_tokens(t) for t in ("", "one", "a b", "a  b\n c d e")] == [1, 1, 3, 7]
    assert estimate_tokens("a b c d e f g h i j", 0.25) == 3  # 2.5 rounds up


def test_vllm_custom_jsonl(tmp_path: Path) -> None:
    path = write(tmp_path / "custom.jsonl", JSONL)
    workload, summary = import_trace(path)
    assert [(r.prompt_len, r.output_len) for r in workload.requests] == [(5, 10), (10, 30), (700, 50)]
    assert (summary.count, summary.prompt.max, summary.output.mean, summary.output.p50) == (3, 700, 30.0, 30.0)
    assert summary.prompt.p90 == pytest.approx(562.0)  # 10 + 690 * 0.8
    with_default = write(tmp_path / "more.jsonl", JSONL + '{"prompt": "x y"}\n')
    assert pairs(with_default, output_len=7)[-1] == (3, 7)


def test_csv_keeps_the_arrival_times_from_zero(tmp_path: Path) -> None:
    path = write(tmp_path / "lengths.csv", CSV)
    workload, summary = import_trace(path)
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in workload.requests] == \
        [(100, 20, 0.0), (300, 40, 0.5), (50, 5, 1.75)]
    assert (workload.arrivals, summary.arrivals_span_s, summary.count) == ("trace", 1.75, 3)
    assert summary.prompt == LengthStats(mean=150.0, p50=100.0, p90=pytest.approx(260.0), p99=pytest.approx(296.0),
                                         max=300)
    assert summary.output.mean == pytest.approx(65 / 3) and summary.output.max == 40
    untimed = write(tmp_path / "untimed.csv", " Output_Len , INPUT_LEN\n7,3\n")
    workload, summary = import_trace(untimed)
    assert [(r.prompt_len, r.output_len) for r in workload.requests] == [(3, 7)]
    assert workload.arrivals == "offline" and "offline" in summary.lines()[-1]


def test_max_model_len_drops_or_clips(tmp_path: Path) -> None:
    path = write(tmp_path / "custom.jsonl", JSONL)
    workload, summary = import_trace(path, max_model_len=512)
    assert [(r.prompt_len, r.output_len) for r in workload.requests] == [(5, 10), (10, 30)]
    assert (summary.read, summary.dropped, summary.clipped, summary.count) == (3, 1, 0, 2)
    assert "1 dropped as too long" in summary.lines()[0]
    workload, summary = import_trace(path, max_model_len=512, too_long="clip")
    assert [(r.prompt_len, r.output_len) for r in workload.requests] == [(5, 10), (10, 30), (511, 1)]
    assert (summary.dropped, summary.clipped) == (0, 1)
    assert pairs(path, max_model_len=30, too_long="clip") == [(5, 10), (10, 20), (29, 1)]
    with pytest.raises(WorkloadError, match=r"custom.jsonl: none of its 3 requests fits max_model_len 8"):
        import_trace(path, max_model_len=8)


def test_a_seeded_sample_in_file_order(tmp_path: Path) -> None:
    rows = "".join(f"{10 * i},{i},{2.0 * i}\n" for i in range(1, 21))
    path = write(tmp_path / "many.csv", "input_len,output_len,arrival_s\n" + rows)
    a, summary = import_trace(path, requests=5, seed=3)
    assert a == import_trace(path, requests=5, seed=3)[0]
    prompts = [r.prompt_len for r in a.requests]
    assert len(prompts) == 5 and prompts == sorted(prompts) and len(set(prompts)) == 5
    assert a.requests[0].arrival_s == 0.0
    assert [r.arrival_s for r in a.requests] == [round(0.2 * (p - prompts[0]), 6) for p in prompts]
    assert (summary.read, summary.count, a.seed) == (20, 5, 3)
    assert "5 sampled" in summary.lines()[0]
    others = {tuple(r.prompt_len for r in import_trace(path, requests=5, seed=s)[0].requests) for s in range(5)}
    assert len(others) > 1
    assert len(import_trace(path, requests=50)[0]) == 20


def test_the_format_comes_from_the_extension(tmp_path: Path) -> None:
    assert [guess_format(Path(p)) for p in ("a.json", "b.JSONL", "c.csv")] == ["sharegpt", "jsonl", "csv"]
    odd = write(tmp_path / "trace.txt", CSV)
    with pytest.raises(WorkloadError, match=r"trace.txt: cannot tell the trace format from the extension '.txt'"):
        import_trace(odd)
    assert len(import_trace(odd, "csv")[0]) == 3


@pytest.mark.parametrize(("name", "text", "fmt", "message"), [
    ("bad.jsonl", '{"prompt": "a", "output_tokens": 1}\n{"prompt": "b", \n', None,
     r"bad.jsonl line 2: not valid JSON"),
    ("bad.jsonl", '{"prompt": "a", "output_tokens": "many"}\n', None,
     r"bad.jsonl line 1: field 'output_tokens': expected a whole number of tokens, got 'many'"),
    ("bad.jsonl", '\n{"text": "a", "output_tokens": 3}\n', None, r"bad.jsonl line 2: field 'prompt': missing"),
    ("bad.jsonl", '{"prompt": "a"}\n', None, r"bad.jsonl line 1: field 'output_tokens': missing"),
    ("bad.jsonl", '["a", 3]\n', None, r"bad.jsonl line 1: expected a JSON object"),
    ("bad.csv", "input_len,out\n3,4\n", None, r"bad.csv line 1: the header has no column 'output_len'"),
    ("bad.csv", "input_len,output_len\n3,4\n5,abc\n", None,
     r"bad.csv line 3: field 'output_len': expected a whole number of tokens, got 'abc'"),
    ("bad.csv", "input_len,output_len\n3,4\n0,4\n", None, r"bad.csv line 3: field 'input_len': must be >= 1"),
    ("bad.csv", "input_len,output_len,arrival_s\n3,4,1\n3,4\n", None, r"bad.csv line 3: field 'arrival_s': missing"),
    ("bad.csv", "input_len,output_len,arrival_s\n3,4,soon\n", None,
     r"bad.csv line 2: field 'arrival_s': expected seconds, got 'soon'"),
    ("bad.csv", "input_len,output_len\n", None, r"bad.csv: no requests in the file"),
    ("bad.json", '[{"id": "a", "conversations": []},\n {"id": "b"}]', None,
     r"bad.json record \[1\] \(id 'b'\): field 'conversations': missing"),
    ("bad.json", '[{"conversations": [{"from": "human", "value": 3}]}]', None,
     r"bad.json record \[0\] turn \[0\]: field 'value': expected text, got int"),
    ("bad.json", '[{"conversations": [{"from": "human", "num_tokens": -2}]}]', None,
     r"bad.json record \[0\] turn \[0\]: field 'num_tokens': must be >= 1"),
    ("bad.json", '{"conversations": []}', None, r"bad.json: a ShareGPT file is a JSON list"),
    ("bad.json", '[\n{"conversations": [}\n]', None, r"bad.json line 2: not valid JSON"),
    ("bad.json", '[{"conversations": [{"from": "system", "value": "x"}]}]', None, r"bad.json: no requests"),
    ("empty.jsonl", "", None, r"empty.jsonl: empty file: no requests"),
    ("empty.csv", "\n", None, r"empty.csv: empty file: no requests"),
    ("empty.json", "  \n", None, r"empty.json: empty file: no requests"),
    ("lengths.txt", "input_len,output_len\n1,1\n", "yaml", r"unknown trace format 'yaml'"),
])
def test_bad_input_names_the_file_line_and_field(tmp_path: Path, name: str, text: str, fmt: str | None,
                                                 message: str) -> None:
    path = write(tmp_path / name, text)
    with pytest.raises(WorkloadError, match=message):
        read_trace(path, fmt)


def test_bad_options(tmp_path: Path) -> None:
    path = write(tmp_path / "lengths.csv", CSV)
    for kwargs, message in [
        ({"name": "sharegpt"}, r"'sharegpt' is a built-in generator's"),
        ({"name": "../x"}, r"workload name '../x': use letters"),
        ({"requests": 0}, r"requests must be >= 1"),
        ({"too_long": "cut"}, r"too long: 'cut'; accepted: drop, clip"),
        ({"max_model_len": 1}, r"max_model_len must be >= 2"),
        ({"tokens_per_word": 0.0}, r"tokens per word must be a positive number"),
        ({"output_len": 0}, r"output length must be >= 1"),
    ]:
        with pytest.raises(WorkloadError, match=message):
            import_trace(path, **kwargs)  # type: ignore[arg-type]


def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "fixtures" / "models").mkdir(parents=True)
    return root


def test_the_command_writes_a_workload_build_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = project(tmp_path)
    path = write(tmp_path / "prod.csv", CSV)
    assert cli_main(["trace", "import", str(path), "--name", "prod", "--max-model-len", "200", "--too-long", "clip",
                     "--root", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "3 requests from prod.csv (csv: 3 read; 1 clipped to fit)"
    assert out[2].split() == ["prompt", "116.3", "100.0", "179.2", "197.0", "199"]  # 100 + 99 * 0.8, 100 + 99 * 0.98
    assert out[3].split() == ["output", "8.7", "5.0", "17.0", "19.7", "20"]
    assert out[4] == "arrivals: the trace's times, spanning 1.75 s"
    saved = root / "fixtures" / "workloads" / "prod.json"
    assert out[5] == f"wrote {saved.resolve()} (workload 'prod', seed 0)"
    assert [p.name for p in saved.parent.iterdir()] == ["prod.json"]  # no temporary file left behind
    loaded = build("prod", requests=3, max_model_len=200, root=root)
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in loaded.requests] == \
        [(100, 20, 0.0), (199, 1, 0.5), (50, 5, 1.75)]
    assert loaded.arrivals == "trace"
    assert json.loads(saved.read_text())["params"] == {"source": "prod.csv", "format": "csv", "max_model_len": 200,
                                                       "too_long": "clip"}


def test_the_command_guesses_the_format_and_names_bad_input(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    root = project(tmp_path)
    chats = write(tmp_path / "chats.json", json.dumps(SHAREGPT))
    assert cli_main(["trace", "import", str(chats), "--requests", "2", "--seed", "1", "--root", str(root)]) == 0
    assert capsys.readouterr().out.startswith("2 requests from chats.json (sharegpt: 3 read; 2 sampled)")
    assert len(build("chats", requests=10, root=root)) == 2
    bad = write(tmp_path / "bad.jsonl", '{"prompt": "a", "output_len": 2}\nnot json\n')
    assert cli_main(["trace", "import", str(bad), "--root", str(root)]) == 2
    assert f"vramgate: error: {bad} line 2: not valid JSON" in capsys.readouterr().err
    assert not (root / "fixtures" / "workloads" / "bad.json").exists()
