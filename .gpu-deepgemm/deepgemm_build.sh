#!/usr/bin/env bash
# Builds DeepGEMM on the GPU host from the archive pack_deepgemm.sh made, against the host's torch:
#   bash .gpu-deepgemm/deepgemm_build.sh .gpu-deepgemm/deepgemm-src.tar.xz /tmp/dg && . /tmp/dg/env.sh
# PREFIX/src/<top>   the unpacked tree        PREFIX/lib   deep_gemm (with _C*.so and include/)
# PREFIX/tmp         object files             PREFIX/jit-cache  DG_JIT_CACHE_DIR
# PREFIX/build.log   all of this script's output (also on stdout)
# PREFIX/env.sh      PYTHONPATH, LD_LIBRARY_PATH, CUDA_HOME, DG_JIT_* (DG_JIT_DEBUG=1,
#                    DG_JIT_PRINT_COMPILER_COMMAND=1), DEEPGEMM_BUILD
# `python3 setup.py build` (build_py copies cutlass's cute/ and cutlass/ into deep_gemm/include,
# where the JIT's nvcc finds them; build_ext compiles csrc/python_api.cpp, one file, with the
# compiler setuptools picks: python's CC/CXX unless DG_CXX names one). The extension gets -g
# (CFLAGS) so addr2line names frames. Knobs (environment):
#   CUDA_HOME     the toolkit (default /usr/local/cuda)
#   DG_CXX        compile and link with this C++ compiler; default /usr/bin/g++ where it exists
#                 (built by python's CXX, /opt/gcc/bin/g++ on the GPU host, deep_gemm's first JIT
#                 call segfaulted in a libstdc++ ostream routine resolved inside _C.so; built by
#                 Ubuntu's g++ it runs: docs/PERFORMANCE.md, session 30)
#   DG_OPT        replace DeepGEMM's -O3 for the extension (e.g. -O1: plainer backtraces)
#   DG_EXTRA_CFLAGS  more compiler flags (e.g. -UNDEBUG: host asserts on)
set -u -o pipefail

if [ $# -ne 2 ]; then echo "usage: $0 ARCHIVE PREFIX" >&2; exit 2; fi
ARCHIVE=$1
PREFIX=$2
mkdir -p "$PREFIX" || { echo "FAILED: cannot make $PREFIX" >&2; exit 1; }
PREFIX=$(cd "$PREFIX" && pwd)
LOG=$PREFIX/build.log

main() {
  step() { echo; echo "== $(date +%T) $*"; }
  die() { echo "FAILED: $*"; exit 1; }
  run() { echo "+ $*"; "$@"; }

  [ -f "$ARCHIVE" ] || die "no archive $ARCHIVE (run pack_deepgemm.sh here, carry .gpu-deepgemm)"
  ARCHIVE=$(cd "$(dirname "$ARCHIVE")" && pwd)/$(basename "$ARCHIVE")

  step "toolchain"
  export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  [ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)"
  echo "CUDA_HOME=$CUDA_HOME -> $(readlink -f "$CUDA_HOME")"
  "$CUDA_HOME/bin/nvcc" --version | tail -2
  [ -x "$CUDA_HOME/bin/cuobjdump" ] && echo "cuobjdump: $CUDA_HOME/bin/cuobjdump" \
    || echo "note: no $CUDA_HOME/bin/cuobjdump (2.6.1 needs it only for DG_JIT_DUMP_SASS/ASM)"
  echo "python3: $(command -v python3) $(python3 -c 'import sys; print(sys.version.split()[0])')"
  TORCH_DIR=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))') || die "python3 cannot import torch"
  TORCH_LIB=$TORCH_DIR/lib
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11abi", torch.compiled_with_cxx11_abi())'
  python3 - <<'EOF'
import sysconfig, os, setuptools
v = sysconfig.get_config_vars()
print("setuptools", setuptools.__version__)
for k in ("CC", "CXX", "LDSHARED", "LDCXXSHARED", "CFLAGS"):
    print(f"sysconfig {k}={v.get(k)!r}  env {k}={os.environ.get(k)!r}")
