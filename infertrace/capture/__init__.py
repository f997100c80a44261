"""Engine-side capture: the tracer the engine feeds (torch). It builds the torch-free records of
:mod:`infertrace.trace`; nothing in :mod:`infertrace.trace` or :mod:`infertrace.present` imports it."""
