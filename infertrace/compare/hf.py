"""``diff-runtimes hf``: our engine (one backend, continuous batching) against HF transformers
recomputing each request alone with its own cache. (``diff-runtimes llama.cpp`` is
:mod:`infertrace.compare.llamacpp`: llama.cpp on the same schedule, its graph inputs captured.)

Our run records, per step, the logits row of every request that samples (its context length
``L = C + T`` at that step). The reference is fed the same token sequence (prompt + our
sampled tokens, teacher-forced) and gives logits at every position; row ``L - 1`` is compared
with ours (max |Δ|) and the greedy tokens (argmax of both rows) must agree.

References:

* ``hf``: HF transformers ``AutoModelForCausalLM`` on the same checkpoint (GGUF via
  ``gguf_file=``, dequantised to float32), prompt then one token at a time with its
  ``past_key_values`` (HF ``DynamicCache``).
transformers is optional: a missing package is a one-line error naming the extra to install.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.errors import InfertraceError

#: default tolerance on logits per reference (ours is float32 on dequantised weights)
ATOL = {"hf": 1e-3}
AGAINST = ("hf",)
#: what each reference runs, as the report names it
REFERENCE = {"hf": "HF transformers, float32, one request at a time with its own cache"}

Reference = Callable[[list[int], int], torch.Tensor]  # (token ids [L], prompt length) -> logits [L, V] float32

_HF_CACHE: dict[str, Any] = {}


class LogitsCapture:
    """Tracer keeping, per step, ``(seq_id, L, logits [V])`` of every request that sampled."""

    enabled = True
    layers: frozenset[int] = frozenset()
    taps: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def tap(self, name: str, **tensors: Any) -> None:
        return None

    def begin_step(self) -> None:
        return None

    def end_step(self, ctx: dict[str, Any]) -> None:
        j = 0
        for c in ctx["batch"].chunks:
            if c.need_logits:
                s = ctx["samples"][c.req.seq_id]
                self.rows.append({"step": ctx["step"], "seq_id": c.req.seq_id, "L": c.C + c.T, "phase": c.phase,
                                  "logits": ctx["logits"][j].clone(), "sampled": s.token})
                j += 1


def _transformers(who: str) -> Any:
    """The ``transformers`` module, or one line saying how to install it (``who``: the option that needs it)."""
    try:
        import transformers
    except ImportError:
        raise InfertraceError(f"{who} needs transformers: run `make setup-dev` in the infertrace checkout (or "
                              "`.venv/bin/pip install -e '.[dev]'` there)") from None
    return transformers


def hf_model(path: Path) -> Any:
    """HF transformers' ``AutoModelForCausalLM`` on ``path`` (GGUF file or HF directory), float32, eval mode; one
    loaded model is kept (the same cache :func:`hf_reference` uses).

    Raises:
        InfertraceError: transformers missing (``make setup-dev``) or load failure.
    """
    transformers = _transformers("--runtime hf")
    key = str(Path(path).resolve())
    model = _HF_CACHE.get(key)
    if model is None:
        with _quiet_transformers(transformers):
            model = _load_hf(transformers, Path(path))
        _HF_CACHE.clear()
        _HF_CACHE[key] = model
    return model


def hf_reference(path: Path) -> Reference:
    """HF transformers on ``path`` (GGUF file or HF directory), float32, its own KV cache.

    Raises:
        InfertraceError: transformers missing (``make setup-dev``) or load failure.
    """
    transformers = _transformers("diff-runtimes hf")
    key = str(Path(path).resolve())
    model = _HF_CACHE.get(key)
    with _quiet_transformers(transformers):
        if model is None:
            model = _load_hf(transformers, Path(path))
            _HF_CACHE.clear()
            _HF_CACHE[key] = model

    @torch.no_grad()
    def logits(ids: list[int], n_prompt: int) -> torch.Tensor:
        out, past = [], None
        feed = [ids[:n_prompt]] + [[t] for t in ids[n_prompt:]]  # prompt at once, then one token per call
        with _quiet_transformers(transformers):
            for chunk in feed:
                res = model(torch.tensor([chunk]), past_key_values=past, use_cache=True)
                past = res.past_key_values
                out.append(res.logits[0].float())  # [len(chunk), V]
        return torch.cat(out)  # [L, V]

    return logits


@contextlib.contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    """Silence transformers' progress bars, logging, deprecation warnings and stderr for the block."""
    tl = transformers.utils.logging
    verbosity, bars = tl.get_verbosity(), tl.is_progress_bar_enabled()
    tl.set_verbosity_error()
    tl.disable_progress_bar()
    try:
        # the GGUF loader draws a plain tqdm bar on stderr: swallow it (errors still raise)
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        tl.set_verbosity(verbosity)
        if bars:
            tl.enable_progress_bar()


