"""Trace records: one :class:`StepTrace` per engine step, holding all five variables.

Plain dataclasses of JSON-ready values (lists, floats, strings), so a record prints,
serialises and compares without torch. Tensors chosen for saving travel separately.
Vocabulary follows ``design.md``: step, seq_id, phase, C, T, N, H, n_kv, kq_mask,
block table, slot mapping, seq_lens / kv_lens / cu_seqlens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: the schema this infertrace writes; older ones read through :func:`infertrace.trace.upgrade.upgrade`
#: (schema 2 renamed ``engine`` -> ``runtime``, ``options.engine`` -> ``options.settings``, thread facts -> ``threads``)
SCHEMA_VERSION = 2

#: the five inference variables a :class:`StepTrace` holds, in display order
VARIABLES = ("hidden", "positions", "mask", "kv", "decode")


@dataclass
class ReqStep:
    """One request's part of a step (the worked-example table row).

    positions: ``[C .. C+T-1]``; visible: per query, the visible key positions as text
    (``"0..2"``); cache_after: positions held after the step; output: sampled token piece.
    """

    seq_id: int
    phase: str
    C: int
    T: int
    token_ids: list[int]
    pieces: list[str]
    positions: list[int]
    visible: list[str]
    cache_before: str
    cache_after: str
    rows: list[int]  # rows of the packed batch this request occupies
    logits_row: int | None = None
    sampled: int | None = None
    sampled_piece: str | None = None
    finished: str | None = None
    prefix: dict[str, Any] | None = None  # prefix-cache lookup at admission: hit, shared blocks/cells, stop reason
    shift: dict[str, Any] | None = None  # context shift done right before this step (n_keep, n_discard, moved)
    visible_swa: list[str] | None = None  # per query, visible keys on sliding-window layers (None: no windowed layer)
    spec: dict[str, Any] | None = None  # speculative verify: tree, verify mask, accepted nodes, rewind (trace/spec_capture.py)


@dataclass
class RowStat:
    """Statistics of one hidden row (float32 units of the embedding), ``first`` = leading values."""

    seq_id: int
    pos: int
    token_id: int
    piece: str
    mean: float
    std: float
    min: float
    max: float
    l2: float
    first: list[float]


@dataclass
class HiddenRec:
    """Initial hidden states (embedding output) of the tokens computed this step."""

    logical_shape: list[int]  # [T, H] per request; here [N, H] packed
    dtype: str
    ggml_ne: list[int]  # llama.cpp inpL ne = [H, N]
    packed_shape: list[int]  # TensorRT-LLM hidden_states [N, H]
    rows: list[RowStat]
    cached_tokens_recomputed: int  # always 0: only current tokens are embedded


@dataclass
class PositionsRec:
    """Positions and RoPE of a step: ``inp_pos``/``position_ids`` ``[N]`` int, pairing, theta, cos/sin
    of the first pairs per token, and evidence that RoPE rotates Q/K and leaves V alone."""

    inp_pos: list[int]  # llama.cpp I32 inp_pos, length N
    position_ids: list[int]  # TensorRT-LLM packed position_ids (same values)
    pairing: str  # "neox" (half-split) at run time
    pairing_in_file: str
    theta: float
    theta_is_default: bool
    rope_dim: int
    head_dim: int
    scaling: dict[str, Any]
    inv_freq_first: list[float]
    cos_sin: list[dict[str, Any]]  # per token: pos, cos/sin of the first pairs
    evidence: dict[str, Any]  # layer, per token |dq|, |dk|, |dv| = 0, norms kept


@dataclass
class MaskRec:
    """Visibility of a step: per-query visible keys, the real kq_mask slice (cells) or the paged
    metadata, and the materialised logical keep-matrix per request ``[T][C+T]``."""

    backend: str
    rule: str
    visible: list[dict[str, Any]]  # per request: seq_id, per-query visible key text
    kq_mask: dict[str, Any] | None  # cells: ne, shape, n_kv, rows (slice as "0"/"-inf")
    metadata: dict[str, Any] | None  # paged: mask_type, seq_lens, kv_lens, cu_seqlens, ...
    logical: list[list[list[int]]]  # per request [T][C+T] keep (1/0), materialised
    swa: dict[str, Any] | None = None  # sliding window: n_swa, layers, global_layers, convention, visible, kq_mask_swa rows


@dataclass
class KVRec:
    """KV cache of a step: logical K/V shapes before/after per request, written cells or slots, the
    backend snapshot after the step and the physical storage shape."""

    backend: str
    dtype: str
    layers: int
    per_request: list[dict[str, Any]]  # seq_id, shape_before, shape_after, written positions, cells/slots
    layer_view: dict[str, Any]  # chosen layer: K/V first values of the written positions
    physical: dict[str, Any]  # backend snapshot after the step (cells map or block tables)
    physical_shape: list[int]


@dataclass
class DecodeRec:
    """Decode loop of a step: logits ``[M, vocab]`` (only rows that need them), per request the
    sampler settings, top-k candidates, chosen token, next input/position and stop reason."""

    logits_shape: list[int]  # [M, vocab], only rows that need logits
    logits_dtype: str
    logits_rows: list[int]
    per_request: list[dict[str, Any]]  # seq_id, row, sampler, top-k, chosen, next input/pos, stop


@dataclass
class StepTrace:
    """Everything captured in one step."""

    step: int
    backend: str
    attention: str
    N: int
    batch: list[ReqStep]
    hidden: HiddenRec | None = None
    positions: PositionsRec | None = None
    mask: MaskRec | None = None
    kv: KVRec | None = None
    decode: DecodeRec | None = None
    preempted: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    time_ms: float = 0.0
    serving: dict[str, Any] | None = None  # prefix lookups, evictions, context shifts, KV audit (engine/serving.py)
    spec: dict[str, Any] | None = None  # speculative decoding: drafted, accepted, acceptance rate of the step
    hybrid: dict[str, Any] | None = None  # hybrid models: layer map, M-RoPE positions, GDN state (capture/hybrid_rec.py)
    vllm: dict[str, Any] | None = None  # run --runtime vllm: vLLM's scheduler output and attention metadata as built (runtimes/vllm)
    hf: dict[str, Any] | None = None  # --runtime hf: HF's forward inputs, masks per layer type, cache lengths (runtimes/hf)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("serving", "spec", "hybrid", "vllm", "hf"):  # only when the mechanism was on (older traces compare equal)
            if d.get(k) is None:
                d.pop(k, None)
        for b in d["batch"]:
            for k in ("prefix", "shift", "spec"):
                if b.get(k) is None:
                    b.pop(k, None)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "StepTrace":
        """Rebuild from :meth:`to_dict` output (raises KeyError/TypeError on malformed input)."""
        def opt(cls, key):
            v = d.get(key)
            return None if v is None else cls(**v)

        hidden = d.get("hidden")
        if hidden is not None:
            hidden = dict(hidden)
            hidden["rows"] = [RowStat(**r) for r in hidden["rows"]]
            hidden = HiddenRec(**hidden)
        return StepTrace(
            step=d["step"], backend=d["backend"], attention=d["attention"], N=d["N"],
            batch=[ReqStep(**b) for b in d["batch"]], hidden=hidden,
            positions=opt(PositionsRec, "positions"), mask=opt(MaskRec, "mask"), kv=opt(KVRec, "kv"),
            decode=opt(DecodeRec, "decode"), preempted=list(d.get("preempted", [])),
            admitted=list(d.get("admitted", [])), time_ms=float(d.get("time_ms", 0.0)),
            serving=d.get("serving") if isinstance(d.get("serving"), dict) else None,
            spec=d.get("spec") if isinstance(d.get("spec"), dict) else None,
            hybrid=d.get("hybrid") if isinstance(d.get("hybrid"), dict) else None,
            vllm=d.get("vllm") if isinstance(d.get("vllm"), dict) else None,
            hf=d.get("hf") if isinstance(d.get("hf"), dict) else None,
        )


@dataclass
class RunTrace:
    """A whole run: model identity, config, options, per-step records, final outputs."""

    model: dict[str, Any]
    config: dict[str, Any]
    options: dict[str, Any]
    notes: list[str]
    steps: list[StepTrace]
    requests: list[dict[str, Any]]  # seq_id, prompt, prompt_ids, output_ids, text, stop_reason
    schema_version: int = SCHEMA_VERSION
    runtime: str = "infertrace"  # who computed: "infertrace" (this engine), "llama.cpp", "vllm" or "hf" (run --runtime ...)
    #: machine facts of the run, like ``time_ms``: in ``to_dict`` (``run --json``) but not in
    #: trace.json (timing.json holds them): ``{"n": int, "reason": str}`` or empty
    threads: dict[str, Any] = field(default_factory=dict)
    #: speculative decoding summary (engine/speculative.py ``Speculator.summary``) or None
    spec: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = [s.to_dict() for s in self.steps]  # without unset serving fields
        if d.get("spec") is None:
            d.pop("spec", None)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RunTrace":
        """Rebuild from :meth:`to_dict` output or a manifest at :data:`SCHEMA_VERSION` (an older saved one is
        upgraded by :func:`infertrace.trace.store.read_manifest` first)."""
        return RunTrace(model=d["model"], config=d["config"], options=d["options"], notes=list(d.get("notes", [])),
                        steps=[StepTrace.from_dict(s) for s in d["steps"]], requests=list(d["requests"]),
                        schema_version=int(d.get("schema_version", SCHEMA_VERSION)),
                        runtime=str(d.get("runtime", "infertrace")), threads=checked_threads(d.get("threads")),
                        spec=d.get("spec") if isinstance(d.get("spec"), dict) else None)


def checked_threads(th: Any) -> dict[str, Any]:
    """``RunTrace.threads`` from untrusted JSON: ``{"n": 1..65536, "reason": str}`` (reason cut at
    200 characters), or ``{}`` for anything else."""
    if (isinstance(th, dict) and isinstance(th.get("n"), int) and not isinstance(th["n"], bool)
            and 1 <= th["n"] <= 65536 and isinstance(th.get("reason"), str)):
        return {"n": th["n"], "reason": th["reason"][:200]}
    return {}
