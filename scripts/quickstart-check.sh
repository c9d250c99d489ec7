#!/usr/bin/env bash
# Compiles and runs README.md's quickstart exactly as printed there: the program after
# "<!-- quickstart.c -->", the command after "<!-- quickstart.cc -->" (run from a directory that
# stands for the repository root), and compares its output with the block after
# "<!-- quickstart.out -->". Needs target/release/libdpsync.so (cargo build --release).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The fenced block that follows the marker line $1 in README.md.
block() {
  awk -v marker="$1" '
    $0 == marker { found = 1; next }
    found && !inside && /^```/ { inside = 1; next }
    inside && /^```/ { exit }
    inside { print }
  ' "$root/README.md"
}

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
block '<!-- quickstart.c -->' >"$dir/quickstart.c"
block '<!-- quickstart.cc -->' >"$dir/command.sh"
block '<!-- quickstart.out -->' >"$dir/expected"
for f in quickstart.c command.sh expected; do
  [ -s "$dir/$f" ] || { echo "quickstart-check: README.md has no block for $f" >&2; exit 1; }
done
[ -e "$root/target/release/libdpsync.so" ] || {
  echo "quickstart-check: no target/release/libdpsync.so: run cargo build --release" >&2
  exit 1
}
# The command runs where the user would: the repository root, here its include/ and target/.
ln -s "$root/include" "$dir/include"
ln -s "$root/target" "$dir/target"
(cd "$dir" && bash -e command.sh >"$dir/actual" 2>"$dir/stderr") || {
  echo "quickstart-check: the README's command failed:" >&2
  cat "$dir/command.sh" "$dir/stderr" >&2
  exit 1
}
if [ -s "$dir/stderr" ]; then
  echo "quickstart-check: the README's command printed warnings or errors:" >&2
  cat "$dir/stderr" >&2
  exit 1
fi
if ! diff -u "$dir/expected" "$dir/actual"; then
  echo "quickstart-check: the quickstart's output differs from README.md's (above)" >&2
  exit 1
fi
echo "quickstart-check: README.md's quickstart compiles and prints what the README shows"
