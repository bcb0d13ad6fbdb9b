"""The engine options the suite starts every Xeon engine with."""

from __future__ import annotations

TEST_OPTIONS = {"num_threads": "1"}
"""The tiny test model gains nothing from more threads, and on a busy machine (CI,
parallel sessions) OpenMP threads waiting at barriers for a descheduled peer
make every step many times slower."""
