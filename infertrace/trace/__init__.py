"""The trace layer, torch-free: records (the five variables per step), their one schema check and
invariants, save/load, and diffs. The engine side (:mod:`infertrace.capture`) feeds it; :mod:`infertrace.present`
reads it."""
