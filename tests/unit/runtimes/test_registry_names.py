"""The runtime names: the registry (runtimes/api.py) is the one place a name is bound to code; the trace store
(torch-free, so it cannot import the registry) accepts exactly those names, and every entry's convention is one
the trace schema knows."""

from __future__ import annotations

from infertrace.runtimes import api
from infertrace.trace import schema, store


def test_the_store_accepts_exactly_the_registered_runtimes():
    assert store.RUNTIMES == tuple(api.REGISTRY)


def test_every_convention_is_a_schema_backend():
    assert {c for e in api.REGISTRY.values() for c in e.conventions} <= set(schema.BACKENDS)
    assert api.info("hf").conventions == ("dense",) and api.info("hf").native == "hf" and api.info("hf").own_weights
