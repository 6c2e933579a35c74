"""Pulling from registries: the docker:// image source against a real
``docker-registry`` (anonymous, htpasswd Basic auth, token auth) and against
small fake servers for what a real registry does not do (lie about a
digest, redirect a blob to another host, fail with 5xx)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import IN_CI

from harness.ociimages import ImageSettings, LayerChange, make_image
from harness.registryserver import (
    Account,
    Answer,
    FakeServer,
    RegistryServer,
    blob,
    find_registry,
    free_port,
    layout_manifest,
    make_index,
    new_account,
    push,
    start_registry,
)
from layerfs.builder.oci.image import (
    MAX_DOCUMENT,
    OCI_INDEX,
    OCI_MANIFEST,
    Descriptor,
)
from layerfs.builder.oci.registry import BLOB_MILESTONE, RegistrySource, parse_reference
from layerfs.errors import (
    IntegrityError,
    RefNotFound,
    RegistryAuthRequired,
    RegistryUnreachable,
    SourceError,
)

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

REPO = "lib/app"
MODES = ("anonymous", "htpasswd", "token")


def _need(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        message = f"missing {', '.join(missing)} (make deps installs them)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


# -- fixtures: one image layout, three registries -------------------------------------


BASE_LAYER = LayerChange(files={"etc/os-release": b"NAME=layerfs-test\n",
                                 "data/big.bin": os.urandom(3 << 20)})  # several read buffers
APP_LAYER = LayerChange(files={"app/run.sh": b"#!/bin/sh\necho hi\n"}, delete=["data/big.bin"])


@pytest.fixture(scope="session")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCI layout: ``v1`` (2 layers), ``arm`` (1 layer, linux/arm64) and the index ``multi``."""
    _need("umoci", "skopeo")
    path = tmp_path_factory.mktemp("images") / "layout"
    make_image(path, "v1", [BASE_LAYER, APP_LAYER], ImageSettings(env=["GREETING=hello"]))
    make_image(path, "arm", [BASE_LAYER], ImageSettings(architecture="arm64"))
    make_index(path, "multi", {"v1": "linux/amd64", "arm": "linux/arm64"})
    return path


@pytest.fixture(scope="session")
def registries(starts_a_server, tmp_path_factory: pytest.TempPathFactory,
               layout: Path) -> Iterator[dict[str, RegistryServer]]:
    """The three registries, each holding ``REPO:v1`` and ``REPO:multi``."""
    _need("docker-registry", "htpasswd")
    binary = find_registry()
    assert binary is not None
    started: dict[str, RegistryServer] = {}
    try:
        for mode in MODES:
            server = start_registry(binary, tmp_path_factory.mktemp(f"registry-{mode}"), mode)
            started[mode] = server
            push(layout, "v1", server, REPO)
            push(layout, "multi", server, REPO, all_images=True)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(params=MODES)
def registry(starts_a_server, request: pytest.FixtureRequest,
             registries: dict[str, RegistryServer]) -> RegistryServer:
    return registries[request.param]


@pytest.fixture(autouse=True)
def no_ambient_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads the real user's credentials: HOME is empty, REGISTRY_AUTH_FILE unset."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)


def _source(server: RegistryServer, ref: str, tmp_path: Path,
            account: Account | None = None) -> RegistrySource:
    """A source for ``server/REPO<ref>``; ``account`` (default: the server's) in an auth file."""
    account = account or server.account
    auth_file = None
    if account is not None:
        auth_file = str(account.auth_file(tmp_path / "auth.json", server.host))
    return RegistrySource(f"docker://{server.host}/{REPO}{ref}", plain_http=True,
                          auth_file=auth_file)


def _descriptor(entry: dict) -> Descriptor:
    return Descriptor(entry["mediaType"], entry["digest"], entry["size"])


# -- references ---------------------------------------------------------------------


def test_references_parse_with_or_without_prefix() -> None:
    digest = "sha256:" + "ab" * 32
    assert parse_reference("docker://reg.example:5000/a/b:v1").ref == "v1"
    plain = parse_reference("reg.example/a/b")
    assert (plain.host, plain.repository, plain.tag) == ("reg.example", "a/b", "latest")
    pinned = parse_reference(f"127.0.0.1:5000/app@{digest}")
    assert (pinned.host, pinned.repository, pinned.ref) == ("127.0.0.1:5000", "app", digest)


