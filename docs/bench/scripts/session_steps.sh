# Sourced by the session GPU scripts (from the repository root): Ray and the carried wheels
# (.gpu, .wt/lead/whl and, where present, whl_openai) on the path, $OUT and $RES (results packed
# into one archive, as at most 8 files come back from $OUT), and the step helpers. The caller
# sets NAME (the log's and the archive's name) and BUDGET (seconds for the whole call).
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wt/lead/whl/*.whl \
    $(ls .wt/lead/whl_openai/*.whl 2>/dev/null) 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; RES=/tmp/res; mkdir -p "$RES"
LOG="$OUT/${NAME}_bench.log"
left() {  # seconds for a step: its cap, or what is left of BUDGET
    local l=$((BUDGET - SECONDS)); [ "$l" -lt "$1" ] && echo $((l > 5 ? l : 5)) || echo "$1"
}
step() { echo "=== [$SECONDS s] $*" | tee -a "$LOG"; }
quiet() { grep -v "^(raylet)\|WARNING\|INFO worker" | tail -"$1" | tee -a "$LOG"; }
pack() { tar -C "$RES" -czf "$OUT/${NAME}_results.tar.gz" .; }
