"""The shared drive loop (``engine/drive.py``) and the shared text helpers (``ranges.py``, ``fmt.py``),
on hand-worked examples.

The drive loop is checked against a scripted engine whose schedule is written out by hand: which
steps run, where ``last_step`` and ``max_steps`` stop, in which order requests are queued and
when ``on_step`` fires. Its use by the real engine is covered by the golden traces
(``test_snapshots.py``), ``dump-kv`` and ``diff-backends`` (``test_cli.py``, ``test_backends.py``).
"""

from __future__ import annotations

import pytest

from infertrace.engine.drive import EncodedRequest, PromptSpec, drive, encode_prompt, encode_requests
from infertrace.engine.options import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.fmt import clip, human_bytes, short
from infertrace.ranges import parse_ranges, range_count, ranges_text


class Scripted:
    """An engine that finishes after ``n_steps`` steps; records every call."""

    def __init__(self, n_steps: int):
        self.n_steps, self.step_no, self.requests, self.calls = n_steps, 0, {}, []

    def add_request(self, prompt_ids, params=None, arrival_step=0, prompt_text=""):
        sid = len(self.requests)
        self.requests[sid] = (prompt_ids, arrival_step, prompt_text)
        self.calls.append(("add", sid))

    def step(self):
        if self.step_no >= self.n_steps:
            return None
        self.calls.append(("step", self.step_no))
        self.step_no += 1
        return f"batch{self.step_no - 1}"


def _reqs(n: int) -> list[EncodedRequest]:
    return [EncodedRequest([i + 1, i + 2], SamplingParams(), i, f"p{i}") for i in range(n)]


def test_drive_queues_in_order_then_steps_until_no_work() -> None:
    e, seen = Scripted(3), []
    out = drive(e, _reqs(2), on_step=seen.append)
    assert e.calls == [("add", 0), ("add", 1), ("step", 0), ("step", 1), ("step", 2)]
    assert seen == ["batch0", "batch1", "batch2"]
    assert out == [([1, 2], 0, "p0"), ([2, 3], 1, "p1")]  # by seq_id


def test_drive_stops_after_last_step_and_max_steps() -> None:
    e = Scripted(10)
    drive(e, _reqs(1), last_step=3)  # steps 0..3 run (dump-kv: the state right after step 3)
    assert [c for c in e.calls if c[0] == "step"] == [("step", k) for k in range(4)]
    e = Scripted(10)
    drive(e, _reqs(1), max_steps=2)
    assert e.step_no == 2
    e = Scripted(10)
    drive(e, _reqs(1), max_steps=None)
    assert e.step_no == 10


def test_encode_requests_is_lazy_so_errors_come_in_request_order() -> None:
    class Tok:
        chat_template = None

        def encode(self, text):
            return [len(text)]

    specs = [PromptSpec("abc", arrival_step=2), PromptSpec("x", chat=True), PromptSpec("", ids=[7, 8])]
    it = encode_requests(Tok(), specs)
    assert next(it) == EncodedRequest([3], specs[0].params, 2, "abc")
    with pytest.raises(InfertraceError, match="no chat template"):
        next(it)
    assert encode_prompt(Tok(), specs[2]) == [7, 8]


def test_range_text_grammar_written_counted_parsed() -> None:
    assert ranges_text([5, 0, 2, 1]) == "0..2,5" and ranges_text([]) == "-"
    assert parse_ranges("0..2,5") == [0, 1, 2, 5] and parse_ranges("-") == []
    assert range_count("0..2,5", 100, 64) == 4 and range_count("-", 100, 64) == 0
    assert range_count("3..1", 100, 64) == -1  # b < a
    assert range_count("0..100", 100, 64) == -1  # a value not below the bound
    assert range_count("01", 100, 64) == -1  # never written by ranges_text
    assert range_count("0,1,2", 100, 4) == -1  # longer than max_chars
    with pytest.raises(ValueError):
        parse_ranges("3..1")
    with pytest.raises(ValueError):
        parse_ranges(5)


def test_human_bytes_and_clip() -> None:
    assert human_bytes(98362432) == "98.4 MB" and human_bytes(512) == "512 B" and human_bytes(2_500_000_000, 2) == "2.50 GB"
    assert human_bytes(1536, binary=True) == "1.5 KiB" and human_bytes(100, binary=True) == "100 B"
    assert human_bytes(3 * 1024 ** 3, binary=True) == "3.0 GiB"
    assert clip("abcdef", 6) == "abcdef" and clip("abcdefg", 6) == "abcde…" and clip("abcdefg", 6, "...") == "abc..."
    assert short("ab") == "'ab'" and short(12) == "12" and short("x" * 70, 10, "...") == "'xxxxxx..."
