"""Builder throughput and stored size against ``tar | zstd -3`` and mkfs.erofs.

Generates (once, seeded) a tree of mixed file sizes with ~20 % duplicate
content, then in one run times: ``tar -c | zstd -3``, ``mkfs.erofs
--chunksize --blobdev`` and ``layerfs build`` into a fresh file:// store, all
reading the same tree from the page cache. Reports ratios (the machine is
noisy; absolute times are printed for reference) and then rebuilds after
changing 1 % of the files to measure what a new version uploads.

    python -m bench.build [--size-mb 1024] [--work bench/work]

Prints a table and writes bench/results/build.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import time
from pathlib import Path

from bench import RESULTS, WORK
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.refstore import RefStore
from layerfs.store.file import FileStore

GEN = 2  # bump when the generator changes
LOW_ENTROPY = bytes.maketrans(bytes(range(256)), b"etaoinshrdlucmfw" * 16)


def content(rng: random.Random, size: int) -> bytes:
    """Half the files incompressible, half text-like (about 2:1 under zstd)."""
    data = rng.randbytes(size)
    return data.translate(LOW_ENTROPY) if rng.random() < 0.5 else data


def file_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.897:
        return rng.randrange(64, 16 << 10)  # many small files
    if r < 0.997:
        return rng.randrange(16 << 10, 1 << 20)
    return rng.randrange(4 << 20, 48 << 20)  # some large libraries and archives


def generate(root: Path, total: int, seed: int = 42) -> dict:
    """A tree of ``total`` bytes; about 20 % of the bytes repeat earlier files."""
    marker = root / ".generated"
    if marker.exists() and json.loads(marker.read_text()).get("key") == [total, seed, GEN]:
        return json.loads(marker.read_text())
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(seed)
    written = dup = files = 0
    earlier: list[tuple[Path, int]] = []
    while written < total:
        d = root / f"pkg{files // 200:04d}" / f"sub{rng.randrange(8)}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"file{files:06d}"
        budget = 0.2 * written - dup
        fits = [e for e in earlier[-500:] if e[1] <= budget]
        if fits:
            src, size = rng.choice(fits)
            shutil.copyfile(src, path)
            dup += size
        else:
            size = file_size(rng)
            path.write_bytes(content(rng, size))
            if rng.random() < 0.2:
                earlier.append((path, size))
        written += path.stat().st_size
        files += 1
    info = {"key": [total, seed, GEN], "bytes": written, "files": files, "duplicate_bytes": dup}
    marker.write_text(json.dumps(info))
    return info


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_tar_zstd(tree: Path, out: Path) -> None:
    subprocess.run(f"tar -C '{tree}' --exclude=.generated -cf - . | zstd -3 -q -f -o '{out}'",
                   shell=True, check=True)


def run_mkfs(tree: Path, out: Path) -> None:
    (out / "blob").write_bytes(b"")
    subprocess.run(["mkfs.erofs", "--quiet", "--chunksize=1048576", f"--blobdev={out / 'blob'}",
                    str(out / "meta"), str(tree)], check=True, capture_output=True)


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def change_files(tree: Path, fraction: float, seed: int = 7) -> list[tuple[Path, int, bytes]]:
    """Overwrite 16 bytes in ``fraction`` of the files; returns what to restore."""
    files = sorted(p for p in tree.rglob("file*") if p.is_file())
    rng = random.Random(seed)
    undo = []
    for path in rng.sample(files, max(1, int(len(files) * fraction))):
        with open(path, "r+b") as f:
            offset = rng.randrange(max(path.stat().st_size - 16, 1))
            f.seek(offset)
            undo.append((path, offset, f.read(16)))
            f.seek(offset)
            f.write(rng.randbytes(16))
    return undo


def restore(undo: list[tuple[Path, int, bytes]]) -> None:
    for path, offset, data in undo:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--work", default=str(WORK / "build"))
    ap.add_argument("--out", default=str(RESULTS / "build.json"))
    args = ap.parse_args()
    work = Path(args.work)
    tree = work / "tree"
    info = generate(tree, args.size_mb << 20)
    for name in ("mkfs", "store"):
        shutil.rmtree(work / name, ignore_errors=True)
    (work / "tar.zst").unlink(missing_ok=True)
    (work / "mkfs").mkdir()
    subprocess.run(f"tar -C '{tree}' -cf - . > /dev/null", shell=True, check=True)  # warm cache

    t_tar = timed(lambda: run_tar_zstd(tree, work / "tar.zst"))
    t_mkfs = timed(lambda: run_mkfs(tree, work / "mkfs"))
    store = FileStore(str(work / "store"))
    res1 = None

    def build_v1() -> None:
        nonlocal res1
        res1 = build_layer(RefStore(store), str(tree), BuildOptions("bench/tree", "1"))

    t_lfs = timed(build_v1)
    stored = store_bytes(work / "store")
    tar_size = (work / "tar.zst").stat().st_size
    undo = change_files(tree, 0.01)
    changed = len(undo)
    res2 = None

    def build_v2() -> None:
        nonlocal res2
        res2 = build_layer(RefStore(store), str(tree), BuildOptions("bench/tree", "2"))

    t_v2 = timed(build_v2)
    restore(undo)
    assert res1 and res2
    mb = info["bytes"] / 1e6
    rows = [
        ("tar | zstd -3", t_tar, mb / t_tar, tar_size),
        ("mkfs.erofs --chunksize 1M", t_mkfs, mb / t_mkfs,
         (work / "mkfs" / "meta").stat().st_size + (work / "mkfs" / "blob").stat().st_size),
        ("layerfs build", t_lfs, mb / t_lfs, stored),
    ]
    result = {
        "tree": info,
        "runs": [{"tool": r[0], "seconds": round(r[1], 3), "mb_per_s": round(r[2], 1),
                  "output_bytes": r[3]} for r in rows],
        "speed_vs_tar_zstd": round(t_tar / t_lfs, 3),
        "speed_vs_mkfs_erofs": round(t_mkfs / t_lfs, 3),
        "stored_vs_tar_zstd": round(stored / tar_size, 3),
        "rebuild": {
            "changed_files": changed,
            "seconds": round(t_v2, 3),
            "uploaded_bytes": res2.manifest.stats.uploaded_bytes,
            "v1_uploaded_bytes": res1.manifest.stats.uploaded_bytes,
            "uploaded_fraction": round(res2.manifest.stats.uploaded_bytes
                                       / res1.manifest.stats.uploaded_bytes, 4),
        },
        "targets": {"speed_vs_tar_zstd": ">= 0.5", "stored_vs_tar_zstd": "<= 1.0",
                    "rebuild_uploaded_fraction": "<= 0.03"},
    }
    print(f"tree: {info['files']} files, {mb:.0f} MB, "
          f"{info['duplicate_bytes'] / info['bytes']:.0%} duplicate bytes")
    print(f"{'tool':28} {'seconds':>8} {'MB/s':>8} {'output MB':>10}")
    for name, secs, rate, size in rows:
        print(f"{name:28} {secs:8.2f} {rate:8.1f} {size / 1e6:10.1f}")
    print(f"layerfs speed / tar|zstd speed: {result['speed_vs_tar_zstd']:.2f}x (target >= 0.5)")
    print(f"layerfs stored / tar.zst size:  {result['stored_vs_tar_zstd']:.2f}x (target <= 1.0)")
    rb = result["rebuild"]
    print(f"rebuild after changing {changed} files (1%): uploaded "
          f"{rb['uploaded_bytes'] / 1e6:.1f} MB = {rb['uploaded_fraction']:.2%} of v1 "
          f"(target <= 3%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
