#!/usr/bin/env bash
# Runs libFuzzer targets for SECONDS each (default 60), one after the other, each starting from a
# copy of its seed corpus in fuzz/corpus/ (the repository's corpus is only read). A finding fails
# the script and its input stays in the printed work directory; turn it into a regression test in
# tests/ and add the input to fuzz/corpus/<target>/.
#
#   fuzz/run.sh [BUILD_DIR (default build/fuzz)] [SECONDS (default 60)] [TARGET...]
#
# TARGET is npy, attention, backward, kvcache or varlen (default: all five). With FUZZ_MERGE=1 a
# clean run merges what it grew back into fuzz/corpus/<target>/: only inputs that reach coverage
# the committed corpus does not (libFuzzer's -merge=1), so the corpus grows by what matters.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "${1:-$root/build/fuzz}" && pwd)"
seconds="${2:-60}"
shift $(($# < 2 ? $# : 2))
targets=("$@")
[ "${#targets[@]}" -gt 0 ] || targets=(npy attention backward kvcache varlen)
work="$(mktemp -d "${TMPDIR:-/tmp}/flashattn-fuzz.XXXXXX")"
status=0
for target in "${targets[@]}"; do
  if [ ! -x "$build/fuzz/fuzz_$target" ]; then
    echo "fuzz/run.sh: no $build/fuzz/fuzz_$target (cmake --preset fuzz && cmake --build --preset fuzz)"
    exit 2
  fi
  mkdir -p "$work/$target"
  cp "$root/fuzz/corpus/$target/." -r "$work/$target/"
  echo "fuzz_$target: ${seconds} s from $(ls "$work/$target" | wc -l) seed inputs"
  if ! (cd "$work" && "$build/fuzz/fuzz_$target" "$work/$target" -max_total_time="$seconds" \
        -max_len=4096 -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
        -artifact_prefix="$work/$target-" 2>"$work/$target.log"); then
    tail -n 30 "$work/$target.log"
    echo "fuzz_$target: FINDING, input and log kept in $work"
    status=1
  else
    grep -E "^(stat::number_of_executed_units|Done)" "$work/$target.log" || true
    if [ "${FUZZ_MERGE:-0}" = 1 ]; then
      (cd "$work" && "$build/fuzz/fuzz_$target" -merge=1 -max_len=4096 -timeout=60 \
        -rss_limit_mb=4096 "$root/fuzz/corpus/$target" "$work/$target" 2>"$work/$target-merge.log")
      echo "fuzz_$target: corpus now $(ls "$root/fuzz/corpus/$target" | wc -l) inputs"
    fi
  fi
done
if [ "$status" -eq 0 ]; then rm -rf "$work"; fi
exit "$status"
