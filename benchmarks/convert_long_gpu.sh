#!/usr/bin/env bash
# Long-context hybrids on one GPU (BENCHMARKS.md, Conversion): several conversions at once from recipes with a
# long-window stage 2, paused at a deadline so that the next device call resumes them, then one conversion report
# of dense beside every finished hybrid (`retrofit eval --report`: wikitext2 test perplexity, PIQA and ARC-easy in
# full with paired deltas, passkey and niah_single at 2K/4K/8K, generation fidelity).
#
#   bash benchmarks/convert_long_gpu.sh convert MINUTES CALIB_DIR RECIPE...   # start or resume every recipe
#   bash benchmarks/convert_long_gpu.sh report EVAL_DIR SEEDS RECIPE...       # dense beside the finished hybrids
#   bash benchmarks/convert_long_gpu.sh convert-report MINUTES CALIB_DIR EVAL_DIR SEEDS RECIPE...  # both, one call
#
# convert-report reports in the same command once every recipe has finished: a hybrid lives only as long as the
# machine that made it, so a conversion sized to end well inside one call should be reported before the call ends.
#
# The model converted is each recipe's own (`model:`); the report evaluates the first recipe's, at the long-context
# lengths REPORT_CONTEXTS (default 2k,4k,8k; 8k,16k,32k for Qwen2.5-0.5B's 32,768 positions), at REPORT_BATCH rows
# per call (default auto: per variant, task and length the largest batch the GPU holds, halved and rerun if it runs
# out of memory; the report's table says what it chose).
#
# Hybrids and their training checkpoints go under runs/ (git-ignored: kept between calls while the machine stays
# warm); logs and JSON go to $OUT (default ./out). A conversion that reaches MINUTES writes a checkpoint and exits 3;
# the same command resumes it. A finished run is converted again only once moved away; one whose recipe has changed
# since is named as such.
set -uo pipefail
command -v retrofit >/dev/null || retrofit() { python -m retrofit "$@"; }  # a GPU machine with the wheels, no entry point
stage=${1:?convert|report}
out=${OUT:-out}
mkdir -p "$out" runs

# Progress bars arrive as carriage-return redraws: one line per redraw once turned into newlines. Keep the last line
# of each run of redraws of one bar (its text before "NN%|") and drop blank lines, so that a log holds each bar's
# final state beside the run's own output (a line is held back only while its bar may still redraw).
progress_cut() {
  tr '\r' '\n' | awk '
    /^[[:space:]]*$/ { next }
    { key = ""; if (match($0, /: +[0-9]+%[|]/)) key = substr($0, 1, RSTART - 1) }
    key != "" && key == held_key { held = $0; next }
    { if (held != "") print held; held = ""; held_key = key }
    key != "" { held = $0; next }
    { print; fflush() }
    END { if (held != "") print held }'
}

recipe_model() {  # the model a recipe converts (its `model:` key, through its `base:` chain)
  python -c "import sys; from retrofit.convert.recipe import load_recipe; print(load_recipe(sys.argv[1])['model'])" "$1"
}

case "$stage" in
convert)
  minutes=${2:?MINUTES}; calib=${3:?CALIB_DIR}; shift 3
  for recipe in "$@"; do
    name=$(basename "$recipe" .yaml)
    if [ -f "runs/$name/config.json" ]; then
      if cmp -s "$recipe" "runs/$name.recipe.yaml"; then echo "$name: finished already"
      else echo "$name: finished from another recipe than $recipe (runs/$name.recipe.yaml); move runs/$name away to convert it again"
      fi
      continue
    fi
    cp "$recipe" "runs/$name.recipe.yaml"  # the recipe a finished run came from, to tell it from an edited one
    resume=()
    [ -f "runs/$name.train/train_state.pt" ] && resume=(--resume)
    (
      start=$(date +%s)
      retrofit convert "$(recipe_model "$recipe")" --recipe "$recipe" --data "$calib" --out "runs/$name" --device cuda \
        --no-report --max-minutes "$minutes" "${resume[@]}" 2>&1 | progress_cut >>"$out/convert_$name.log"
      code=${PIPESTATUS[0]}
      echo "convert $name exit $code after $(( $(date +%s) - start )) s" | tee -a "$out/convert_$name.log"
    ) &
  done
  wait
  for recipe in "$@"; do  # where each run stands: its last progress line
    name=$(basename "$recipe" .yaml)
    [ -f "$out/convert_$name.log" ] || continue
    echo "$name: $(grep -a -E '^(stage|scoring)' "$out/convert_$name.log" | grep -a '/' | tail -1)"
  done
  ;;
report)
  evaldir=${2:?EVAL_DIR}; seeds=${3:?SEEDS}; shift 3
  hybrids=()
  for recipe in "$@"; do
    name=$(basename "$recipe" .yaml)
    if [ -f "runs/$name/config.json" ]; then hybrids+=(--hybrid "runs/$name"); else echo "$name: not finished"; fi
  done
  retrofit eval "$(recipe_model "$1")" --report --data-dir "$evaldir" --num-seeds "$seeds" "${hybrids[@]}" --device cuda \
    --context-length "${REPORT_CONTEXTS:-2k,4k,8k}" --batch-size "${REPORT_BATCH:-auto}" \
    --json "$out/report.json" 2>&1 | progress_cut | grep -v "%|" | tee "$out/report.md"
  ;;
convert-report)
  minutes=${2:?MINUTES}; calib=${3:?CALIB_DIR}; evaldir=${4:?EVAL_DIR}; seeds=${5:?SEEDS}; shift 5
  bash "$0" convert "$minutes" "$calib" "$@"
  for recipe in "$@"; do
    name=$(basename "$recipe" .yaml)
    [ -f "runs/$name/config.json" ] || { echo "$name: not finished; no report (resume it with convert)"; exit 3; }
  done
  bash "$0" report "$evaldir" "$seeds" "$@"
  ;;
*)
  echo "usage: convert_long_gpu.sh convert MINUTES CALIB_DIR RECIPE... | report EVAL_DIR SEEDS RECIPE... |" \
       "convert-report MINUTES CALIB_DIR EVAL_DIR SEEDS RECIPE..." >&2
  exit 2
  ;;
esac
