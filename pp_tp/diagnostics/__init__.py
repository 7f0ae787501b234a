"""Tools for tests and benchmarks: the collective ledger and the step tracer. The builder never imports them."""