@pytest.mark.parametrize("text", ["docker://", "docker://host", "docker://host/UPPER:tag",
                                  "docker://host/a@sha256:short", "docker://ho st/a",
                                  "docker://host/a:bad/tag", "docker://host/a:"])
def test_bad_references_are_one_source_error(text: str) -> None:
    with pytest.raises(SourceError) as caught:
        RegistrySource(text)
    assert caught.value.exit_code == 3
    assert "\n" not in str(caught.value)


# -- the real registry: manifests, blobs, the three ways to log in -----------------------


def test_manifest_by_tag_and_by_digest(registry: RegistryServer, layout: Path,
                                       tmp_path: Path) -> None:
    desc, expected = layout_manifest(layout, "v1")
    by_tag = _source(registry, ":v1", tmp_path)
    assert by_tag.get_manifest() == (expected, OCI_MANIFEST)
    assert by_tag.get_manifest(desc["digest"]) == (expected, OCI_MANIFEST)
    by_digest = _source(registry, f"@{desc['digest']}", tmp_path)
    assert by_digest.get_manifest() == (expected, OCI_MANIFEST)
    assert by_digest.describe() == f"docker://{registry.host}/{REPO}@{desc['digest']}"


def test_blobs_stream_the_stored_bytes(registry: RegistryServer, layout: Path,
                                       tmp_path: Path) -> None:
    _, manifest = layout_manifest(layout, "v1")
    entries = json.loads(manifest)
    source = _source(registry, ":v1", tmp_path)
    for entry in [entries["config"], *entries["layers"]]:
        with source.open_blob(_descriptor(entry)) as stream:
            pieces = iter(lambda: stream.read(64 << 10), b"")  # noqa: B023
            streamed = b"".join(pieces)
        assert streamed == blob(layout, entry["digest"])
    source.close()


def test_an_index_and_its_platform_manifests(registries: dict[str, RegistryServer],
                                             layout: Path, tmp_path: Path) -> None:
    source = _source(registries["anonymous"], ":multi", tmp_path)
    body, media_type = source.get_manifest()
    assert media_type == OCI_INDEX
    platforms = {}
    for entry in json.loads(body)["manifests"]:
        manifest, manifest_type = source.get_manifest(entry["digest"])
        assert manifest_type == OCI_MANIFEST
        assert hashlib.sha256(manifest).hexdigest() == entry["digest"].removeprefix("sha256:")
        platforms[entry["platform"]["architecture"]] = manifest
    assert platforms == {"amd64": layout_manifest(layout, "v1")[1],
                         "arm64": layout_manifest(layout, "arm")[1]}


def test_credentials_from_docker_config_in_home(registries: dict[str, RegistryServer],
                                                layout: Path, tmp_path: Path) -> None:
    server = registries["htpasswd"]
    assert server.account is not None
    server.account.auth_file(Path(os.environ["HOME"]) / ".docker" / "config.json",
                             f"https://{server.host}")  # keys may carry a scheme
    source = RegistrySource(f"{server.host}/{REPO}:v1", plain_http=True)
    assert source.get_manifest()[0] == layout_manifest(layout, "v1")[1]


def test_credentials_from_registry_auth_file(registries: dict[str, RegistryServer],
                                             layout: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    server = registries["token"]
    assert server.account is not None
    path = server.account.auth_file(tmp_path / "containers-auth.json", server.host)
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(path))
    source = RegistrySource(f"docker://{server.host}/{REPO}:v1", plain_http=True)
    assert source.get_manifest()[0] == layout_manifest(layout, "v1")[1]


def test_token_issuer_asked_with_service_and_scope(registries: dict[str, RegistryServer],
                                                   tmp_path: Path) -> None:
    server = registries["token"]
    assert server.issuer is not None
    before = len(server.issuer.requests)
    source = _source(server, ":v1", tmp_path)
    manifest = json.loads(source.get_manifest()[0])
    for entry in [manifest["config"], *manifest["layers"]]:
        source.open_blob(_descriptor(entry)).close()
    asked = server.issuer.requests[before:]  # one token, reused for the blobs
    assert asked == [{"service": "layerfs-test-registry", "scope": f"repository:{REPO}:pull"}]


