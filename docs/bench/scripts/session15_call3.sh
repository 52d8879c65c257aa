#!/usr/bin/env bash
# Session 15, call 3 (one H200): TTFT through the engine, V4-Flash shape, PP=1: FP8 weights +
# FP8 KV at 64K-256K and at 512K / 1,040,384 tokens, and bf16 at 64K-256K (not measured since
# 1d259d7), for issue 35's targets.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=120 step ttft-v4-flash-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-fp8 --device cuda --timeout 115 --out "$R/suite"
LIMIT=150 step ttft-v4-flash-1m-fp8 python3 -m app.cli bench suite --only ttft-v4-flash-1m-fp8 --device cuda --timeout 145 --out "$R/suite"
LIMIT=150 step ttft-v4-flash python3 -m app.cli bench suite --only ttft-v4-flash --device cuda --timeout 145 --out "$R/suite"
tar czf "$OUT/results.tgz" -C "$OUT" r
