"""Throwaway registries and a token realm for the registry tests and the benchmarks.

* :func:`start_registry` runs Debian's ``docker-registry`` (distribution 2.8)
  on a free 127.0.0.1 port with filesystem storage in a temporary directory:
  anonymous, with htpasswd Basic auth, or with token auth.
* :class:`TokenIssuer` is the token realm for the last: an HTTP server on
  127.0.0.1 that checks Basic credentials and answers a JWT (ES256, with its
  self-signed certificate in the ``x5c`` header) that the registry trusts
  through ``rootcertbundle``.
* :func:`make_index` adds a multi-platform index to an image layout (made
  with :mod:`harness.ociimages`), and :func:`push` copies an image into a
  registry with ``skopeo``.
* :class:`FakeServer` answers each request with what its route returns (an
  :class:`Answer`) and records what it was asked.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import secrets
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from harness.serverprocs import die_with_parent, log_tail, stop_process, wait_ready

START_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0
SERVICE = "layerfs-test-registry"
ISSUER = "layerfs-test-issuer"
TOKEN_SECONDS = 300


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Account:
    """A user the registry (or its token issuer) accepts."""

    username: str
    password: str = field(repr=False)

    def creds(self) -> str:
        """As ``skopeo --dest-creds`` takes it."""
        return f"{self.username}:{self.password}"

    def auth_file(self, path: Path, host: str) -> Path:
        """Write a Docker-style auth file with this account for ``host``."""
        auth = base64.b64encode(self.creds().encode()).decode()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
        return path


def new_account(name: str = "puller") -> Account:
    return Account(name, "pw-" + secrets.token_hex(12))


# -- the token issuer --------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenIssuer:
    """An HTTP token realm: Basic credentials in, a signed registry JWT out."""

    account: Account
    directory: Path
    token_field: str = "token"  # or "access_token": clients must take either
    requests: list[dict[str, str]] = field(default_factory=list)
    port: int = 0
    server: ThreadingHTTPServer | None = None

    def __post_init__(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.cert_path = self.directory / "issuer.crt"
        self.cert_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.cert_der = self.cert.public_bytes(serialization.Encoding.DER)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def sign(self, claims: dict[str, object]) -> str:
        """A compact JWS (ES256, x5c = the issuer's certificate) of ``claims``."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        header = {"typ": "JWT", "alg": "ES256", "x5c": [base64.b64encode(self.cert_der).decode()]}
        signing_input = ".".join(_b64url(json.dumps(part).encode()) for part in (header, claims))
        r, s = decode_dss_signature(self.key.sign(signing_input.encode(),
                                                  ec.ECDSA(hashes.SHA256())))
        signature = r.to_bytes(32, "big") + s.to_bytes(32, "big")
        return f"{signing_input}.{_b64url(signature)}"

    def token_for(self, scope: str, subject: str) -> str:
        """A token granting what ``scope`` asks (``repository:NAME:ACTIONS``)."""
        access = []
        for item in scope.split(" "):
            kind, _, rest = item.partition(":")
            name, _, actions = rest.rpartition(":")
            if kind == "repository" and name:
                access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": subject, "aud": SERVICE, "exp": now + TOKEN_SECONDS,
                  "nbf": now - 30, "iat": now, "jti": secrets.token_hex(8), "access": access}
        return self.sign(claims)

    def check(self, header: str | None) -> str | None:
        """The user name when ``header`` carries this issuer's account, else None."""
        if not header or not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except ValueError:
            return None
        ok = user == self.account.username and secrets.compare_digest(password,
                                                                       self.account.password)
        return user if ok else None

    def start(self) -> None:
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                issuer.requests.append(query)
                user = issuer.check(self.headers.get("Authorization"))
                if user is None:
                    self._answer(401, {"details": "bad credentials"})
                    return
                token = issuer.token_for(query.get("scope", ""), user)
                self._answer(200, {issuer.token_field: token, "expires_in": TOKEN_SECONDS})

            def _answer(self, status: int, body: dict[str, object]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


# -- the registry ---------------------------------------------------------------


@dataclass
class RegistryServer:
    """A running ``docker-registry``; ``host`` is ``127.0.0.1:PORT``."""

    host: str
    process: subprocess.Popen[bytes]
    log_path: Path
    account: Account | None = None
    issuer: TokenIssuer | None = None

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def answers(self) -> bool:
        try:
            with socket.create_connection(tuple(self.host.split(":")), timeout=1):  # type: ignore[arg-type]
                return True
        except OSError:
            return False

    def wait_ready(self) -> None:
        wait_ready(self.process, self.answers, "docker-registry", self.log_tail, START_TIMEOUT,
                   self.stop)

    def stop(self) -> None:
        """SIGTERM the registry's pid (SIGKILL if it lingers); stop its token issuer."""
        stop_process(self.process, STOP_TIMEOUT)
        if self.issuer is not None:
            self.issuer.stop()


def find_registry() -> str | None:
    return shutil.which("docker-registry")


def _htpasswd(account: Account, path: Path) -> None:
    """An htpasswd file with ``account`` (bcrypt, as distribution requires)."""
    made = subprocess.run(["htpasswd", "-Bin", account.username], input=account.password.encode(),
                          capture_output=True, check=True)
    path.write_bytes(made.stdout)


def _config(directory: Path, port: int, auth: dict[str, object]) -> str:
    config: dict[str, object] = {
        "version": 0.1,
        "log": {"level": "info", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(directory / "storage")},
                    "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": secrets.token_hex(16)},
    }
    if auth:
        config["auth"] = auth
    return json.dumps(config)  # JSON is YAML


