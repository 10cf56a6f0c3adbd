"""The benchmark dry runs' fixtures (support.py) for every test in this folder, each on one intra-op thread."""

from tests.benchmarks_dry_run.support import _one_thread, mocked_timing, no_compile  # noqa: F401 (fixtures)