def test_token_in_access_token_field(registries: dict[str, RegistryServer], layout: Path,
                                     tmp_path: Path) -> None:
    issuer = registries["token"].issuer
    assert issuer is not None
    issuer.token_field = "access_token"
    try:
        source = _source(registries["token"], ":v1", tmp_path)
        assert source.get_manifest()[0] == layout_manifest(layout, "v1")[1]
    finally:
        issuer.token_field = "token"


@pytest.mark.parametrize("mode", ["htpasswd", "token"])
@pytest.mark.parametrize("login", ["none", "wrong password"])
def test_401_is_one_auth_error(registries: dict[str, RegistryServer], mode: str, login: str,
                               tmp_path: Path) -> None:
    server = registries[mode]
    assert server.account is not None
    account = Account(server.account.username, "not-the-password")
    source = (RegistrySource(f"docker://{server.host}/{REPO}:v1", plain_http=True)
              if login == "none" else _source(server, ":v1", tmp_path, account))
    with pytest.raises(RegistryAuthRequired) as caught:
        source.get_manifest()
    assert caught.value.exit_code == 7
    assert str(caught.value) == f"registry {server.host}: authentication required for {REPO}"


def test_malformed_auth_file_is_one_source_error(tmp_path: Path) -> None:
    """An entry whose ``auth`` is not base64 ``user:password``: one line that names the
    file and the host, and shows nothing of the entry."""
    path = tmp_path / "auth.json"
    no_colon = base64.b64encode(b"secret-without-colon").decode()
    path.write_text(json.dumps({"auths": {"reg.example": {"auth": no_colon}}}))
    with pytest.raises(SourceError) as caught:
        RegistrySource("docker://reg.example/app:v1", auth_file=str(path))
    assert str(caught.value) == f"source {path}: malformed registry auth entry for reg.example"
    assert "secret" not in str(caught.value)
    assert RegistrySource("docker://other.example/app", auth_file=str(path)).credentials is None


PULL_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from layerfs.builder.oci.registry import RegistrySource
from layerfs.errors import LayerfsError
try:
    source = RegistrySource(sys.argv[1], plain_http=True, auth_file=sys.argv[2])
    print(repr(source), repr(source.credentials))
    body, media_type = source.get_manifest()
    print("pulled", len(body), media_type)
except LayerfsError as exc:
    print(f"layerfs: error: {exc}", file=sys.stderr)
    sys.exit(exc.exit_code)
