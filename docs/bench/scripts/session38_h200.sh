#!/usr/bin/env bash
# Issue 34's rows that wait for an H200, in one call (carry .gpu .whl .commit; .gpu's Ray
# stripped by strip_raysite.sh): on an H200, h200_rows_of_record.sh's v4rows (the V4-Flash
# stage's decode steps at 1 / 16 / 512 rows, FP8 then bf16: the bf16 stage's ~103 GB of experts
# do not fit an H100) and v4engine (bf16 through the engine: the issue's own command); on an
# H100, session37_bf16_one_row.sh's bound.
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -lt 100000 ]; then exec bash docs/bench/scripts/session37_bf16_one_row.sh; fi
exec bash docs/bench/scripts/h200_rows_of_record.sh v4rows v4engine
