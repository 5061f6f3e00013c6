#!/usr/bin/env bash
# ab.sh PASSES "BENCH ARGS" BIN... : runs `BIN bench --device cuda BENCH ARGS` for every binary,
# one after another, PASSES times (A B A B ...: builds compared inside one call on a shared card),
# printing each run's result rows tagged with the binary's name and the pass.
set -eu
passes=$1 args=$2
shift 2
for pass in $(seq 1 "$passes"); do
  for bin in "$@"; do
    # shellcheck disable=SC2086
    "$bin" bench --device cuda $args 2>/dev/null | grep -E '^\|' | grep -v -E 'model|---' | sed "s|^|$(basename "$bin") #$pass |"
  done
done