"""


@pytest.mark.parametrize("mode", ["htpasswd", "token"])
def test_credentials_never_printed_or_logged(registries: dict[str, RegistryServer], mode: str,
                                             tmp_path: Path) -> None:
    """Debug logging on, the source and its credentials printed, a good and a wrong
    password: neither password nor its base64 form shows anywhere."""
    server = registries[mode]
    assert server.account is not None
    wrong = new_account(server.account.username)
    outputs = []
    for account, status in ((server.account, 0), (wrong, 7)):
        auth_file = account.auth_file(tmp_path / f"auth-{status}.json", server.host)
        done = subprocess.run([sys.executable, "-c", PULL_SCRIPT, f"{server.host}/{REPO}:v1",
                               str(auth_file)], capture_output=True, text=True, timeout=120)
        assert done.returncode == status, done.stderr
        outputs.append((account, done.stdout + done.stderr))
    assert "pulled" in outputs[0][1]
    assert "authentication required" in outputs[1][1]
    for account, output in outputs:
        secrets = (account.password, base64.b64encode(account.creds().encode()).decode())
        assert not [secret for secret in secrets if secret in output]


def test_missing_tag_and_repository_are_not_found(registry: RegistryServer,
                                                  tmp_path: Path) -> None:
    for ref in (":no-such-tag", "-missing:v1"):
        account = registry.account
        source = RegistrySource(f"docker://{registry.host}/{REPO}{ref}", plain_http=True,
                                auth_file=str(account.auth_file(tmp_path / "a.json", registry.host))
                                if account else None)
        with pytest.raises(RefNotFound) as caught:
            source.get_manifest()
        assert caught.value.exit_code == 5
        assert str(caught.value) == f"no such image: docker://{registry.host}/{REPO}{ref}"


def test_missing_blob_is_not_found(registries: dict[str, RegistryServer], tmp_path: Path) -> None:
    source = _source(registries["anonymous"], ":v1", tmp_path)
    with pytest.raises(RefNotFound) as caught:
        source.open_blob(Descriptor("application/octet-stream", "sha256:" + "0" * 64, 1))
    assert caught.value.exit_code == 5


# -- fake servers: lies, redirects, failures ------------------------------------------------


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_lying_registry_is_an_integrity_error() -> None:
    """A manifest asked for by digest that comes back with other bytes, even with
    a Docker-Content-Digest header claiming the digest asked for."""
    real = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "layers": []}).encode()
    forged = real.replace(b'"layers": []', b'"layers": [], "x": 1')
    wanted = _digest(real)

    def route(path: str, headers: dict[str, str]) -> Answer:
        return Answer(200, forged, {"Content-Type": OCI_MANIFEST,
                                    "Docker-Content-Digest": wanted})

    with FakeServer(route) as fake:
        for source, digest in ((RegistrySource(f"{fake.host}/app@{wanted}", True), None),
                               (RegistrySource(f"{fake.host}/app:v1", True), wanted)):
            with pytest.raises(IntegrityError) as caught:
                source.get_manifest(digest)
            assert caught.value.exit_code == 6
            assert wanted in str(caught.value)


def test_docker_content_digest_is_advisory() -> None:
    """A wrong Docker-Content-Digest on the right bytes changes nothing."""
    body = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST}).encode()

    def route(path: str, headers: dict[str, str]) -> Answer:
        return Answer(200, body, {"Content-Type": "application/json",
                                  "Docker-Content-Digest": "sha256:" + "1" * 64})

    with FakeServer(route) as fake:
        source = RegistrySource(f"docker://{fake.host}/app@{_digest(body)}", plain_http=True)
        assert source.get_manifest() == (body, OCI_MANIFEST)  # type from the document


def test_blob_redirect_to_another_host_drops_authorization(tmp_path: Path) -> None:
    """The registry wants Basic auth and redirects the blob to storage on another
    host: the storage gets the right request without the registry's Authorization."""
    data = os.urandom(200_000)
    digest = _digest(data)
    account = new_account()
    expected_auth = "Basic " + base64.b64encode(account.creds().encode()).decode()

    with FakeServer(lambda path, headers: Answer(200, data), address="127.0.0.2") as storage:

        def registry(path: str, headers: dict[str, str]) -> Answer:
            if headers.get("authorization") != expected_auth:
                return Answer(401, b"", {"WWW-Authenticate": 'Basic realm="test"'})
            location = f"http://{storage.host}/bucket/{digest}?signed=1"
            return Answer(307, b"", {"Location": location})

        with FakeServer(registry) as fake:
            auth_file = account.auth_file(tmp_path / "auth.json", fake.host)
            source = RegistrySource(f"{fake.host}/app:v1", True, str(auth_file))
            with source.open_blob(Descriptor("application/octet-stream", digest,
                                             len(data))) as stream:
                assert stream.read() == data
    assert [seen.headers.get("authorization") for seen in fake.seen] == [None, expected_auth]
    assert [seen.path for seen in storage.seen] == [f"/bucket/{digest}?signed=1"]
    assert "authorization" not in storage.seen[0].headers


def test_truncated_blob_is_one_error() -> None:
    """A blob whose body breaks off before its Content-Length: one error, not short data."""
    data = os.urandom(100_000)
    cut = Answer(200, data[:40_000], length=len(data))
    with FakeServer(lambda path, headers: cut) as fake:
        source = RegistrySource(f"{fake.host}/app:v1", plain_http=True)
        with source.open_blob(Descriptor("application/octet-stream", _digest(data),
                                         len(data))) as stream:
            with pytest.raises(RegistryUnreachable) as caught:
                while stream.read(8192):
                    pass
    assert "broke off after 40000 bytes" in str(caught.value)
    assert caught.value.exit_code == 8


def test_oversized_manifest_is_refused() -> None:
    huge = Answer(200, b" " * (MAX_DOCUMENT + 1), {"Content-Type": OCI_MANIFEST})
    with FakeServer(lambda path, headers: huge) as fake:
        with pytest.raises(SourceError) as caught:
            RegistrySource(f"{fake.host}/app:v1", plain_http=True).get_manifest()
    assert "larger than" in str(caught.value)


