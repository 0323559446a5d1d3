#!/usr/bin/env bash
# What a fresh machine compiles for scripts/up and scripts/test, for two commits side by side:
# each from its own clone and an empty build directory, one after the other, printing the seconds
# of `cargo build --workspace --bins` and of the `cargo test --workspace --no-run` after it, the
# build directory's size and the crates in Cargo.lock.
#   load-tests/build-ab.sh BEFORE [AFTER]      (AFTER defaults to HEAD)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { echo "usage: $0 BEFORE [AFTER]" >&2; exit 64; }
work=$(mktemp -d "${TMPDIR:-/tmp}/mlscope-build-ab.XXXXXX")
trap 'rm -rf "$work"' EXIT
for rev in "$1" "${2:-HEAD}"; do
  git clone -q "$root" "$work/src"
  git -C "$work/src" checkout -q "$rev"
  cd "$work/src"
  export CARGO_TARGET_DIR="$work/target"
  t0=$SECONDS
  cargo build -q --workspace --bins
  t1=$SECONDS
  cargo test -q --workspace --no-run 2>/dev/null
  t2=$SECONDS
  printf '%s (%s): cargo build --workspace --bins %d s, then cargo test --workspace --no-run %d s; build directory %s; crates in Cargo.lock %d\n' \
    "$rev" "$(git rev-parse --short HEAD)" $((t1 - t0)) $((t2 - t1)) \
    "$(du -sh "$CARGO_TARGET_DIR" | cut -f1)" "$(grep -c '^name = ' Cargo.lock)"
  cd "$root"
  rm -rf "$work/src" "$work/target"
done