def _load_hf(transformers: Any, p: Path) -> Any:
    """``AutoModelForCausalLM`` in float32 from a GGUF file (``gguf_file=``) or an HF directory."""
    kw: dict[str, Any] = {"gguf_file": p.name} if p.is_file() else {}
    where = str(p.parent) if p.is_file() else str(p)
    try:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = transformers.AutoModelForCausalLM.from_pretrained(where, torch_dtype=torch.float32, **kw)
    except (OSError, ValueError, KeyError) as e:
        raise InfertraceError(f"HF transformers cannot load {p.name}: {str(e).splitlines()[0]}") from e
    return model.eval()


def compare_with_reference(loaded: Any, prompts: list[Any], opts: EngineOptions, against: str,
                           atol: float | None = None) -> dict[str, Any]:
    """Run our engine (``opts.backend``) on all requests, then check every sampled row against
    the reference recomputing each request alone.

    Returns:
        ``{"against", "backend", "atol", "rows": [{"step", "seq_id", "pos", "phase", "max_abs", "ours", "ref",
        "sampled", "ok"}], "requests": [{"seq_id", "greedy_ours", "greedy_ref", "tokens_equal", "max_abs"}],
        "mismatches": [{"step", "variable", "detail"}], "identical": bool, "padded_vocab": dict | None}``; with a
        padded vocabulary (``Engine.padded_vocab``) logits and argmax over the tokenizer's rows only (ours
        are -inf past them).

    Raises:
        InfertraceError: unknown ``against``, reference package missing, engine errors.
    """
    from infertrace.engine.drive import drive, encode_requests

    if against not in AGAINST:
        raise InfertraceError(f"diff-runtimes NAME must be one of {', '.join(AGAINST)} (got {against!r})")
    atol = ATOL[against] if atol is None else atol
    cap = LogitsCapture()
    eng = Engine(loaded.model, loaded.tokenizer, opts, cap)
    drive(eng, encode_requests(loaded.tokenizer, prompts))
    ref = hf_reference(loaded.ckpt.path)
    ref_logits = {}
    for sid, r in sorted(eng.requests.items()):
        ids = r.all_ids[:-1] if r.output_ids else r.all_ids  # the last sampled token is never fed back
        ref_logits[sid] = ref(ids, len(r.prompt_ids))  # [len(ids), V]
    rows, mismatches, per_req = [], [], {}
    n = eng.n_sample_rows  # padded vocabulary: compared (and argmax taken) over the tokenizer's rows only
    for row in cap.rows:
        sid, L = row["seq_id"], row["L"]
        theirs = ref_logits[sid][L - 1][:n]  # [V] (or [n_tokens])
        ours = row["logits"][:n]
        d = float((ours - theirs).abs().max())
        ours_arg, ref_arg = int(ours.argmax()), int(theirs.argmax())
        ok = d <= atol and ours_arg == ref_arg
        rows.append({"step": row["step"], "seq_id": sid, "pos": L - 1, "phase": row["phase"], "max_abs": d,
                     "ours": ours_arg, "ref": ref_arg, "sampled": row["sampled"], "ok": ok})
        pr = per_req.setdefault(sid, {"seq_id": sid, "greedy_ours": [], "greedy_ref": [], "max_abs": 0.0})
        pr["greedy_ours"].append(ours_arg)
        pr["greedy_ref"].append(ref_arg)
        pr["max_abs"] = max(pr["max_abs"], d)
        if ours_arg != ref_arg:
            mismatches.append({"step": row["step"], "variable": "tokens",
                               "detail": f"seq {sid} pos {L - 1}: argmax ours {ours_arg} vs {against} {ref_arg}"})
        if d > atol:
            mismatches.append({"step": row["step"], "variable": "logits",
                               "detail": f"seq {sid} pos {L - 1}: max |Δlogits| {d:.3g} > atol {atol:g}"})
    reqs = []
    for sid, pr in sorted(per_req.items()):
        pr["tokens_equal"] = pr["greedy_ours"] == pr["greedy_ref"]
        pr["prompt"] = eng.requests[sid].prompt_text
        pr["text"] = loaded.tokenizer.decode(eng.requests[sid].output_ids)
        reqs.append(pr)
    return {"against": against, "reference": REFERENCE[against], "backend": opts.backend, "atol": atol, "rows": rows,
            "requests": reqs,
            "mismatches": mismatches, "identical": not mismatches, "padded_vocab": eng.padded_vocab,
            "max_abs": max((r["max_abs"] for r in rows), default=0.0)}
