# Sourced by a device call's script (session13_*.sh) on the GPU host, from the repository root:
# unpacks what the call carries (.gpu's Ray, .whl's wheels, .tfw's trimmed transformers) under
# /tmp/site once per warm machine, exports the environment every step needs, and defines
# `step NAME CMD...`: CMD under ${LIMIT:-300} s, its log in $R/NAME.log (results under $OUT/r).
R=$OUT/r; mkdir -p "$R"
step() { local name=$1; shift; echo "== $(date +%T) $name: $*"; local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" > "$R/$name.log" 2>&1; echo "rc $? in $((SECONDS - t0)) s" | tee -a "$R/$name.log"; tail -3 "$R/$name.log"; }
mkdir -p /tmp/site && (test -d /tmp/site/ray || tar -C /tmp/site -xJf .gpu/raysite.tar.xz)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
(test -d /tmp/site/transformers || tar -C /tmp/site -xJf .tfw/tf-slim.tar.xz)
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PPSERVE_COMMIT=$(cat .commit)
