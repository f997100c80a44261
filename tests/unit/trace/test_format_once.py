"""The trace format is defined once: every record dataclass of :mod:`infertrace.trace.records` and its
schema object in :mod:`infertrace.trace.schema` name the same keys, so a field added to one and not the
other fails here (not at a user's ``show``). A dataclass field without a default must be a required schema
key (records always write it); a schema key may be optional only where the record's field has a default
or is left out of ``to_dict`` when unset."""

from __future__ import annotations

import dataclasses

import pytest

from infertrace.trace import records as R
from infertrace.trace import schema as S

PAIRS = [(R.ReqStep, S.REQ_STEP), (R.RowStat, S.ROW_STAT), (R.HiddenRec, S.HIDDEN), (R.PositionsRec, S.POSITIONS),
         (R.MaskRec, S.MASK), (R.KVRec, S.KV), (R.DecodeRec, S.DECODE), (R.StepTrace, S.STEP)]
#: RunTrace's fields that trace.json does not hold at the top level: ``threads`` (machine facts) goes to
#: timing.json; ``runtime`` is an open top-level key (TOP_LEVEL has extra=True and store.py checks it)
RUN_NOT_IN_TOP = {"threads", "runtime"}
#: top-level keys of trace.json that RunTrace does not hold: ``store`` (what was kept, the tensor index) is
#: written by :func:`infertrace.trace.store.save_trace`
TOP_NOT_IN_RUN = {"store"}


@pytest.mark.parametrize("dc, spec", PAIRS, ids=[d.__name__ for d, _ in PAIRS])
def test_record_and_schema_name_the_same_keys(dc, spec):
    req, opt, extra = spec.keys
    fields = {f.name: f for f in dataclasses.fields(dc)}
    assert not extra, f"{dc.__name__}: a record's schema must refuse unknown keys"
    assert set(fields) == req | opt, (f"{dc.__name__}: only in the dataclass {sorted(set(fields) - req - opt)}, "
                                      f"only in the schema {sorted((req | opt) - set(fields))}")
    no_default = {n for n, f in fields.items()
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert no_default <= req, f"{dc.__name__}: always written but optional in the schema: {sorted(no_default - req)}"


def test_run_trace_and_top_level():
    req, opt, _ = S.TOP_LEVEL.keys
    fields = {f.name for f in dataclasses.fields(R.RunTrace)}
    assert fields - RUN_NOT_IN_TOP == (req | opt) - TOP_NOT_IN_RUN


def test_schema_key_sets_are_read_from_the_check_itself():
    """The introspected keys are the ones the check enforces: a record missing a required key is refused."""
    req, _, _ = S.ROW_STAT.keys
    row = {"seq_id": 0, "pos": 0, "token_id": 1, "piece": "a", "mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0,
           "l2": 0.0, "first": []}
    assert set(row) == req
    S.ROW_STAT(row, "r")
    with pytest.raises(S.Bad, match="missing key 'l2'"):
        S.ROW_STAT({k: v for k, v in row.items() if k != "l2"}, "r")