try:
    import wheel; print("wheel", wheel.__version__)
except Exception as e:
    print("wheel: absent:", e)
import packaging; print("packaging", packaging.__version__)
EOF
  for cxx in g++ /opt/gcc/bin/g++ ${DG_CXX:-}; do
    command -v "$cxx" >/dev/null 2>&1 && echo "$cxx: $("$cxx" --version | head -1) (libstdc++: $("$cxx" -print-file-name=libstdc++.so.6))"
  done
  python3 -c "import torch; print('libstdc++ in python+torch:', sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l}))"
  for h in cuda.h cuda_runtime_api.h nvrtc.h cublasLt.h cublas_v2.h cusparse.h cusolverDn.h cccl/cuda/std/cstdint; do
    [ -f "$CUDA_HOME/include/$h" ] && echo "  $h: ok" || echo "  $h: MISSING in $CUDA_HOME/include"
  done
  # link-time libraries: -lcudart -lnvrtc from $CUDA_HOME/lib64 (setup.py's library_dirs)
  LINKLIB=$PREFIX/linklib
  rm -rf "$LINKLIB"; mkdir -p "$LINKLIB"
  for l in cudart nvrtc; do
    if [ -e "$CUDA_HOME/lib64/lib$l.so" ]; then echo "  lib$l.so: $CUDA_HOME/lib64"
    else
      v=$(ls "$CUDA_HOME"/lib64/lib$l.so.* "$TORCH_DIR"/../nvidia/*/lib/lib$l.so.* 2>/dev/null | head -1)
      [ -n "$v" ] || die "no lib$l.so anywhere"
      ln -s "$v" "$LINKLIB/lib$l.so"; echo "  lib$l.so -> $v (via $LINKLIB)"
    fi
  done
  export LIBRARY_PATH=$LINKLIB${LIBRARY_PATH:+:$LIBRARY_PATH}
  echo "  libcuda.so.1: $(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so.1' | sed 's/.*=> //')"

  step "unpack $ARCHIVE"
  rm -rf "$PREFIX/src" "$PREFIX/lib" "$PREFIX/tmp"
  mkdir -p "$PREFIX/src"
  run tar -xJf "$ARCHIVE" -C "$PREFIX/src" || die "tar"
  TOP=$(ls "$PREFIX/src")
  [ "$(echo "$TOP" | wc -l)" -eq 1 ] || die "archive has several top folders: $TOP"
  SRC=$PREFIX/src/$TOP
  BUILD_INFO=$(cat "$SRC/PACKINFO") || die "no PACKINFO"
  echo "$BUILD_INFO"

  step "build (setup.py build: build_py + the C++ extension)"
  cd "$SRC" || die "cd $SRC"
  # setup.py imports wheel.bdist_wheel (never used by `build`); where that import fails (wheel
  # absent, or wheel >= 0.46 without it), setup.py gets a fallback for that one line
  if ! python3 -c 'from wheel.bdist_wheel import bdist_wheel' >/dev/null 2>&1; then
    echo "wheel.bdist_wheel does not import: setup.py's import gets a fallback"
    python3 - <<'EOF' || die "patching setup.py's wheel import"
s = open("setup.py").read()
line = "from wheel.bdist_wheel import bdist_wheel as _bdist_wheel\n"
assert line in s, "setup.py's wheel import changed"
s = s.replace(line, "try:\n    " + line + "except ImportError:\n"
              "    try:\n        from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel\n"
              "    except ImportError:\n        from setuptools import Command as _bdist_wheel\n")
open("setup.py", "w").write(s)
EOF
  fi
  if [ -n "${DG_OPT:-}" ]; then
    run sed -i "s/'-std=c++17', '-O3'/'-std=c++17', '$DG_OPT'/" setup.py
    grep -n "cxx_flags = " setup.py
  fi
  # no git here: DG_USE_LOCAL_VERSION=0 (version stays 2.6.1, setup.py asks no git);
  # JIT variables unset so that build_py's deep_gemm/envs.py bakes none of them in
  unset DG_JIT_CACHE_DIR DG_JIT_PRINT_COMPILER_COMMAND DG_JIT_CPP_STANDARD
  export DG_USE_LOCAL_VERSION=0 DG_SKIP_CUDA_BUILD=0 DG_JIT_USE_RUNTIME_API=0
  # setuptools takes CFLAGS for C and, in newer versions, CXXFLAGS for C++ (older ones: CFLAGS)
  export CFLAGS="-g -DNDEBUG -fno-omit-frame-pointer ${DG_EXTRA_CFLAGS:-}"
  export CXXFLAGS=$CFLAGS
  export LDFLAGS="-g -Wl,-rpath,$CUDA_HOME/lib64 -Wl,-rpath,$TORCH_LIB"
  if [ -z "${DG_CXX:-}" ] && [ -x /usr/bin/g++ ]; then DG_CXX=/usr/bin/g++; fi
  if [ -n "${DG_CXX:-}" ]; then
    export CC=$DG_CXX CXX=$DG_CXX LDSHARED="$DG_CXX -shared" LDCXXSHARED="$DG_CXX -shared"
  fi
  echo "CUDA_HOME=$CUDA_HOME CFLAGS=$CFLAGS CXXFLAGS=$CXXFLAGS LDFLAGS=$LDFLAGS LIBRARY_PATH=$LIBRARY_PATH" \
       "CC=${CC:-} CXX=${CXX:-} LDSHARED=${LDSHARED:-} LDCXXSHARED=${LDCXXSHARED:-} DG_OPT=${DG_OPT:-}"
  t0=$SECONDS
  run python3 setup.py build --build-lib "$PREFIX/lib" --build-temp "$PREFIX/tmp" || die "setup.py build"
  SO=$(ls "$PREFIX"/lib/deep_gemm/_C*.so 2>/dev/null | head -1)
  [ -n "$SO" ] || die "no deep_gemm/_C*.so under $PREFIX/lib"
  echo "built in $((SECONDS - t0)) s: $SO"
  for d in deep_gemm/include/deep_gemm/impls deep_gemm/include/cute/arch deep_gemm/include/cutlass/arch; do
    [ -d "$PREFIX/lib/$d" ] || die "no $PREFIX/lib/$d (the JIT's include dir)"
  done
  echo "JIT include dir: $PREFIX/lib/deep_gemm/include ($(find "$PREFIX/lib/deep_gemm/include" -type f | wc -l) files)"
  echo "debug sections in $SO: $(readelf -S "$SO" | grep -c '\.debug_')"
  echo "deep_gemm/envs.py: $(tr '\n' ' ' < "$PREFIX/lib/deep_gemm/envs.py" 2>/dev/null)"

  step "env.sh"
  mkdir -p "$PREFIX/jit-cache"
  cat > "$PREFIX/env.sh" <<EOF
# written by deepgemm_build.sh for $BUILD_INFO
export CUDA_HOME="$CUDA_HOME"
export PATH="$CUDA_HOME/bin\${PATH:+:\$PATH}"
export PYTHONPATH="$PREFIX/lib\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$TORCH_LIB:$CUDA_HOME/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export DG_JIT_CACHE_DIR="$PREFIX/jit-cache"
export DG_JIT_DEBUG=1
export DG_JIT_PRINT_COMPILER_COMMAND=1
export DEEPGEMM_BUILD="$BUILD_INFO"
export DEEPGEMM_PREFIX="$PREFIX"
export DEEPGEMM_SO="$SO"
EOF
  cat "$PREFIX/env.sh"

  step "ldd and import"
  (
    . "$PREFIX/env.sh"
    ldd "$SO"
    cd / && python3 -c 'import deep_gemm, sys; print("deep_gemm", deep_gemm.__version__, "from", deep_gemm.__file__)'
  ) || die "built, but 'import deep_gemm' fails"
  echo
  echo "done: $BUILD_INFO; source $PREFIX/env.sh"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
