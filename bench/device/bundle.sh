# Sourced by the device scripts: unpack_bundle BUNDLE B W unpacks a bundle made by
# ../shared/device/mkbundle.sh into B (its environment sourced, the host's missing libraries
# filled in), sets D to its site-packages, and copies this checkout's bench/ and harness/ into
# W/run (what the benchmarks run from), the caller then in W/run.
unpack_bundle() {
  local bundle=$1 repo
  B=$2; W=$3
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  rm -rf "$B" "$W"; mkdir -p "$B" "$W/run/bench" "$W/run/harness"
  tar xzf "$bundle" -C "$B"
  . "$B/env.sh"; lfsb_fill_libs
  D=$B/py/lib/python3/dist-packages
  cp "$repo"/bench/*.py "$W/run/bench/"; cp "$repo"/harness/*.py "$W/run/harness/"
  cd "$W/run"
}
