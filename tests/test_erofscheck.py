"""The structural check of meta images: what layerfs writes passes, targeted
corruptions are refused, and fuzzed mutants are either refused or accepted by
fsck.erofs too (a sample also mounted by the kernel, watching dmesg)."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import IN_CI, build, need_root
from support.gentree import make_tree
from support.metaimages import CHUNK, Layout, Sample, layout_of, reseal, sample  # noqa: F401  (a fixture)

from layerfs.chunks import materialize_blob
from layerfs.errors import BadMetaImage
from layerfs.formats import _erofscheck, erofscheck
from layerfs.formats.erofs import BLOCK, SB_OFFSET
from layerfs.formats.erofscheck import check_meta_image
from layerfs.mounts import mount_erofs, umount
from layerfs.refstore import RefStore
from layerfs.store import open_store


def refused(image: bytes, sample: Sample) -> str:
    with pytest.raises(BadMetaImage) as info:
        check_meta_image(image, sample.blob_size, sample.chunk_size, "s@1")
    return str(info.value)


def test_what_layerfs_writes_passes(sample):
    shape = check_meta_image(sample.image, sample.blob_size, sample.chunk_size, "s@1")
    assert shape.inodes == len(sample.layout.inodes) and shape.dirs > 1
    assert shape.chunk_indexes == len(sample.layout.chunk_indexes) > 0


def _u32(image: bytes, at: int, value: int) -> bytes:
    img = bytearray(image)
    struct.pack_into("<I", img, at, value)
    return bytes(img)


def _u16(image: bytes, at: int, value: int) -> bytes:
    img = bytearray(image)
    struct.pack_into("<H", img, at, value)
    return bytes(img)


def _u64(image: bytes, at: int, value: int) -> bytes:
    img = bytearray(image)
    struct.pack_into("<Q", img, at, value)
    return bytes(img)


def _subdir_dirent(sample: Sample) -> int:
    """A dirent of a subdirectory (not . or ..)."""
    for at in sample.layout.dirents:
        ftype = sample.image[at + 10]
        if ftype == 2 and sample.layout.names[at] not in (b".", b".."):
            return at
    raise AssertionError("no subdirectory")


def test_targeted_corruptions_are_refused(sample):
    img, lay = sample.image, sample.layout
    sb = SB_OFFSET
    root_nid = struct.unpack_from("<H", img, sb + 14)[0]
    index = lay.chunk_indexes[0]
    cases = [
        (img[: len(img) - BLOCK], "blocks"),
        (img[:-100], "multiple of 4096"),
        (bytes([img[0]]) + img[1:sb + 20] + bytes([img[sb + 20] ^ 1]) + img[sb + 21:],
         "checksum"),
        (reseal(_u32(img, sb + 80, 0x4 | 0x8 | 0x2)), "feature_incompat"),  # compressed
        (reseal(_u32(img, sb + 80, 0x4 | 0x8 | 0x40)), "feature_incompat"),  # unknown
        (reseal(_u16(img, sb + 84, 1)), "compression"),
        (reseal(_u32(img, sb + 8, 0x1 | 0x10)), "feature_compat"),
        (reseal(bytes(img[: sb + 12]) + b"\x0d" + img[sb + 13:]), "block size"),
        (reseal(_u16(img, sb + 86, 2)), "one extra device"),
        (reseal(_u32(img, 9 * 128 + 64, sample.blob_size // BLOCK + 1)), "larger than the blob"),
        (reseal(_u32(img, sb + 16, 3)), "inode"),
        (reseal(_u16(img, sb + 14, lay.inodes[-1] // 32)), "not a directory"),
        (reseal(_u16(img, sb + 14, 2)), "outside the inode area"),
        (reseal(_u32(img, index + 4, 1 << 24)), "outside the blob"),
        (reseal(_u16(img, index + 2, 0)), "outside the blob"),
        (reseal(_u16(img, index + 2, 7)), "outside the blob"),
        (reseal(_u16(img, index, 1)), "advise"),
        (reseal(_u64(img, _subdir_dirent(sample), root_nid)), "reached twice"),
        (reseal(_u64(img, _subdir_dirent(sample), 1 << 40)), "outside the inode area"),
        (reseal(_u64(img, _subdir_dirent(sample), lay.inodes[1] // 32 + 1)), ""),
        (reseal(_u16(img, lay.dirents[0] + 8, 11)), "nameoff"),
        (reseal(_u16(img, lay.inodes[1], 0x10)), "i_format"),
        (reseal(_u16(img, lay.inodes[1], 0x6 | (img[lay.inodes[1]] & 1))), "layout"),
        (reseal(_u16(img, lay.inodes[1] + 2, 0x3FF)), "xattr"),
        (reseal(_u16(img, lay.inodes[0] + 4, 0o170755)), "file type"),
    ]
    wrong = []
    for i, (mutant, words) in enumerate(cases):
        try:
            check_meta_image(mutant, sample.blob_size, sample.chunk_size, "s@1")
            wrong.append((i, words, "accepted"))
            continue
        except BadMetaImage as exc:
            message = str(exc)
        assert message.startswith("integrity check failed for the meta image of s@1: ")
        if words not in message:
            wrong.append((i, words, message))
    assert wrong == [], "\n".join(map(str, wrong))


def _fsck(image: bytes, blob: Path, work: Path) -> subprocess.CompletedProcess:
    meta = work / "mutant.img"
    meta.write_bytes(image)
    return subprocess.run(["fsck.erofs", f"--device={blob}", str(meta)], capture_output=True,
                          text=True, timeout=60)


def _dmesg() -> list[str]:
    proc = subprocess.run(["dmesg"], capture_output=True, text=True)
    return proc.stdout.splitlines() if proc.returncode == 0 else []


def _mount_and_walk(image: bytes, blob: Path, work: Path) -> list[str]:
    """Mount the image, read every file and xattr, unmount; new erofs kernel warnings."""
    meta, mnt = work / "mounted.img", work / "mnt"
    meta.write_bytes(image)
    mnt.mkdir(exist_ok=True)
    before = len(_dmesg())
    mount_erofs(str(meta), str(blob), str(mnt))
    try:
        for top, dirs, files in os.walk(mnt):
            for name in dirs + files:
                path = os.path.join(top, name)
                os.listxattr(path, follow_symlinks=False)
                if os.path.isfile(path) and not os.path.islink(path):
                    with open(path, "rb") as f:
                        while f.read(1 << 20):
                            pass
    finally:
        umount(str(mnt))
    new = _dmesg()[before:]
    return [line for line in new if "erofs" in line.lower()
            and ("WARNING" in line or "BUG" in line or "Call Trace" in line)]


def mutants(sample_layout: Layout, size: int) -> st.SearchStrategy:
    """(kind, offset, value or length, reseal) describing one mutation."""
    fields = (sample_layout.inodes + sample_layout.chunk_indexes + sample_layout.dirents
              + [SB_OFFSET + k for k in range(0, 128, 2)] + [9 * 128 + 64, 9 * 128 + 68])
    anywhere = st.integers(0, size - 1)
    return st.one_of(
        st.tuples(st.just("flip"), anywhere, st.integers(0, 7), st.booleans()),
        st.tuples(st.just("set"), anywhere, st.integers(0, 255), st.booleans()),
        st.tuples(st.just("truncate"), anywhere, st.just(0), st.just(False)),
        st.tuples(st.just("field"), st.sampled_from(fields), st.integers(0, 15),
                  st.sampled_from([0, 1, 2, 0xFF, 0xFFFF, 0xFFFFFFFF, 1 << 31, 40, 4096])),
    )


def apply(image: bytes, mutation: tuple) -> bytes:
    kind, at, arg, extra = mutation
    img = bytearray(image)
    if kind == "truncate":
        return bytes(img[:at])
    if kind == "flip":
        img[at] ^= 1 << arg
        return reseal(img) if extra else bytes(img)
    if kind == "set":
        img[at] = arg
        return reseal(img) if extra else bytes(img)
    at += 2 * (arg % 8) if at >= BLOCK or at < SB_OFFSET else 0
    width = 4 if extra > 0xFFFF else 2
    if at + width <= len(img):
        img[at : at + width] = (extra & ((1 << 8 * width) - 1)).to_bytes(width, "little")
    return reseal(img)


def run_fuzz(sample: Sample, work: Path, mutations: list[tuple], mount_every: int) -> dict:
    """Every mutant refused or accepted by fsck.erofs too; some accepted ones mounted."""
    counts = {"refused": 0, "accepted": 0, "mounted": 0}
    for mutation in mutations:
        mutant = apply(sample.image, mutation)
        try:
            check_meta_image(mutant, sample.blob_size, sample.chunk_size, "s@1")
        except BadMetaImage:
            counts["refused"] += 1
            continue
        counts["accepted"] += 1
        fsck = _fsck(mutant, sample.blob, work)
        assert fsck.returncode == 0, (mutation, fsck.stdout, fsck.stderr)
        if mount_every and counts["accepted"] % mount_every == 1:
            assert _mount_and_walk(mutant, sample.blob, work) == [], mutation
            counts["mounted"] += 1
    return counts


def drawn_mutations(sample: Sample, count: int) -> list[tuple]:
    """``count`` mutations of the sample drawn by hypothesis (see :func:`mutants`)."""
    seen: list[tuple] = []

    @settings(max_examples=count, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutation=mutants(sample.layout, len(sample.image)))
    def collect(mutation: tuple) -> None:
        seen.append(mutation)

    collect()
    return seen


def test_fuzzed_mutants_are_refused_or_sound(sample, tmp_path):
    """Bit flips, byte sets, truncations and field-targeted values (superblock, device
    slot, inodes, chunk indexes, dirents), resealed or not."""
    need_root()
    seen = drawn_mutations(sample, 300)
    counts = run_fuzz(sample, tmp_path, seen, mount_every=10)
    assert counts["refused"] + counts["accepted"] == len(seen) and counts["refused"]


def mixed_mutants(sample: Sample, count: int, seed: int) -> list[tuple[bytes, int, int]]:
    """``count`` (image, blob size, chunk size): one to four mutations each
    (:func:`drawn_mutations`), mostly under the layer's sizes, some under others."""
    seen = drawn_mutations(sample, 400)
    rnd = random.Random(seed)
    sizes = [(sample.blob_size, sample.chunk_size), (sample.blob_size, 4096),
             (0, sample.chunk_size), (sample.blob_size, 0)]
    out = []
    for i in range(count):
        image = sample.image
        for _ in range(1 + i % 4):
            if len(image) == len(sample.image):
                image = apply(image, rnd.choice(seen))
        blob_size, chunk_size = sizes[0] if i % 3 else rnd.choice(sizes)
        out.append((image, blob_size, chunk_size))
    return out


