"""The Runtime seam without a model: the registry drives the CLI's choices and the store, a runtime's refusals
are mapped to flags, and the one loop (runtimes/loop.py) assembles a trace from a runtime's header one way.

The fake runtime below implements the protocol by hand; every expected value is written out here, not read
back from infertrace's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from infertrace.engine.options import EngineOptions, SamplingParams
from infertrace.errors import InfertraceError
from infertrace.runtimes import api
from infertrace.runtimes.api import RunSettings, RuntimeHeader, RuntimeInfo, SettingRefused, StepRecord


def test_runtime_choices_come_from_the_registry() -> None:
    from infertrace.cli.common import RUNTIMES
    from infertrace.trace.store import RUNTIMES as STORED

    assert RUNTIMES == STORED == ("infertrace", "llama.cpp", "vllm", "hf") == api.names()
    assert api.info("vllm").convention == "paged" and api.info("infertrace").conventions == ("cells", "paged")
    with pytest.raises(InfertraceError, match="unknown runtime 'x'; choose from infertrace, llama.cpp, vllm"):
        api.info("x")


def test_native_sections_and_who_takes_a_setting() -> None:
    assert (api.native_of("vllm"), api.native_of("llama.cpp"), api.native_of("infertrace"), api.native_of(3)) == \
        ("vllm", "llama_cpp", "", "")
    assert api.takers("native.flash_attn") == ("llama.cpp",)
    assert api.takers("native.replay") == ("infertrace",)
    assert api.takers("forced") == ("infertrace", "llama.cpp", "hf")
    assert api.takers("tensor_parallel_size") == ("vllm",)
    assert api.takers("opts.backend") == ()


@pytest.mark.parametrize("settings, setting", [
    (RunSettings(EngineOptions(backend="paged")), "opts.backend"),
    (RunSettings(EngineOptions(), native={"replay": "d"}), "native.replay"),
    (RunSettings(EngineOptions(), tensor_parallel_size=2), "tensor_parallel_size"),
    (RunSettings(EngineOptions(speculative="draft")), "opts.speculative"),
    (RunSettings(EngineOptions(kv_dtype="f16")), "opts.kv_dtype"),
])
def test_declared_checks_refuse_what_an_entry_does_not_declare(settings: RunSettings, setting: str) -> None:
    with pytest.raises(SettingRefused) as e:
        api.check_declared(api.info("llama.cpp"), settings)
    assert (e.value.runtime, e.value.setting) == ("llama.cpp", setting)


def test_an_entry_that_taps_one_layer_refuses_several() -> None:
    """Every registered runtime taps any layers now (llama.cpp's graph nodes, vLLM's and HF's module hooks); an
    entry declaring one layer only is still held to it."""
    from dataclasses import replace

    assert all(api.info(n).all_layers for n in api.names())
    one = replace(api.info("llama.cpp"), all_layers=False)
    with pytest.raises(SettingRefused) as e:
        api.check_declared(one, RunSettings(EngineOptions(), layer=1, tensor_layers=(1, 2)))
    assert e.value.setting == "tensor_layers"


def test_a_refusal_names_the_flag() -> None:
    from infertrace.cli.run import refusals_as_flags

    with pytest.raises(InfertraceError) as e, refusals_as_flags({"opts.kv_dtype": "f16"}):
        raise SettingRefused("vllm", "opts.kv_dtype", "vLLM keeps its own cache dtype")
    assert str(e.value) == "--runtime vllm: vLLM keeps its own cache dtype; drop --kv-dtype f16"
    with pytest.raises(InfertraceError) as e, refusals_as_flags():
        raise SettingRefused("vllm", "forced", "vllm samples its own tokens")
    assert str(e.value) == "--teacher-force needs --runtime infertrace or llama.cpp or hf (vllm samples its own tokens)"


# ----------------------------------------------------------------------------- the loop on a fake runtime


@dataclass
class _Req:
    seq_id: int
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_step: int
    output_ids: list[int]
    stop_reason: str | None = None
    num_preemptions: int = 0


class _Tok:
    warnings = ["tokenizer note"]

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class _Cfg:
    n_layer = 2

    def to_dict(self) -> dict[str, Any]:
        return {"n_layer": 2}


class _Ckpt:
    def __init__(self, path: Path):
        self.path, self.notes, self.metadata = path, ["model note"], {"k": 1}
        self.config = type("C", (), {"name": "fake", "source": "gguf"})()


class _Loaded:
    def __init__(self, path: Path):
        self.config, self.tokenizer, self.ckpt = _Cfg(), _Tok(), _Ckpt(path)


class FakeRuntime:
    """Emits token 'x' once per request, one step per request, then stops; counts closes."""

    info: ClassVar[RuntimeInfo] = RuntimeInfo("vllm", "fake", "m:C", ("paged",), own_weights=True, native="vllm")
    closed = 0

    @classmethod
    def check(cls, settings: RunSettings, model_config: Any = None) -> RunSettings:
        return settings

    def __init__(self, loaded: Any, settings: RunSettings, tensors: Any = None):
        self.settings, self.reqs, self.n = settings, [], 0

    def add_request(self, r: Any) -> int:
        self.reqs.append(_Req(len(self.reqs), r.text, list(r.ids), r.params, r.arrival_step, []))
        return len(self.reqs) - 1

    def step(self) -> StepRecord | None:
        if self.n == len(self.reqs):
            return None
        r = self.reqs[self.n]
        r.output_ids, r.stop_reason = [ord("x")], "max_new_tokens"
        self.n += 1
        return StepRecord(self.n - 1, {"step": self.n - 1}, {"scheduled": [r.seq_id]})

    def requests(self) -> list[dict[str, Any]]:
        return [api.request_record(r, _Tok(), own=1) for r in self.reqs]

    def header(self) -> RuntimeHeader:
        return RuntimeHeader("paged", "fake-attn", {"ctx_size": 8}, options={"sampler_order": "hf", "vllm": {"v": 1}},
                             notes=("runtime note",))

    def close(self) -> None:
        FakeRuntime.closed += 1


def test_the_loop_assembles_the_trace_one_way(tmp_path: Path) -> None:
    from infertrace.engine.drive import PromptSpec
    from infertrace.runtimes.loop import record_run

    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    seen = []
    FakeRuntime.closed = 0
    tr = record_run(FakeRuntime, _Loaded(f), [PromptSpec("ab"), PromptSpec("c", arrival_step=1)],
                    RunSettings(EngineOptions(), layer=1, show=("mask",), record={"dtype": "float32", "device": "cpu"}),
                    on_step=seen.append)
    assert list(tr.options) == ["backend", "attention", "dtype", "device", "settings", "layer", "show", "sampler_order", "vllm"]
    assert tr.options["layer"] == 1 and tr.options["show"] == ["mask"] and tr.options["settings"] == {"ctx_size": 8}
    assert tr.notes == ["model note", "tokenizer note", "runtime note"]
    assert tr.runtime == "vllm" and seen == [{"step": 0}, {"step": 1}] and tr.steps == seen
    assert [(r["seq_id"], r["prompt_ids"], r["text"], r["arrival_step"], r["own"]) for r in tr.requests] == \
        [(0, [97, 98], "x", 0, 1), (1, [99], "x", 1, 1)]
    assert set(tr.threads) == {"n", "reason"} and FakeRuntime.closed == 1


def test_the_loop_closes_the_runtime_after_an_error(tmp_path: Path) -> None:
    from infertrace.engine.drive import PromptSpec
    from infertrace.runtimes.loop import record_run

    class Failing(FakeRuntime):
        def step(self) -> StepRecord | None:
            raise InfertraceError("boom")

    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    FakeRuntime.closed = 0
    with pytest.raises(InfertraceError, match="boom"):
        record_run(Failing, _Loaded(f), [PromptSpec("ab")], RunSettings(EngineOptions()))
    assert FakeRuntime.closed == 1
    with pytest.raises(InfertraceError, match="run.layer: 2 out of range: the model has layers 0..1"):
        record_run(Failing, _Loaded(f), [PromptSpec("ab")], RunSettings(EngineOptions(), layer=2))
