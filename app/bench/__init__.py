"""Benchmarks (docs/ARCHITECTURE.md#benchmarks), beside the serving path: `ppserve bench
{engine,load,serve,contention,attention}` or `python -m app.bench[.NAME]`. They reach the engine
only through target.BenchEngine."""
