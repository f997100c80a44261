"""infertrace test suite, a package so every subfolder imports the shared helpers as ``tests.helpers.<module>``."""
