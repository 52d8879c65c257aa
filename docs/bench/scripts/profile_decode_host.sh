#!/usr/bin/env bash
set -u
# One H200: the PP=1 decode bench at steady state (1,500 outputs) with py-spy sampling the stage
# actor and the coordinator for 4 s. Carry .gpu with the py-spy wheel copied in
# (cp py_spy-*.whl .gpu/). Raw stacks under $OUT (analyse: frame counts per function).
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --target /tmp/spy .gpu/py_spy*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 300 python3 -m app.bench.load --pp 1 --device cuda --parts decode --decode-tokens 1500 --reps 1 --modes off --decode-modes off --run-ahead --out $OUT/decode_prof.json > $OUT/bench.log 2>&1 &
for i in $(seq 1 120); do
  S=$(pgrep -f "ray::.*StageActor.advance" | head -1)
  [ -n "$S" ] && break; sleep 1
done
sleep 2
C=$(pgrep -f "ray::CoordinatorActor" | head -1)
echo "stage $S coord $C"
/tmp/spy/bin/py-spy record -p $S -d 4 -r 500 -f raw --idle -o $OUT/stage.txt --nonblocking > $OUT/spy_s.log 2>&1 &
/tmp/spy/bin/py-spy record -p $C -d 4 -r 500 -f raw --idle -o $OUT/coord.txt --nonblocking > $OUT/spy_c.log 2>&1 &
wait
tail -5 $OUT/bench.log; cat $OUT/spy_s.log | tail -3
