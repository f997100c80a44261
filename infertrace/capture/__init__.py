"""Engine-side capture: the tracer the engine feeds (torch). The probe (:mod:`.probe`) copies what a record needs
out of a live step into plain :class:`~infertrace.capture.step_data.StepData`; the recorder (:mod:`.recorder`)
builds the torch-free records of :mod:`infertrace.trace` from that data alone. Nothing here imports the memory
(:mod:`infertrace.kv`) or the engine; nothing in :mod:`infertrace.trace` or :mod:`infertrace.present` imports it."""
