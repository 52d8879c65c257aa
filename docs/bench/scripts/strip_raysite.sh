#!/usr/bin/env bash
# Shrinks .gpu/raysite.tar.xz (../shared/gpu/pack-ray.sh's Ray for the GPU host) from ~46 to
# ~33 MB by dropping the symbol tables of its ELF files (strip --strip-unneeded: what the
# dynamic linker and Python's imports use stays), so a device call's 64 MiB carry also holds
# .whl's FlashMLA wheel and .gpu-deepgemm (session 35's call with all three was refused at the
# limit). The same stripping of the CPU venv's Ray 2.60 ran tasks, actors and a Serve HTTP
# deployment here. Run from the project root after pack-ray.sh; about 2.5 minutes.
set -euo pipefail
archive=.gpu/raysite.tar.xz
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xJf "$archive"
find "$work" -type f -exec sh -c \
  'file "$1" | grep -q "ELF.*not stripped" && strip --strip-unneeded "$1" || true' _ {} \;
tar -C "$work" -cf - . | xz -T0 -9 > "$archive.new"
mv "$archive.new" "$archive"
ls -la "$archive"
