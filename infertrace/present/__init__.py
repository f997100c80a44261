"""Presentation of trace records (rich terminal views, self-contained HTML report), torch-free:
reads :mod:`infertrace.trace` records only, never the engine or the capture side."""
