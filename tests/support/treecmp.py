"""Compare two mounted or on-disk trees entry by entry (names, types, modes,
owners, mtimes, sizes, contents, link targets, device numbers, xattrs and hard
link identity). Returns a list of differences; empty means equal."""

from __future__ import annotations

import hashlib
import os
import stat


def _xattrs(path: str) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    return {n: os.getxattr(path, n, follow_symlinks=False) for n in names}


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def snapshot(root: str, contents: bool = True, dir_mtime: bool = True) -> dict[str, tuple]:
    """path → facts; hard links share a group id (the first path of the inode)."""
    out: dict[str, tuple] = {}
    groups: dict[tuple[int, int], str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [""] + sorted(dirnames) + sorted(filenames):
            if name == "" and dirpath != root:
                continue
            path = os.path.join(dirpath, name) if name else dirpath
            rel = os.path.relpath(path, root)
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # overlayfs lists a lower-only dir's whiteouts
                continue
            fmt = stat.S_IFMT(st.st_mode)
            facts: list = [fmt, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid]
            if fmt != stat.S_IFDIR or dir_mtime:
                facts.append(st.st_mtime_ns)
            if fmt == stat.S_IFREG:
                facts += [st.st_size, _digest(path) if contents else None]
                key = (st.st_dev, st.st_ino)
                facts.append(groups.setdefault(key, rel) if st.st_nlink > 1 else rel)
            elif fmt == stat.S_IFLNK:
                facts.append(os.readlink(path))
            elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
                facts.append((os.major(st.st_rdev), os.minor(st.st_rdev)))
            facts.append(tuple(sorted(_xattrs(path).items())))
            out[rel] = tuple(facts)
    return out


def diff_trees(a: str, b: str, **kw: bool) -> list[str]:
    sa, sb = snapshot(a, **kw), snapshot(b, **kw)
    problems = []
    for path in sorted(set(sa) | set(sb)):
        if path not in sa:
            problems.append(f"only in {b}: {path}")
        elif path not in sb:
            problems.append(f"only in {a}: {path}")
        elif sa[path] != sb[path]:
            problems.append(f"{path}: {sa[path]} != {sb[path]}")
    return problems