def reference_verdict(image: bytes, blob_size: int, chunk_size: int) -> object:
    """The reference check's ImageShape fields, or None for a refusal."""
    try:
        shape = erofscheck.reference_check(image, blob_size, chunk_size)
    except (erofscheck._Bad, struct.error):
        return None
    return (shape.inodes, shape.dirs, shape.regular, shape.chunk_indexes, shape.blocks)


def test_compiled_and_reference_checks_agree(sample):
    """The compiled check and the Python one give the same verdict and shape on
    fuzzed mutants, one to four mutations each, under the layer's sizes and others."""
    wrong, accepted = [], 0
    for i, (image, blob_size, chunk_size) in enumerate(mixed_mutants(sample, 1500, 11)):
        compiled = _erofscheck.check(image, blob_size, chunk_size)
        reference = reference_verdict(image, blob_size, chunk_size)
        accepted += reference is not None
        if compiled != reference:
            wrong.append((i, compiled, reference))
    assert wrong == []
    assert 100 < accepted < 1400  # both verdicts were exercised


SANITIZED_RUN = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("_erofscheck", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
blob = open(sys.argv[2], "rb").read()
verdicts, at = [], 0
for length, blob_size, chunk_size in json.load(open(sys.argv[3])):
    verdicts.append(module.check(blob[at:at + length], blob_size, chunk_size))
    at += length
print(json.dumps(verdicts))
"""


def sanitized_module(work: Path) -> Path:
    """The compiled check built with ASan and UBSan (any UBSan report aborts)."""
    out = work / ("_erofscheck" + sysconfig.get_config_var("EXT_SUFFIX"))
    source = Path(erofscheck.__file__).with_name("_erofscheck.c")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer",
                    "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-Wall", "-Wextra", "-Werror", "-I", sysconfig.get_paths()["include"],
                    str(source), "-o", str(out)], check=True, capture_output=True, timeout=120)
    return out


def gcc_runtime(name: str) -> str:
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_compiled_check_is_clean_under_sanitizers(sample, tmp_path):
    """In CI: the compiled check built with -fsanitize=address,undefined gives the
    reference's verdicts on a few hundred fuzzed mutants, without one sanitizer report."""
    if not IN_CI:
        pytest.skip("the sanitizer build runs in CI (CI=true)")
    cases = mixed_mutants(sample, 400, 23)
    (tmp_path / "images").write_bytes(b"".join(image for image, _, _ in cases))
    (tmp_path / "cases.json").write_text(json.dumps([[len(image), blob, chunk]
                                                    for image, blob, chunk in cases]))
    env = dict(os.environ, LD_PRELOAD=f"{gcc_runtime('libasan.so')} {gcc_runtime('libubsan.so')}",
               PYTHONMALLOC="malloc",  # every buffer where ASan sees it
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=97",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=98")
    proc = subprocess.run([sys.executable, "-c", SANITIZED_RUN, str(sanitized_module(tmp_path)),
                           str(tmp_path / "images"), str(tmp_path / "cases.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "runtime error" not in proc.stderr \
        and "Sanitizer" not in proc.stderr, proc.stderr[-4000:]
    compiled = [tuple(v) if v is not None else None for v in json.loads(proc.stdout)]
    reference = [reference_verdict(*case) for case in cases]
    assert compiled == reference
    assert 0 < sum(v is not None for v in reference) < len(cases)  # both verdicts exercised


FALLBACK_RUN = """
import logging, sys
sys.modules["layerfs.formats._erofscheck"] = None  # as if it was never built
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
from layerfs.errors import BadMetaImage
from layerfs.formats import erofscheck
import layerfs.refstore  # imports the check
image = open(sys.argv[1], "rb").read()
blob_size, chunk_size = int(sys.argv[2]), int(sys.argv[3])
print(erofscheck.check_meta_image(image, blob_size, chunk_size, "s@1").inodes)
print(erofscheck.check_meta_image(bytearray(image), blob_size, chunk_size, "s@1").inodes)
for bad in (image[:-4096], image[:5000], image[:1024] + bytes(len(image) - 1024)):
    try:
        erofscheck.check_meta_image(bad, blob_size, chunk_size, "s@1")
    except BadMetaImage as exc:
        print("refused:", exc)
"""


def test_without_the_compiled_module_the_reference_checks_with_one_warning(sample, tmp_path):
    """A checkout without the built module still imports and checks meta
    images: the reference check's verdicts, one warning for the process."""
    (tmp_path / "meta.img").write_bytes(sample.image)
    proc = subprocess.run([sys.executable, "-c", FALLBACK_RUN, str(tmp_path / "meta.img"),
                           str(sample.blob_size), str(sample.chunk_size)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    inodes = str(len(sample.layout.inodes))
    lines = proc.stdout.splitlines()
    assert lines[:2] == [inodes, inodes]
    assert len(lines) == 5 and all(line.startswith("refused: integrity check failed for the "
                                                   "meta image of s@1: ") for line in lines[2:])
    warnings = proc.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(
        "WARNING layerfs.formats.erofscheck: the compiled check of meta images"), proc.stderr


def test_checks_that_disagree_refuse(sample, monkeypatch):
    """An image the compiled check refuses is refused even if the reference passes it."""
    monkeypatch.setattr(_erofscheck, "check", lambda *args: None)
    message = refused(sample.image, sample)
    assert "refused by the compiled check, passed by the reference one" in message


def test_sizes_out_of_range_are_refused(sample):
    """A blob or chunk size outside [0, 2^64) is never taken modulo 2^64 by the
    compiled check: refused, with the reference's reason."""
    assert "larger than the blob" in refused_with(sample, -1, sample.chunk_size)
    assert "chunk size" in refused_with(sample, sample.blob_size, 2**64 + sample.chunk_size)
    with pytest.raises(OverflowError):
        _erofscheck.check(sample.image, -1, sample.chunk_size)
    with pytest.raises(OverflowError):
        _erofscheck.check(sample.image, sample.blob_size, 2**64)


def test_compiled_check_takes_only_immutable_bytes(sample):
    """The compiled check runs without the GIL, so a buffer that could change
    meanwhile is refused; check_meta_image copies one."""
    with pytest.raises(TypeError):
        _erofscheck.check(bytearray(sample.image), sample.blob_size, sample.chunk_size)
    shape = check_meta_image(bytearray(sample.image), sample.blob_size, sample.chunk_size, "s")
    assert shape.inodes == len(sample.layout.inodes)


def refused_with(sample: Sample, blob_size: int, chunk_size: int) -> str:
    with pytest.raises(BadMetaImage) as info:
        check_meta_image(sample.image, blob_size, chunk_size, "s@1")
    return str(info.value)


def test_big_meta_image_passes(tmp_path):
    """10k files in one directory tree, as layerfs writes them."""
    need_root()
    src = make_tree(str(tmp_path / "src"), seed=5, chunk_size=CHUNK, big_dir=10_000)
    store = open_store("file://" + str(tmp_path / "store"))
    refstore = RefStore(store)
    manifest = refstore.layer(build(store, src, name="big", chunk_size=CHUNK).digest)
    shape = check_meta_image(refstore.meta_image(manifest), manifest.blob_size, manifest.chunk_size,
                             "big@1")
    assert shape.inodes > 10_000
    store.close()


if __name__ == "__main__":  # a long fuzz run, outside the suite: python test_erofscheck.py N
    import sys
    import tempfile
    import time
    import warnings

    cases = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    warnings.simplefilter("ignore")  # .example() outside a test warns
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        work = Path(tmp)
        src = make_tree(str(work / "src"), seed=3, chunk_size=CHUNK, big_dir=300)
        fstore = open_store("file://" + str(work / "store"))
        freg = RefStore(fstore)
        m = freg.layer(build(fstore, src, name="s", chunk_size=CHUNK).digest)
        img = freg.meta_image(m)
        materialize_blob(fstore, freg.chunk_table(m), str(work / "blob.img"))
        smp = Sample(img, work / "blob.img", m.blob_size, m.chunk_size,
                     layout_of(img, m.blob_size, m.chunk_size))
        strategy = mutants(smp.layout, len(img))
        drawn = [strategy.example() for _ in range(cases)]
        t0 = time.monotonic()
        result = run_fuzz(smp, work, drawn, mount_every=50)
        print(cases, "cases", result, f"{time.monotonic() - t0:.0f}s")
