"""`make install` for real: the wheel (with the compiled `_erofscheck`) built
from this checkout, installed into a fresh venv of the system Python
(/usr/bin/python3) under a temporary PREFIX, the command linked into BINDIR,
the unit (naming BINDIR's command and CONFDIR's environment file) and its
environment file written; then the installed command run by
an unprivileged user the test makes: `--help`, a build into a store of theirs,
`ls` and `verify` (which checks the meta image with the compiled module,
shown to be the wheel's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import IN_CI, need_root
from support.users import LocalUser

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = Path("/usr/bin/python3")
FALLBACK_WARNING = "layerfs.formats._erofscheck) is not"


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A temporary directory every user can traverse (pytest's are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="layerfs-install-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_install(prefix: Path, bindir: Path, unitdir: Path, confdir: Path,
                 dist: Path) -> subprocess.CompletedProcess:
    """`make install` into these places, with the running venv as the dev venv
    (not remade: `-o` its stamp) and the Debian packages taken as there."""
    venv, stamp = Path(sys.prefix), "installed-venv"  # the stamp: any name, taken as made
    return subprocess.run(
        ["make", "-C", str(REPO), "-o", "apt-deps", "-o", stamp, f"STAMP={stamp}",
         f"VENV={venv}", f"PYTHON={SYSTEM_PYTHON}", f"PREFIX={prefix}", f"BINDIR={bindir}",
         f"UNITDIR={unitdir}", f"CONFDIR={confdir}", f"DIST={dist}", "install"],
        capture_output=True, text=True, timeout=900)


def test_make_install_runs_for_another_user(open_dir: Path, local_user: LocalUser) -> None:
    if not SYSTEM_PYTHON.exists():
        if IN_CI:
            pytest.fail("CI has the system Python (/usr/bin/python3)")
        pytest.skip("no /usr/bin/python3")
    need_root()
    prefix, bindir = open_dir / "opt" / "layerfs", open_dir / "bin"
    unitdir, confdir, dist = open_dir / "units", open_dir / "etc", open_dir / "dist"
    made = make_install(prefix, bindir, unitdir, confdir, dist)
    assert made.returncode == 0, made.stdout + made.stderr
    wheels = list(dist.glob("layerfs-*.whl"))
    assert len(wheels) == 1 and "-cp3" in wheels[0].name, wheels  # a platform wheel
    with zipfile.ZipFile(wheels[0]) as wheel:
        assert any(n.startswith("layerfs/formats/_erofscheck.") and n.endswith(".so")
                   for n in wheel.namelist())
    # the venv is the system Python's, the command linked, the unit names the link
    assert (prefix / "bin" / "python").resolve() == SYSTEM_PYTHON.resolve()
    assert os.readlink(bindir / "layerfs") == str(prefix / "bin" / "layerfs")
    unit = (unitdir / "layerfs.service").read_text()
    assert f"ExecStart={bindir}/layerfs daemon --store=${{LAYERFS_STORE}} $LAYERFS_DAEMON_ARGS" \
        in unit.splitlines()
    # the unit reads the environment file CONFDIR has, and a missing one fails its start
    [env_line] = [line for line in unit.splitlines() if line.startswith("EnvironmentFile=")]
    assert env_line == f"EnvironmentFile={confdir}/daemon.env"
    assert "/etc/layerfs" not in unit
    assert (confdir / "daemon.env").stat().st_mode & 0o777 == 0o600

    layerfs = str(bindir / "layerfs")
    helped = local_user.run(layerfs, "--help")
    assert helped.returncode == 0, helped.stderr
    assert b"Usage: layerfs" in helped.stdout and b"daemon" in helped.stdout

    # a real command: the user builds a layer into a store of their own and checks it
    home = open_dir / "user"
    (home / "src" / "etc").mkdir(parents=True)
    (home / "src" / "etc" / "motd").write_text("installed\n")
    (home / "src" / "big").write_bytes(os.urandom(3 << 20))
    (home / "store").mkdir()
    subprocess.run(["chown", "-R", f"{local_user.uid}:{local_user.gid}", str(home)], check=True)
    store = f"file://{home / 'store'}"
    built = local_user.run(layerfs, "build", str(home / "src"), "--name", "motd",
                           "--version", "1", "--store", store)
    assert built.returncode == 0, built.stderr
    assert built.stdout.startswith(b"motd@1 sha256:")
    listed = local_user.run(layerfs, "ls", "--store", store)
    assert listed.returncode == 0 and b"motd" in listed.stdout, listed.stderr
    checked = local_user.run(layerfs, "verify", "motd@1", "--store", store)
    assert checked.returncode == 0, checked.stderr
    assert FALLBACK_WARNING.encode() not in checked.stderr  # the compiled check ran
    owners = {p.stat().st_uid for p in (home / "store").rglob("*")}
    assert owners == {local_user.uid}

    # the modules loaded are the wheel's, in the venv: the compiled check included
    site = prefix / "lib"
    loaded = local_user.run(str(prefix / "bin" / "python"), "-c",
                            "import layerfs, layerfs.formats.erofscheck as c\n"
                            "print(layerfs.__file__)\n"
                            "print(c._erofscheck.__file__)")
    assert loaded.returncode == 0, loaded.stderr
    package, compiled = loaded.stdout.decode().split()
    assert Path(package).is_relative_to(site) and "site-packages" in package
    assert Path(compiled).is_relative_to(site) and compiled.endswith(".so")
    assert Path(compiled).name.startswith("_erofscheck.cpython-")
