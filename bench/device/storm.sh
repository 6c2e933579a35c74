#!/usr/bin/env bash
# The creation storm (bench/storm.py) on a machine without network, from a bundle made by
# ../shared/device/mkbundle.sh (carried in .devbundle/ with a static busybox):
#   bash bench/device/storm.sh BUNDLE.tar.gz BUSYBOX OUTDIR COMMIT [storm options...]
# The base is the bundle's python3.11 + stdlib with the host libraries it links and busybox
# (sh, grep, cat); the toolchain is the bundle's site-packages under /opt/tc.
set -euo pipefail
BUNDLE=$(realpath "$1"); BUSYBOX=$(realpath "$2"); OUT=$(realpath "$3"); COMMIT=$4; shift 4
REPO=$(cd "$(dirname "$0")/../.." && pwd)
B=/tmp/lfsb; W=/tmp/storm-dev
rm -rf "$B" "$W"; mkdir -p "$B" "$W/run" "$OUT"
tar xzf "$BUNDLE" -C "$B"
. "$B/env.sh"; lfsb_fill_libs
D=$B/py/lib/python3/dist-packages
base=$W/base; mkdir -p "$base"/{bin,proc,dev,tmp,etc,lib64,usr/lib/x86_64-linux-gnu,py/bin,py/lib}
cp "$BUSYBOX" "$base/bin/busybox"; for a in sh grep cat; do ln -s busybox "$base/bin/$a"; done
cp "$B/py/bin/python3.11" "$base/py/bin/"; cp -a "$B/py/lib/python3.11" "$base/py/lib/"
ln -s /py/bin/python3.11 "$base/bin/python3"
libs() { LD_LIBRARY_PATH=$B/lib ldd "$1" 2>/dev/null | awk '/=>/ {print $3} /ld-linux/ {print $1}'; }
for f in "$B/py/bin/python3.11" $(find "$B/py" "$D" -name '*.so*' -type f); do libs "$f"; done |
  sort -u | while read -r l; do [ -f "$l" ] && cp -L "$l" "$base/usr/lib/x86_64-linux-gnu/"; done
cp -L /lib64/ld-linux-x86-64.so.2 "$base/lib64/"
ln -s usr/lib "$base/lib"
tc=$W/toolchain; mkdir -p "$tc/opt"; cp -a "$D" "$tc/opt/tc"
mkdir -p "$W/run/bench" "$W/run/harness"
cp "$REPO"/bench/*.py "$W/run/bench/"; cp "$REPO"/harness/*.py "$W/run/harness/"
cd "$W/run"
echo "machine: $(nproc) cpus, $(uname -r)"
BENCH_COMMIT=$COMMIT PYTHONPATH="$W/run:$D" PYTHONUNBUFFERED=1 python3.11 -m bench.storm \
  --base "$base" --toolchain "$tc" --imports "trio, zstandard, click, boto3, lmdb" \
  --work "$W/work" --out "$OUT/storm.json" "$@"
