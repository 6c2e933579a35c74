#!/usr/bin/env bash
# The node's read benchmark (bench/node.py: cold and warm sequential reads of a 1 GB layer) on a
# machine without network, from a bundle made by ../shared/device/mkbundle.sh, once with larger
# layers over partial files (--kernel-reads) and once over FUSE files (the default):
#   bash bench/device/reads.sh BUNDLE.tar.gz OUTDIR COMMIT [bench.node options...]
set -euo pipefail
BUNDLE=$(realpath "$1"); OUT=$(realpath "$2"); COMMIT=$3; shift 3
mkdir -p "$OUT"
. "$(dirname "$0")/bundle.sh"; unpack_bundle "$BUNDLE" /tmp/lfsb-reads /tmp/reads-dev
echo "machine: $(nproc) cpus, $(uname -r)"
for mode in kernel fuse; do
  extra=(); [ "$mode" = kernel ] && extra=(--kernel-reads)
  BENCH_COMMIT=$COMMIT PYTHONPATH="$W/run:$D" PYTHONUNBUFFERED=1 python3.11 -m bench.node \
    --sizes 1G --only cold,warm --work "$W/work" --out "$OUT/node-$mode.json" "${extra[@]}" "$@"
done
