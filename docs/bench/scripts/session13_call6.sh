#!/usr/bin/env bash
# Session 13, call 6 (one H200, Ray carried): V4-Flash bf16 TTFT at 64K-256K through the engine
# (the FP8-against-bf16 margin at 256K). Results under $OUT/r.
set -u
. docs/bench/scripts/host_env.sh
LIMIT=170 step ttft-v4-flash python3 -m app.cli bench suite --only ttft-v4-flash --device cuda --timeout 165 --out "$R/suite"
