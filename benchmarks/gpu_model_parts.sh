#!/usr/bin/env bash
# A packaged model's GGUF (retrofit's alias cache) cut into parts that fit a device call (at most 64 MiB travel per
# call, the tree included), and the calls that put it together in the GPU machine's retrofit cache, where
# `retrofit.load(ALIAS)` checks its sha256 and converts it once, as on first use here.
#
#   bash benchmarks/gpu_model_parts.sh ALIAS [PART_MIB]     (in the project root; ALIAS: qwen2.5-0.5b, gemma3-270m, ...)
#
# It writes .gpu/ALIAS.part-NN (ignored by git) and prints one device call per part: the machine stays 30 s after a
# call, so make them back to back; the last one assembles and checks the file. Qwen2.5-0.5B (491 MB) takes 10 calls of
# 50 MiB, Gemma 3 270M (253 MB) 6.
set -euo pipefail
alias=${1:?usage: gpu_model_parts.sh ALIAS [PART_MIB]}
part_mib=${2:-50}
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu
python=${PYTHON:-.venv/bin/python}
read -r gguf name sha < <("$python" - "$alias" <<'PY'
import sys
from retrofit.load import ALIASES, reference_gguf
alias = sys.argv[1]
print(reference_gguf(alias), ALIASES[alias].file_name, ALIASES[alias].sha256)
PY
)
rm -f ".gpu/$alias".part-*
split -b "${part_mib}M" -d "$gguf" ".gpu/$alias.part-"
parts=(.gpu/"$alias".part-*)
echo "${#parts[@]} parts of $gguf ($sha):"
cache='/root/retrofit-cache'
for i in "${!parts[@]}"; do
  part=${parts[$i]}
  step="mkdir -p $cache/parts && cp $part $cache/parts/"
  if [ "$i" -eq $(( ${#parts[@]} - 1 )) ]; then
    step="$step && mkdir -p $cache/$alias && cat $cache/parts/$alias.part-* > $cache/$alias/$name.tmp && echo '$sha  $cache/$alias/$name.tmp' | sha256sum -c - && mv $cache/$alias/$name.tmp $cache/$alias/$name && rm -r $cache/parts"
  fi
  echo "  call $((i + 1)): run carry [\"$part\"] command: $step"
done
echo "Later calls: export RETROFIT_CACHE=$cache; retrofit commands then find $alias there."
