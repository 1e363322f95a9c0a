"""specdec bench: the benchmark suites a user runs."""
