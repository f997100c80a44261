"""A recorder that records every step twice: from the live step and from its :class:`StepData` sent through
JSON text and safetensors bytes (``to_wire`` -> ``json.dumps`` / ``safetensors.torch.save`` -> ``load`` ->
``from_wire``), and the check that both records (and the tensors they keep) are equal."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from infertrace.capture.probe import probe
from infertrace.capture.recorder import Recorder
from infertrace.capture.step_data import StepData


def wire(data: StepData) -> StepData:
    """``data`` through JSON text and safetensors bytes, read back as untrusted input."""
    d, tensors = data.to_wire()
    text = json.dumps(d)
    blob = st_save(tensors) if tensors else b""
    return StepData.from_wire(json.loads(text), st_load(blob) if tensors else {})


class TwinRecorder(Recorder):
    """A recorder that also records every step from its wire copy into ``twin``, and keeps each step's data."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        k2 = dict(k, tensors={} if k.get("tensors") is not None else None)
        self.twin = Recorder(*a, **k2)
        self.data: list[StepData] = []

    def end_step(self, ctx):
        data = probe(ctx, self.want, self._taps)
        self.data.append(data)
        self.twin.record(wire(data))
        return self.record(data)


def same_steps(rec: TwinRecorder) -> None:
    """Every live record equals its wire twin's (``to_dict``, the runtime's native section included), and so do
    the kept tensors (dtype, shape, values)."""
    assert rec.steps and len(rec.steps) == len(rec.twin.steps)
    for a, b in zip(rec.steps, rec.twin.steps):
        assert a.to_dict() == b.to_dict(), a.step
    if rec.tensors is not None:
        assert rec.tensors and sorted(rec.tensors) == sorted(rec.twin.tensors)
        for k, t in rec.tensors.items():
            u = rec.twin.tensors[k]
            assert t.dtype == u.dtype and t.shape == u.shape and torch.equal(t, u), k


