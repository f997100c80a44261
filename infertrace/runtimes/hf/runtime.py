"""``--runtime hf``: HF transformers computes, one padded ``[B, T]`` batch driven step by step with its own
``DynamicCache``; every step is recorded from HF's own tensors (:mod:`infertrace.runtimes.hf.record`).

The loop mirrors transformers 5.19 ``GenerationMixin._sample`` (``generation/utils.py``): the prompts are padded
to the longest (``padding`` left, as generate() wants for decoder-only models, or right), the prefill is one
forward over ``[B, T]`` with ``position_ids = cumsum(attention_mask) - 1`` (pads 0), then one forward per token
over ``[B, 1]`` with the mask grown by a column of ones. A row that has finished stays in the batch as generate()
keeps it: it is fed ``pad_token_id`` with mask 1 and its output is dropped (``unfinished_sequences``); the run
ends when every row has finished. Each row samples from its *last real column*'s logits, and decode position ids
come from the mask (``cumsum - 1``) — the same as generate()'s ``position_ids[..., -1:] + 1`` under left padding;
under right padding generate() would read a pad column's logits and feed position ``1`` (recorded per step as
``hf.generate_position_ids``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Any, ClassVar

import torch

from infertrace.engine.request import Request
from infertrace.engine.sampler import sample
from infertrace.errors import ConfigError, InfertraceError
from infertrace.runtimes.api import REGISTRY, RunSettings, RuntimeHeader, RuntimeInfo, StepRecord
from infertrace.runtimes.hf.capture import capture_forward, inv_freq
from infertrace.runtimes.hf.layout import (check_padding, generate_next_position_ids, pad_batch,
                                           position_ids_from_mask, real_columns)
from infertrace.runtimes.hf.record import RowStep, StepInputs, build_step, hf_section
from infertrace.trace.records import VARIABLES

#: RunSettings.native keys this runtime reads (each validated in HfRuntime.check)
NATIVE_KEYS = ("padding",)


class HfRuntime:
    """HF transformers as a :class:`~infertrace.runtimes.api.Runtime` (convention ``dense``; module docstring).

    Args:
        loaded: the model as infertrace loads it (its tokenizer, config and checkpoint path; HF loads the weights
            itself: a GGUF dequantised to float32 as ``diff-runtimes hf`` does, or an HF directory).
        settings: the run settings (``native["padding"]``: ``left`` / ``right``).
        tensors: when a dict is given (``--keep tensors``), each step's HF tensors of ``settings.tensor_layers``
            (default ``--layer``) are copied into it (:mod:`infertrace.runtimes.hf.tensors`).
        model: an already loaded HF ``*ForCausalLM`` on the same checkpoint (tests share one), or None.
    """

    info: ClassVar[RuntimeInfo] = REGISTRY["hf"]

    @classmethod
    def check(cls, settings: RunSettings, model_config: Any | None = None) -> RunSettings:
        """Validate ``settings`` for HF (module docstring); returns them with ``native["padding"]`` filled.

        Raises:
            InfertraceError: a setting HF's padded batch cannot honour, in one line.
        """
        native = dict(settings.native or {})
        bad = sorted(set(native) - set(NATIVE_KEYS))
        if bad:
            raise InfertraceError(f"--runtime hf does not know the setting {bad[0]!r} (it reads: {', '.join(NATIVE_KEYS)})")
        native["padding"] = check_padding(native.get("padding", "left"))
        o = settings.opts
        refusals = (
            (settings.dtype != "float32", f"--runtime hf computes in float32 (the dequantised checkpoint, as diff-runtimes hf); got --dtype {settings.dtype}"),
            (settings.tensor_parallel_size != 1, "--runtime hf runs one process (tensor_parallel_size 1)"),
            (o.speculative is not None, "--runtime hf runs no speculative decoding (generate()'s assisted decoding is not traced)"),
            (o.prefix_cache, "--runtime hf has no prefix cache (each run builds one DynamicCache)"),
            (o.context_shift, "--runtime hf has no context shift"),
            (o.prefill_chunk is not None, "--runtime hf prefills the padded batch in one forward (no --prefill-chunk)"),
            (o.kv_dtype not in (None, "f32"), f"--runtime hf keeps its DynamicCache in the model dtype (float32); got --kv-dtype {o.kv_dtype}"),
            (o.sampler_order == "llama.cpp", "--runtime hf samples in the hf order (temperature, then top-k / top-p / min-p)"),
            (o.audit_kv, "--runtime hf does not audit the cache (--audit-kv)"),
            (settings.device not in ("cpu", "cuda"), f"--runtime hf runs on cpu or cuda; got --device {settings.device}"),
        )
        for bad_setting, msg in refusals:
            if bad_setting:
                raise InfertraceError(msg)
        if model_config is not None and not 0 <= settings.layer < model_config.n_layer:
            raise ConfigError("run.layer", f"{settings.layer} out of range: the model has layers 0..{model_config.n_layer - 1}")
        return replace(settings, native=native)

    @classmethod
    def run_output(cls, console: Any) -> Any:
        """Nothing of its own is printed while it runs (transformers' warnings go through Python's own)."""
        from contextlib import nullcontext

        return nullcontext()

    def __init__(self, loaded: Any, settings: RunSettings, tensors: dict[str, Any] | None = None, model: Any = None):
        self.settings = self.check(settings, loaded.config)
        self.tensors = tensors
        self.tensor_layers = tuple(self.settings.tensor_layers or (self.settings.layer,)) if tensors is not None else ()
        self.padding = self.settings.native["padding"]
        self.tok, self.cfg, self.layer = loaded.tokenizer, loaded.config, self.settings.layer
        if model is None:
            from infertrace.compare.hf import hf_model

            model = hf_model(loaded.ckpt.path)
        self.model = model.to(self.settings.device)
        gc = getattr(model, "generation_config", None)
        pad = getattr(gc, "pad_token_id", None)
        eos = getattr(gc, "eos_token_id", None)
        self.pad_id = int(pad if pad is not None else (eos[0] if isinstance(eos, list) else eos if eos is not None else 0))
        self.eog = set(getattr(self.tok, "eog_ids", ()) or ())
        self.attn = str(getattr(model.config, "_attn_implementation", "eager"))
        self.show = set(self.settings.show or VARIABLES)
        self.inv_freq = inv_freq(model)
        self._reqs: list[Request] = []
        self._cache: Any = None
        self._am: torch.Tensor | None = None  # [B, L] attention_mask so far
        self._gen_pos: torch.Tensor | None = None  # [B, L] position ids as generate() would have grown them
        self._next: list[int] = []
        self._finished: dict[int, int] = {}  # batch row -> first column fed after it finished
        self._step = 0
        self._padded_len = 0

    # ------------------------------------------------------------------ the protocol
    def add_request(self, request: Any) -> int:
        """Queue one request (all before the first step: HF runs one static padded batch); returns its seq_id.

        Raises:
            InfertraceError: a request after the batch started, one arriving after step 0, an empty prompt, or
                prompt + max_new_tokens beyond ``ctx_size``.
        """
        if self._cache is not None:
            raise InfertraceError("--runtime hf runs one static padded batch: every request is added before the first step")
        if request.arrival_step != 0:
            raise InfertraceError(f"--runtime hf runs one static padded batch: every request arrives at step 0 "
                                  f"(got arrival step {request.arrival_step})")
        if not request.ids:
            raise InfertraceError("--runtime hf needs at least one prompt token per request")
        params = request.params.validate()
        ctx = self.settings.opts.ctx_size
        if ctx is not None and len(request.ids) + params.max_new_tokens > ctx:
            raise InfertraceError(f"prompt ({len(request.ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                                  f"--ctx-size {ctx}")
        sid = len(self._reqs)
        self._reqs.append(Request(sid, list(request.ids), params, 0, request.text))
        return sid

    @torch.no_grad()
    def step(self) -> StepRecord | None:
        """Run the prefill (first call) or one decode forward; None once every row has finished."""
        if not self._reqs:
            return None
        if self._cache is None:
            return self._prefill()
        if len(self._finished) == len(self._reqs):
            return None
        return self._decode()

    def requests(self) -> list[dict[str, Any]]:
        """The requests as ``trace.requests`` holds them (seq_id order)."""
        return [{"seq_id": r.seq_id, "prompt": r.prompt_text, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                 "text": self.tok.decode(r.output_ids), "stop_reason": r.stop_reason, "arrival_step": 0,
                 "num_preemptions": 0, "params": r.params.to_dict()} for r in self._reqs]

    def header(self) -> RuntimeHeader:
        """What ran: backend ``dense``, HF's attention implementation, ``options.hf`` (version, model class,
        padding, pad id, the position and finished-row rules)."""
        import transformers

        eng = asdict(self.settings.opts)
        eng["backend"] = "dense"
        hf = {"version": transformers.__version__, "model_class": type(self.model).__name__,
              "attn_implementation": self.attn, "dtype": str(self.model.dtype).replace("torch.", ""),
              "padding": self.padding, "pad_token_id": self.pad_id, "batch_size": len(self._reqs),
              "padded_len": self._padded_len, "cache_class": "DynamicCache",
              "position_ids": "cumsum(attention_mask) - 1, pad columns 0 (generate() _prepare_position_ids_for_generation), "
                              "every step over the whole mask",
              "finished_rows": "kept in the batch, fed pad_token_id with attention_mask 1, output dropped (generate())"}
        notes = (f"engine HF transformers {transformers.__version__}: {type(self.model).__name__}, {self.attn} attention, "
                 f"one padded batch of {len(self._reqs)} rows x {self._padded_len} columns ({self.padding} padding, pad id "
                 f"{self.pad_id}); prefill then one [B, 1] forward per token with its DynamicCache",
                 "dense convention: the ordinary records hold real tokens only (N = real tokens computed); pad columns, "
                 "the 2-D attention_mask, HF's masks per layer type and the cache lengths are in kv.physical and step.hf")
        options: dict[str, Any] = {"sampler_order": "hf", "hf": hf}
        if self.tensors is not None:  # --keep tensors: which HF module each saved tap is the output of
            from infertrace.runtimes.hf.tensors import SOURCES

            options["tap_sources"] = dict(SOURCES)
        return RuntimeHeader(backend="dense", attention=self.attn, settings=eng, options=options, notes=notes,
                             layer=self.layer)

    def close(self) -> None:
        """Drop the cache (the model stays loaded for the next run)."""
        self._cache = None

    # ------------------------------------------------------------------ steps
    def _forward(self, ids: torch.Tensor, am: torch.Tensor, pos: torch.Tensor) -> tuple[StepInputs, float]:
        """One HF forward over ``ids`` ``[B, q]`` with the mask ``am`` ``[B, L]`` and ``pos`` ``[B, q]``."""
        from transformers import DynamicCache

        if self._cache is None:
            self._cache = DynamicCache(config=self.model.config)
        past = int(self._cache.get_seq_length())
        dev = self.settings.device
        from infertrace.runtimes.hf.tensors import layer_hooks

        self._taps: dict[tuple[int, str], torch.Tensor] = {}
        hooks = layer_hooks(self.model, self.tensor_layers, self._taps) if self.tensor_layers else []
        t0 = time.perf_counter()
        try:
            with capture_forward(self.model) as cap:
                out = self.model(input_ids=ids.to(dev), attention_mask=am.to(dev), position_ids=pos.to(dev),
                                 past_key_values=self._cache, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
        ms = (time.perf_counter() - t0) * 1e3
        self._cache = out.past_key_values
        logits = out.logits.detach().float().cpu()  # [B, q, V]
        return StepInputs(ids, am, pos, past, cap, self._cache, logits), ms

    def _prefill(self) -> StepRecord:
        ids, am = pad_batch([r.prompt_ids for r in self._reqs], self.padding, self.pad_id)  # [B, T] each
        self._padded_len = ids.shape[1]
        pos = position_ids_from_mask(am)  # [B, T]
        self._am, self._gen_pos = am, pos
        inp, ms = self._forward(ids, am, pos)
        rows = []
        for b, r in enumerate(self._reqs):
            cols = real_columns(am[b].tolist())
            rows.append(RowStep(b, r.seq_id, 0, len(cols), list(r.prompt_ids), cols, cols[-1]))
        return self._finish_step(inp, rows, ms, None)

    def _decode(self) -> StepRecord:
        B = len(self._reqs)
        ids = torch.tensor(self._next, dtype=torch.long).view(B, 1)  # [B, 1]
        am = torch.cat([self._am, torch.ones((B, 1), dtype=torch.long)], dim=-1)  # [B, L + 1]
        pos = position_ids_from_mask(am)[:, -1:]  # [B, 1]
        gen = generate_next_position_ids(self._gen_pos)  # [B, 1] what generate() would feed
        self._am, self._gen_pos = am, torch.cat([self._gen_pos, gen], dim=-1)
        inp, ms = self._forward(ids, am, pos)
        rows = [RowStep(b, r.seq_id, len(r.all_ids) - 1, 1, [r.all_ids[-1]], [0], 0)
                for b, r in enumerate(self._reqs) if b not in self._finished]
        return self._finish_step(inp, rows, ms, gen[:, 0].tolist())

    def _finish_step(self, inp: StepInputs, rows: list[RowStep], ms: float, gen_pos: list[int] | None) -> StepRecord:
        """Sample every computed row, apply the stop rules, build the records, choose the next column's tokens."""
        col_next = inp.attention_mask.shape[1]  # the column the next forward writes
        for row in rows:
            r = self._reqs[row.b]
            res = sample(inp.logits[row.b, row.logit_col], r.params, r.all_ids, r.generator, n_top=5, order="hf")
            forced = (self.settings.forced or {}).get(r.seq_id)
            if forced is not None and len(r.output_ids) < len(forced):
                res = type(res)(int(forced[len(r.output_ids)]), res.top)
            row.sample = res
            r.output_ids.append(res.token)
            stop = ("eos" if res.token in self.eog and not r.params.ignore_eos else
                    "max_new_tokens" if len(r.output_ids) >= r.params.max_new_tokens else None)
            if stop:
                row.finished, r.stop_reason = stop, stop
                self._finished[row.b] = col_next
        self._next = [self.pad_id if b in self._finished else r.all_ids[-1] for b, r in enumerate(self._reqs)]
        row_seq = [r.seq_id for r in self._reqs]
        st = build_step(self._step, inp, rows, self.tok, self.cfg, self.show, self.layer, self.padding, self._padded_len,
                        {r.seq_id: r.params for r in self._reqs}, self.inv_freq, self.attn, dict(self._finished), row_seq)
        st.time_ms = round(ms, 3)
        st.admitted = [r.seq_id for r in rows] if self._step == 0 else []
        sec = hf_section(inp, rows, self.padding, self.layer, 4, self.pad_id, list(self._next), gen_pos,
                         dict(self._finished), row_seq, self.attn)
        st.hf = sec
        if self.tensors is not None:
            from infertrace.runtimes.hf.tensors import keep_step

            keep_step(self.tensors, st.step, self._taps, inp.cap.embed, rows, inp.logits, inp.cache, inp.attention_mask,
                      self.layer)
        self._step += 1
        return StepRecord(st.step, st, sec)
