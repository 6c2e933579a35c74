#!/usr/bin/env bash
# The node's read benchmark (bench/node.py: cold and warm sequential reads of a 1 GB layer) on a
# machine without network, from a bundle made by ../shared/device/mkbundle.sh, once with larger
# layers over partial files (--kernel-reads) and once over FUSE files (the default):
#   bash bench/device/reads.sh BUNDLE.tar.gz OUTDIR COMMIT [bench.node options...]
set -euo pipefail
BUNDLE=$(realpath "$1"); OUT=$(realpath "$2"); COMMIT=$3; shift 3
REPO=$(cd "$(dirname "$0")/../.." && pwd)
B=/tmp/lfsb-reads; W=/tmp/reads-dev
rm -rf "$B" "$W"; mkdir -p "$B" "$W/run/bench" "$W/run/harness" "$OUT"
tar xzf "$BUNDLE" -C "$B"
. "$B/env.sh"; lfsb_fill_libs
D=$B/py/lib/python3/dist-packages
cp "$REPO"/bench/*.py "$W/run/bench/"; cp "$REPO"/harness/*.py "$W/run/harness/"
cd "$W/run"
echo "machine: $(nproc) cpus, $(uname -r)"
for mode in kernel fuse; do
  extra=(); [ "$mode" = kernel ] && extra=(--kernel-reads)
  BENCH_COMMIT=$COMMIT PYTHONPATH="$W/run:$D" PYTHONUNBUFFERED=1 python3.11 -m bench.node \
    --sizes 1G --only cold,warm --work "$W/work" --out "$OUT/node-$mode.json" "${extra[@]}" "$@"
done