def start_registry(binary: str, directory: Path, mode: str = "anonymous") -> RegistryServer:
    """Start a registry (``mode``: anonymous, htpasswd or token) and wait until it listens."""
    directory.mkdir(parents=True, exist_ok=True)
    account: Account | None = None
    issuer: TokenIssuer | None = None
    auth: dict[str, object] = {}
    if mode == "htpasswd":
        account = new_account()
        _htpasswd(account, directory / "htpasswd")
        auth = {"htpasswd": {"realm": "layerfs-test", "path": str(directory / "htpasswd")}}
    elif mode == "token":
        account = new_account()
        issuer = TokenIssuer(account, directory)
        issuer.start()
        auth = {"token": {"realm": issuer.realm, "service": SERVICE, "issuer": ISSUER,
                          "rootcertbundle": str(issuer.cert_path)}}
    port = free_port()
    config_path = directory / "config.yml"
    config_path.write_text(_config(directory, port, auth))
    log_path = directory / "registry.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [binary, "serve", str(config_path)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=directory, preexec_fn=die_with_parent,  # noqa: PLW1509
        )
    server = RegistryServer(f"127.0.0.1:{port}", process, log_path, account, issuer)
    server.wait_ready()
    return server


# -- test images -----------------------------------------------------------------

def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} failed: {done.stderr.strip()}")


def _blob_path(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def layout_manifest(layout: Path, tag: str) -> tuple[dict[str, object], bytes]:
    """The index.json descriptor of ``tag`` and the manifest bytes it names."""
    index = json.loads((layout / "index.json").read_text())
    for desc in index["manifests"]:
        if desc.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
            return desc, _blob_path(layout, desc["digest"]).read_bytes()
    raise KeyError(tag)


def blob(layout: Path, digest: str) -> bytes:
    return _blob_path(layout, digest).read_bytes()


def make_index(layout: Path, tag: str, platforms: dict[str, str]) -> str:
    """Add an OCI index ``tag`` to ``layout`` listing the images ``{tag: "os/arch"}``;
    return its digest."""
    entries = []
    for image_tag, platform in platforms.items():
        desc, _ = layout_manifest(layout, image_tag)
        os_name, arch = platform.split("/")
        entries.append({"mediaType": desc["mediaType"], "digest": desc["digest"],
                        "size": desc["size"], "platform": {"os": os_name, "architecture": arch}})
    data = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                       "manifests": entries}).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    _blob_path(layout, digest).write_bytes(data)
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    index["manifests"].append({
        "mediaType": "application/vnd.oci.image.index.v1+json", "digest": digest,
        "size": len(data), "annotations": {"org.opencontainers.image.ref.name": tag}})
    index_path.write_text(json.dumps(index))
    return digest


def push(layout: Path, tag: str, server: RegistryServer, repo: str,
         all_images: bool = False) -> str:
    """``skopeo copy`` of ``layout:tag`` to ``server/repo:tag``; returns the reference."""
    dest = f"docker://{server.host}/{repo}:{tag}"
    argv = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
    if server.account is not None:
        argv.append(f"--dest-creds={server.account.creds()}")
    if all_images:
        argv.append("--all")
    _run(*argv, f"oci:{layout}:{tag}", dest)
    return dest


# -- fake registries (for what a real one does not do) ------------------------------


@dataclass(frozen=True)
class Answer:
    """What a fake server answers to one request."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    length: int | None = None  # a Content-Length other than the body's: the body breaks off
    trickle: float = 0.0  # seconds between the body's pieces
    trickle_piece: int = 1  # bytes in each
    trickle_headers: bool = False  # the status line and headers trickle too


@dataclass(frozen=True)
class Seen:
    """A request a fake server got: its path and headers."""

    path: str
    headers: dict[str, str]


@dataclass
class FakeServer:
    """An HTTP server on ``address`` whose answers come from ``route(path, headers)``."""

    route: Callable[[str, dict[str, str]], Answer]
    address: str = "127.0.0.1"
    seen: list[Seen] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def host(self) -> str:
        assert self.server is not None
        return f"{self.address}:{self.server.server_address[1]}"

    def __enter__(self) -> FakeServer:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                headers = {key.lower(): value for key, value in self.headers.items()}
                fake.seen.append(Seen(self.path, headers))
                answer = fake.route(self.path, headers)
                if answer.trickle_headers:
                    self._trickle(b"HTTP/1.1 200 OK\r\n" * 1000, answer.trickle or 1.0)
                    return
                self.send_response(answer.status)
                for key, value in answer.headers.items():
                    self.send_header(key, value)
                length = len(answer.body) if answer.length is None else answer.length
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if answer.trickle:
                    self._trickle(answer.body, answer.trickle, answer.trickle_piece)
                    return
                self.wfile.write(answer.body)
                if answer.length is not None:
                    self.close_connection = True

            def _trickle(self, data: bytes, pause: float, piece: int = 1) -> None:
                """``data`` in pieces of ``piece`` bytes, ``pause`` seconds apart,
                until the client hangs up or the server stops."""
                self.close_connection = True
                try:
                    for i in range(0, len(data), piece):
                        self.wfile.write(data[i : i + piece])
                        self.wfile.flush()
                        if fake.stopping.wait(pause):
                            return
                except OSError:
                    pass  # the client gave up: what the test wants

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((self.address, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
