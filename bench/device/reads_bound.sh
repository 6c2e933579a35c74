#!/usr/bin/env bash
# What bounds a cold sequential read on a many-core machine (issue 35: 541 MB/s over partial files
# and 586 MB/s over FUSE files on 16 cores, the same as on 2): bench/node.py's cold read of a 1 GB
# layer with the file:// store on the node's disk and in /dev/shm (memory: no store reads from the
# disk the fills write to and EROFS reads back from), over partial files (--kernel-reads) and FUSE
# files, the disk's bytes read and written during each run (/proc/diskstats) beside it:
#   bash bench/device/reads_bound.sh BUNDLE.tar.gz OUTDIR COMMIT [bench.node options...]
set -euo pipefail
BUNDLE=$(realpath "$1"); OUT=$(realpath "$2"); COMMIT=$3; shift 3
SHM=/dev/shm/bound-store
rm -rf "$SHM"; mkdir -p "$OUT"
. "$(dirname "$0")/bundle.sh"; unpack_bundle "$BUNDLE" /tmp/lfsb-bound /tmp/bound-dev
echo "machine: $(nproc) cpus, $(uname -r), $(free -g | awk '/Mem/ {print $2}') GiB"
sectors() { awk '$3 !~ /^(loop|ram|dm-)/ && $3 !~ /[0-9]p?[0-9]+$/ {r += $6; w += $10} END {print r, w}' /proc/diskstats; }
run() {  # MODE STORE-PLACE
  local mode=$1 place=$2 extra=(); shift 2
  [ "$mode" = kernel ] && extra=(--kernel-reads)
  if [ "$place" = shm ]; then
    [ -d "$SHM" ] || cp -a "$W/work/store" "$SHM"
    rm -rf "$W/work/store.disk"; mv "$W/work/store" "$W/work/store.disk"; ln -s "$SHM" "$W/work/store"
  fi
  read -r r0 w0 < <(sectors)
  BENCH_COMMIT=$COMMIT PYTHONPATH="$W/run:$D" PYTHONUNBUFFERED=1 python3.11 -m bench.node \
    --only cold --work "$W/work" --out "$OUT/node-$mode-$place.json" "${extra[@]}" "$@" 2>&1 |
    grep -E "sandbox read|store GET|seq read|prepared|Error|error" || true
  read -r r1 w1 < <(sectors)
  echo "  disk during $mode/$place: read $(( (r1 - r0) / 2048 )) MiB, written $(( (w1 - w0) / 2048 )) MiB"
  if [ "$place" = shm ]; then rm "$W/work/store"; mv "$W/work/store.disk" "$W/work/store"; fi
}
echo "== kernel, store on disk (the layer built first)"; run kernel disk "$@"
for mode in kernel fuse; do for place in shm disk; do echo "== $mode, store on $place"; run "$mode" "$place" "$@"; done; done
