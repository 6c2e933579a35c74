#!/usr/bin/env bash
# make demo: set up a temporary store (`layerfs store init`, removed at the
# end with the rest of the demo's files), build three sample layers (a busybox
# base rootfs, a Python toolchain, this project's source as the workspace) into it,
# compose env v1, build toolchain v2 and compose env v2, and show with
# `layerfs inspect` that the unchanged layers were neither rebuilt nor
# re-uploaded. Then start a node daemon, bring env v2 up lazily as a sandbox,
# run a command in it, print the cache statistics (bytes fetched against the
# env's size), take the sandbox down and stop the daemon. Last, it makes a
# small OCI image with umoci, imports it (`layerfs import`) and runs its
# default process through runc (`layerfs run`).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/layerfs-demo.XXXXXX)
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid"; wait "$daemon_pid" || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
stamp=1700000000  # fixed mtimes: the same sample gives the same layer on every run
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

make_base() {  # a tiny busybox rootfs
  local root=$work/base
  mkdir -p "$root"/{bin,sbin,etc,root,tmp,proc,sys,dev,usr/bin,var/log}
  cp /bin/busybox "$root/bin/busybox"
  for applet in $("$root/bin/busybox" --list); do
    [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
  printf 'NAME="layerfs demo base"\nID=demo\n' >"$root/etc/os-release"
  chmod 1777 "$root/tmp"
  touch -h -d "@$stamp" $(find "$root")
}

make_toolchain() {  # $1 = version: the Python standard library, plus a marker that changes
  local root=$work/toolchain-$1 stdlib
  stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  mkdir -p "$root/usr/lib/python3"
  tar -C "$stdlib" --exclude=test --exclude=__pycache__ --exclude=site-packages \
      --exclude=idlelib --exclude=tkinter --exclude=lib2to3 --exclude=ensurepip -cf - . \
    | tar -C "$root/usr/lib/python3" -xf -
  mkdir -p "$root/etc"
  printf 'toolchain %s\n' "$1" >"$root/etc/toolchain-release"
  touch -h -d "@$stamp" $(find "$root")
}

make_image() {  # an OCI image layout holding the base rootfs plus a greeting program
  local layout=$work/image bundle=$work/image-bundle
  umoci init --layout "$layout"
  umoci new --image "$layout:demo"
  umoci unpack --image "$layout:demo" "$bundle" >/dev/null
  cp -a "$work/base/." "$bundle/rootfs/"
  printf '#!/bin/sh\necho "hello from the $GREETING, in $(pwd), as $(id -un)"\n' \
    >"$bundle/rootfs/bin/hello"
  chmod 755 "$bundle/rootfs/bin/hello"
  touch -h -d "@$stamp" $(find "$bundle/rootfs")
  umoci repack --image "$layout:demo" "$bundle"
  umoci config --image "$layout:demo" --config.env GREETING=image --config.workingdir /tmp \
    --config.cmd /bin/hello
}

make_base
make_image
make_toolchain 1
make_toolchain 2
ws_version=$(git rev-parse --short=12 HEAD 2>/dev/null || echo 0)

export LAYERFS_STORE="file://$work/store"  # every command and the daemon use it
say "set up the store $LAYERFS_STORE"
layerfs store init "$LAYERFS_STORE"
say "build layers"
layerfs build "$work/base" --name demo/base --version 1 --role base
layerfs build "$work/toolchain-1" --name demo/toolchain --version 1 --role toolchain
git archive --format=tar --prefix=workspace/ HEAD | layerfs build - --name demo/workspace --version "$ws_version" --role workspace

env1="demo/env@1-$ws_version"
env2="demo/env@2-$ws_version"
say "env $env1"
layerfs env create "$env1" --layer "demo/workspace@$ws_version" --layer demo/toolchain@1 --layer demo/base@1

say "a new toolchain version: only its changed chunks are uploaded"
layerfs build "$work/toolchain-2" --name demo/toolchain --version 2 --role toolchain
layerfs env create "$env2" --layer "demo/workspace@$ws_version" --layer demo/toolchain@2 --layer demo/base@1

say "inspect the two env versions: base and workspace are the same manifests (same digest, same creation time)"
layerfs inspect "$env1"
layerfs inspect "$env2"
say "inspect the new toolchain layer"
layerfs inspect demo/toolchain@2
say "verify every chunk of $env2"
layerfs verify "$env2"
say "layers and envs in the store"
layerfs ls demo/toolchain
layerfs env ls

say "start a node daemon (root $work/node, log $work/daemon.log)"
node="$work/node"
layerfs daemon --root "$node" --cache-size 2G >"$work/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 100); do layerfs ps --root "$node" >/dev/null 2>&1 && break; sleep 0.1; done
layerfs ps --root "$node" >/dev/null

say "bring $env2 up lazily as sandbox demo-1"
time layerfs up "$env2" --id demo-1 --root "$node"

say "run a command inside it"
layerfs run demo-1 --root "$node" -- sh -c \
  'cat /etc/os-release; cat /etc/toolchain-release; ls /workspace; wc -c /usr/lib/python3/json/__init__.py'

say "cache statistics: only what the command touched was fetched"
layerfs stats --root "$node"
layerfs stats --root "$node" --json | python3 -c '
import json, sys
s = json.load(sys.stdin)
total = sum(layer["blob_bytes"] for layer in s["layers"].values())
got = s["cache"]["bytes_fetched"]
print(f"fetched {got / 2**20:.1f} MiB of the env\x27s {total / 2**20:.1f} MiB data blobs "
      f"({100 * got / max(total, 1):.1f} %)")'

say "take it down"
layerfs down demo-1 --root "$node"

say "import the OCI image $work/image:demo (one layer per image layer, its config kept)"
layerfs import "oci:$work/image:demo" --name demo/image --version 1
say "bring it up and run the image's own command through runc"
layerfs up demo/image@1 --id demo-image --root "$node" >/dev/null
layerfs run demo-image --root "$node"
layerfs down demo-image --root "$node"

say "stop the daemon"
kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=""
echo "daemon stopped; mounts left under $node: $(grep -c " $node" /proc/mounts || true)"
