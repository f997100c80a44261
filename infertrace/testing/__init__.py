"""Testing helpers shipped with infertrace: the ``infertrace_snapshot`` pytest fixture (golden traces)."""
