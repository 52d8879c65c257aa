#!/usr/bin/env bash
# DeepGEMM's first JIT calls under a native-backtrace handler, on the GPU host, after the build:
#   bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg && . /tmp/dg/env.sh \
#     && bash .gpu-deepgemm/probe.sh
# Compiles docs/bench/scripts/segv_backtrace.c to /tmp/segv.so, then runs .gpu-deepgemm/dg_probe.py
# under LD_PRELOAD=/tmp/segv.so python3 -X faulthandler: session 12's order in one process
# (cublaslt, bf16_gemm_nt, fp8_gemm_nt), then each JIT call alone in a fresh process
# (transpose_fp32, DeepGEMM's simplest JIT kernel, first). Each `lib(+0xOFF)` frame of a
# deep_gemm .so in a native backtrace goes through `addr2line -f -C -i -e LIB OFF`. If a run
# dies with faulthandler's report but no native backtrace, it is rerun without -X faulthandler.
# Everything goes to stdout; with $OUT set, the logs and the JIT cache's kernel.cu files are also
# copied to $OUT/dg_probe/.  PROBE_LIMIT: seconds per run (default 240).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
step() { echo; echo "== $(date +%T) $*"; }
[ -n "${DEEPGEMM_PREFIX:-}" ] || { echo "FAILED: source PREFIX/env.sh (deepgemm_build.sh writes it) first"; exit 1; }
LOGDIR=${OUT:+$OUT/dg_probe}
LOGDIR=${LOGDIR:-/tmp/dg_probe}
mkdir -p "$LOGDIR"

step "segv.so"
echo "+ gcc -shared -fPIC -O0 -o /tmp/segv.so docs/bench/scripts/segv_backtrace.c"
gcc -shared -fPIC -O0 -o /tmp/segv.so docs/bench/scripts/segv_backtrace.c || { echo "FAILED: gcc"; exit 1; }

step "host"
echo "build: ${DEEPGEMM_BUILD:-?}; so: ${DEEPGEMM_SO:-?}"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>&1 | head -2
echo "nvcc: $(command -v nvcc) | cuobjdump: $(command -v cuobjdump || echo none) | HOME=${HOME:-<unset>} | ulimit -s $(ulimit -s)"
echo "libcuda.so.1: $(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so.1' | sed 's/.*=> //')"
for v in CUDA_HOME PYTHONPATH LD_LIBRARY_PATH DG_JIT_CACHE_DIR DG_JIT_DEBUG DG_JIT_PRINT_COMPILER_COMMAND DG_JIT_USE_NVRTC; do
  echo "  $v=${!v:-<unset>}"
done

symbolize() {  # symbolize LOG: addr2line for every deep_gemm frame of the native backtrace(s)
  python3 - "$1" <<'EOF'
import os, re, subprocess, sys
# backtrace_symbols_fd lines: /path/lib.so(+0x1a2b)[0x7f..] or /path/lib.so(symbol+0x1a)[0x7f..]
frame = re.compile(r"^(/\S+?)\(([^()+]*)\+(0x[0-9a-fA-F]+)\)\s*\[(0x[0-9a-fA-F]+)\]")
syms: dict[str, dict[str, int]] = {}

def symbol_value(lib: str, name: str):
    if lib not in syms:
        table = {}
        for args in (["nm", "-D", "--defined-only"], ["nm", "--defined-only"]):
            out = subprocess.run(args + [lib], capture_output=True, text=True).stdout
            for line in out.splitlines():
                parts = line.split()
                if len(parts) >= 3:
                    table.setdefault(parts[2], int(parts[0], 16))
        syms[lib] = table
    return syms[lib].get(name)

lines = open(sys.argv[1], errors="replace").read().splitlines()
n = 0
for line in lines:
    m = frame.match(line.strip())
    if not m or "deep_gemm" not in m.group(1):
        continue
    lib, sym, off, _ = m.groups()
    off = int(off, 16)
    if sym:
        base = symbol_value(lib, sym)
        if base is None:
            print(f"  {os.path.basename(lib)}({sym}+{off:#x}): symbol not found by nm")
            continue
        off += base
    cmd = ["addr2line", "-f", "-C", "-i", "-e", lib, f"{off:#x}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    n += 1
    print(f"  #{n} {os.path.basename(lib)}+{off:#x}{f' ({sym})' if sym else ''}  [{' '.join(cmd[:-2])} LIB {off:#x}]")
    for l in (out.stdout + out.stderr).splitlines():
        print(f"      {l}")
if n == 0:
    print("  (no deep_gemm frames in a native backtrace)")
EOF
}

probe() {  # probe NAME [CALL ...]
  local name=$1; shift
  local log=$LOGDIR/$name.log
  step "probe $name: LD_PRELOAD=/tmp/segv.so python3 -X faulthandler .gpu-deepgemm/dg_probe.py $*"
  local t0=$SECONDS
  LD_PRELOAD=/tmp/segv.so${LD_PRELOAD:+:$LD_PRELOAD} timeout "${PROBE_LIMIT:-240}" \
    python3 -X faulthandler .gpu-deepgemm/dg_probe.py "$@" > "$log" 2>&1
  local rc=$?
  cat "$log"; echo "rc $rc in $((SECONDS - t0)) s"
  if grep -q "Fatal Python error" "$log" && ! grep -q "native backtrace" "$log"; then
    step "probe $name again without -X faulthandler (no native backtrace came)"
    LD_PRELOAD=/tmp/segv.so${LD_PRELOAD:+:$LD_PRELOAD} timeout "${PROBE_LIMIT:-240}" \
      python3 .gpu-deepgemm/dg_probe.py "$@" > "$log.nofh" 2>&1
    rc=$?; cat "$log.nofh"; echo "rc $rc"; log=$log.nofh
  fi
  echo "-- addr2line ($name)"
  symbolize "$log"
}

probe session12 cublaslt bf16_gemm_nt fp8_gemm_nt
probe transpose_fp32 transpose_fp32
probe bf16_gemm_nt bf16_gemm_nt
probe fp8_gemm_nt fp8_gemm_nt

step "JIT cache ${DG_JIT_CACHE_DIR:-}"
if [ -d "${DG_JIT_CACHE_DIR:-/nonexistent}" ]; then
  find "$DG_JIT_CACHE_DIR" -maxdepth 3 | sed "s|^$DG_JIT_CACHE_DIR|  |" | head -40
  if [ -n "${OUT:-}" ]; then
    (cd "$DG_JIT_CACHE_DIR" && find . -name kernel.cu | tar -cf - -T - 2>/dev/null) > "$LOGDIR/jit_kernels.tar"
  fi
fi
echo "logs: $LOGDIR"
