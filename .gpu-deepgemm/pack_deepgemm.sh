#!/usr/bin/env bash
# Packs DeepGEMM's source for the GPU host (no network there) into .gpu-deepgemm/deepgemm-src.tar.xz:
#   bash .gpu-deepgemm/pack_deepgemm.sh [DEEPGEMM_COMMIT]      (default: main 54e2261 = 2.6.1)
# Reads the snapshots the `fetch` tool left under $MIRROR (default /work/.mirror):
#   deepseek-ai+DeepGEMM/repo, NVIDIA+cutlass/repo, fmtlib+fmt/repo (bare git directories).
# The archive holds one folder deepgemm-<short>/: DeepGEMM's tree at the commit (git archive), plus
# its submodules' parts the build and the JIT use: third-party/cutlass/{include,LICENSE.txt} and
# third-party/fmt/{include,LICENSE} at the commits DeepGEMM pins (the snapshot's HEAD if a pin is
# absent, said loudly), and PACKINFO (one line: name, commit, version, submodule commits).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MIRROR=${MIRROR:-/work/.mirror}
DG_GIT=$MIRROR/deepseek-ai+DeepGEMM/repo
CUTLASS_GIT=$MIRROR/NVIDIA+cutlass/repo
FMT_GIT=$MIRROR/fmtlib+fmt/repo
REF=${1:-54e22612409371d6364144b69086735beb54e98b}
OUT_FILE=${OUT_FILE:-$HERE/deepgemm-src.tar.xz}

die() { echo "pack_deepgemm: FAILED: $*" >&2; exit 1; }
for d in "$DG_GIT" "$CUTLASS_GIT" "$FMT_GIT"; do
  git -C "$d" rev-parse --git-dir >/dev/null 2>&1 || die "no git snapshot at $d (fetch it first)"
done

COMMIT=$(git -C "$DG_GIT" rev-parse --verify "$REF^{commit}") || die "DeepGEMM commit $REF not in $DG_GIT"
SHORT=${COMMIT:0:7}
VERSION=$(git -C "$DG_GIT" show "$COMMIT:deep_gemm/__init__.py" | sed -n "s/^__version__ *= *['\"]\([^'\"]*\)['\"].*/\1/p")
[ -n "$VERSION" ] || die "no __version__ in deep_gemm/__init__.py at $COMMIT"
echo "DeepGEMM $COMMIT version $VERSION (main is $(git -C "$DG_GIT" rev-parse --short main 2>/dev/null || echo '?'))"

# Submodule pins (gitlinks) at that commit; the pinned commit if the snapshot has it, else its HEAD
pin() {  # pin PATH_IN_DEEPGEMM SUBMODULE_GIT
  local want
  want=$(git -C "$DG_GIT" ls-tree "$COMMIT" "$1" | awk '$2 == "commit" {print $3}')
  [ -n "$want" ] || die "no gitlink $1 at $COMMIT"
  if git -C "$2" cat-file -e "$want^{commit}" 2>/dev/null; then
    echo "$want"
  else
    echo "WARNING: $1 pinned at $want, absent from $2; using its HEAD $(git -C "$2" rev-parse HEAD)" >&2
    git -C "$2" rev-parse HEAD
  fi
}
CUTLASS_COMMIT=$(pin third-party/cutlass "$CUTLASS_GIT")
FMT_COMMIT=$(pin third-party/fmt "$FMT_GIT")
echo "cutlass $CUTLASS_COMMIT, fmt $FMT_COMMIT"

STAGE=$(mktemp -d /tmp/pack_deepgemm.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
TOP=deepgemm-$SHORT
# Archives are written to files first: a failing `git archive` must not pass as an empty tar.
# (cutlass's snapshot lacks some media/ blobs: git archive names one on stderr even for include/.)
git -C "$DG_GIT" archive --format=tar --prefix="$TOP/" -o "$STAGE/dg.tar" "$COMMIT"
git -C "$CUTLASS_GIT" archive --format=tar --prefix="$TOP/third-party/cutlass/" -o "$STAGE/cutlass.tar" \
  "$CUTLASS_COMMIT" include LICENSE.txt 2> >(grep -v "for 'media/" >&2)
git -C "$FMT_GIT" archive --format=tar --prefix="$TOP/third-party/fmt/" -o "$STAGE/fmt.tar" \
  "$FMT_COMMIT" include LICENSE
mkdir "$STAGE/tree"
for t in dg cutlass fmt; do tar -xf "$STAGE/$t.tar" -C "$STAGE/tree"; done

# Check: every header of the submodules' include/ came out (the snapshots may lack blobs)
check_count() {  # check_count GIT COMMIT DIR_IN_STAGE
  local want have
  want=$(git -C "$1" ls-tree -r "$2" include | wc -l)
  have=$(find "$STAGE/tree/$TOP/$3/include" -type f | wc -l)
  [ "$want" -eq "$have" ] || die "$3/include: $have files, $want in git"
  echo "$3/include: $have files"
}
check_count "$CUTLASS_GIT" "$CUTLASS_COMMIT" third-party/cutlass
check_count "$FMT_GIT" "$FMT_COMMIT" third-party/fmt
for f in setup.py csrc/python_api.cpp deep_gemm/__init__.py deep_gemm/include/deep_gemm/impls/sm90_bf16_gemm.cuh \
         scripts/generate_pyi.py third-party/cutlass/include/cute/arch/cluster_sm90.hpp \
         third-party/cutlass/include/cutlass/arch/barrier.h third-party/fmt/include/fmt/format.h; do
  [ -f "$STAGE/tree/$TOP/$f" ] || die "missing $f"
done

CUTLASS_SHORT=${CUTLASS_COMMIT:0:12}
FMT_SHORT=${FMT_COMMIT:0:12}
echo "$TOP $COMMIT $VERSION cutlass=$CUTLASS_COMMIT fmt=$FMT_COMMIT" > "$STAGE/tree/$TOP/PACKINFO"

MTIME=$(git -C "$DG_GIT" log -1 --format=%ct "$COMMIT")
mkdir -p "$(dirname "$OUT_FILE")"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$MTIME" -C "$STAGE/tree" -cf - "$TOP" \
  | xz -9e -T0 > "$OUT_FILE.tmp"
mv "$OUT_FILE.tmp" "$OUT_FILE"
echo "wrote $OUT_FILE: $(stat -c %s "$OUT_FILE") bytes, $(tar -tJf "$OUT_FILE" | wc -l) entries," \
     "sha256 $(sha256sum "$OUT_FILE" | cut -c1-16) ($TOP, cutlass $CUTLASS_SHORT, fmt $FMT_SHORT)"