def test_5xx_is_retried_then_unreachable() -> None:
    body = json.dumps({"schemaVersion": 2}).encode()
    answers = iter([Answer(503), Answer(502), Answer(200, body, {"Content-Type": OCI_MANIFEST})])
    with FakeServer(lambda path, headers: next(answers)) as fake:
        assert RegistrySource(f"{fake.host}/app:v1", True).get_manifest() == (body, OCI_MANIFEST)
        assert len(fake.seen) == 3
    with FakeServer(lambda path, headers: Answer(500)) as broken:
        with pytest.raises(RegistryUnreachable) as caught:
            RegistrySource(f"{broken.host}/app:v1", True).get_manifest()
    assert caught.value.exit_code == 8
    assert len(broken.seen) == 3  # bounded


def test_closed_port_is_unreachable_in_bounded_time() -> None:
    """A port nobody listens on: exit 8 and one error line, well inside the time limit."""
    script = ("import sys\nfrom layerfs.builder.oci.registry import RegistrySource\n"
              "from layerfs.errors import LayerfsError\n"
              "try:\n    RegistrySource(sys.argv[1], plain_http=True).get_manifest()\n"
              "except LayerfsError as exc:\n"
              "    print(f'layerfs: error: {exc}', file=sys.stderr); sys.exit(exc.exit_code)\n")
    port = free_port()
    done = subprocess.run([sys.executable, "-c", script, f"docker://127.0.0.1:{port}/app:v1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 8
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"layerfs: error: registry 127.0.0.1:{port}")


def test_tls_to_a_plain_http_registry_names_plain_http(tmp_path) -> None:
    """An import without --plain-http from a registry that answers plain HTTP:
    OpenSSL's "wrong version number", and the option that fixes it, in one line."""
    with FakeServer(lambda path, headers: Answer(200, b"{}")) as fake:
        proc = subprocess.run(
            [sys.executable, "-m", "layerfs.cli.main", "import", f"docker://{fake.host}/app:v1",
             "--name", "app", "--version", "1", "--timeout", "5",
             "--store", f"file://{tmp_path / 'store'}"],
            capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 8 and len(lines) == 1, proc.stderr
    assert "WRONG_VERSION_NUMBER" in lines[0] and "give --plain-http" in lines[0], lines[0]


# -- a registry that trickles: the import ends within --timeout --

TRICKLE_PAUSE = 2.0  # a byte every 2 s: no socket timeout ever trips
STALL_TIMEOUT = 3.0


def trickling_registry(case: str) -> Callable[[str, dict[str, str]], Answer]:
    """A fake registry whose manifest (its body, or its status line and headers)
    or config blob comes a byte every :data:`TRICKLE_PAUSE` seconds."""
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "layers": [],
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": _digest(config), "size": len(config)}}).encode()

    def route(path: str, headers: dict[str, str]) -> Answer:
        if "/manifests/" in path:
            return Answer(200, manifest, {"Content-Type": OCI_MANIFEST},
                          trickle=TRICKLE_PAUSE if case != "config blob" else 0.0,
                          trickle_headers=case == "headers")
        return Answer(200, config, trickle=TRICKLE_PAUSE)

    return route


@pytest.mark.parametrize("case", ["manifest", "headers", "config blob"])
def test_trickling_registry_ends_the_import_within_the_timeout(case, tmp_path) -> None:
    with FakeServer(trickling_registry(case)) as fake:
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "layerfs.cli.main", "import", f"docker://{fake.host}/app:v1",
             "--plain-http", "--name", "app", "--version", "1", "--timeout", str(STALL_TIMEOUT),
             "--store", f"file://{tmp_path / 'store'}"],
            capture_output=True, text=True, timeout=60)
        took = time.monotonic() - started
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 8 and len(lines) == 1, proc.stderr
    assert f"no progress for {STALL_TIMEOUT:g}s (--timeout)" in lines[0], lines[0]
    assert took < STALL_TIMEOUT + TRICKLE_PAUSE + 8  # (the interpreter's start included)


def test_slow_blob_that_keeps_coming_is_read() -> None:
    """Progress is what counts: a blob in pieces, each well within the timeout,
    is read whole even though it takes longer than the timeout overall."""
    data = os.urandom(3 * BLOB_MILESTONE)
    with FakeServer(lambda path, headers: Answer(200, data, trickle_piece=BLOB_MILESTONE,
                                                 trickle=0.6)) as fake:
        source = RegistrySource(f"{fake.host}/app:v1", plain_http=True, timeout=1.0)
        started = time.monotonic()
        with source.open_blob(Descriptor("application/octet-stream", _digest(data),
                                         len(data))) as stream:
            assert stream.read() == data
        assert time.monotonic() - started > 1.0
