"""Serving-benchmark arithmetic: request timelines, their latency summary and goodput, and the
diagnosis of what limits latency. Pure functions of recorded times (no engine, no I/O), so
`localllm bench serve` and the tests compute the same figures."""
