#!/usr/bin/env bash
# Build the vllm-steer wheel from the CURRENT working tree into .whl/ (for the GPU machine); run from the project
# root. A package that pyproject.toml's hand-kept list misses is added (with a warning) in a temporary copy only.
set -euo pipefail
root="$(pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
tar -C "$root" --exclude=./.venv --exclude='./.gpu*' --exclude=./.whl --exclude=./.git \
    --exclude='*/__pycache__' -cf - . | tar -C "$tmp" -xf -
missing=$(cd "$tmp/src" && find vllm_steer -name __init__.py -printf '%h\n' | tr / . | sort | while read -r pkg; do
  grep -q "\"$pkg\"" "$tmp/pyproject.toml" || echo "$pkg"; done)
if [ -n "$missing" ]; then
  echo "WARNING: pyproject.toml's packages list misses: $missing (added in the build copy only)" >&2
  for pkg in $missing; do
    sed -i "s/packages = \[\"vllm_steer\",/packages = [\"vllm_steer\", \"$pkg\",/" "$tmp/pyproject.toml"
  done
fi
mkdir -p "$root/.whl"
rm -f "$root"/.whl/vllm_steer-*.whl
python3 -m pip wheel --no-deps -q -w "$root/.whl" "$tmp"
whl=$(ls "$root"/.whl/vllm_steer-*.whl)
unzip -l "$whl" > "$tmp/listing"
for pkg in $(cd "$tmp/src" && find vllm_steer -name __init__.py -printf '%h\n'); do
  grep -q " $pkg/__init__.py" "$tmp/listing" || { echo "wheel lacks $pkg" >&2; exit 1; }
done
echo "built $whl ($(tail -1 "$tmp/listing" | awk '{print $2}') files)"
