"""Scaffolding the tests and the benchmarks share, and no production module imports: the
fleet as subprocesses with its /proc readings (`fleet`), the state service in-process
(`inproc`), a throwaway PostgreSQL server (`pg`), XLA compile counting (`jaxcount`) and the
fuzz oracles (`fuzz_oracles`). docs/testing.md says what belongs here."""
