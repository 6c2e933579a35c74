"""An unprivileged local user made by a test (``useradd``), and commands run as
that user (``runuser``): the attacker of the node-security tests."""

from __future__ import annotations

import os
import pwd
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from support import need_root


@dataclass(frozen=True)
class LocalUser:
    """A throwaway account with no privileges and no home directory."""

    name: str
    uid: int
    gid: int

    def run(self, *argv: str, timeout: float = 60.0,
            input: bytes | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` as this user (``runuser -u NAME --``), capturing output."""
        return subprocess.run(["runuser", "-u", self.name, "--", *argv], input=input,
                              capture_output=True, timeout=timeout, cwd="/")

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess:
        """Run a Python snippet as this user with the system interpreter."""
        return self.run("/usr/bin/python3", "-c", code, *args)


@pytest.fixture
def local_user() -> Iterator[LocalUser]:
    """A new unprivileged user for one test; deleted afterwards."""
    need_root()
    name = f"lfs{uuid.uuid4().hex[:10]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", "--user-group",
                    name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    try:
        yield LocalUser(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        subprocess.run(["userdel", name], capture_output=True)
        assert os.geteuid() == 0
