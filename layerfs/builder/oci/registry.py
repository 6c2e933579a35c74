"""Images from a registry (``docker://HOST[:PORT]/REPO[:TAG|@sha256:...]``).

A client of the Docker Registry HTTP API v2 / OCI distribution spec, just
enough to pull: GET of a manifest or index by tag or digest (bounded in size)
and streamed GETs of blobs. Authentication: anonymous, Basic, and the Bearer
token flow of ``WWW-Authenticate``; credentials come from ``REGISTRY_AUTH_FILE``
or ``~/.docker/config.json`` (``auths[HOST].auth``, base64 ``user:pass``) and
appear in no message, log line or exception. A redirect to another origin
(a blob served from object storage) is followed without the Authorization
header. Connection errors and 5xx answers are retried a bounded number of
times. A manifest fetched by digest is checked against that digest here;
``Docker-Content-Digest`` is advisory only and never trusted.

A registry that answers slowly enough never trips a socket timeout (a byte
every few seconds), so each transfer has milestones it must reach within the
source's ``timeout`` (``import --timeout``): a request its answer (retries
included; a connection whose status line and headers have not come by then is
shut down), a document (manifest, index, token) its last byte, a blob each
:data:`BLOB_MILESTONE` bytes or its end; else
:class:`~layerfs.errors.RegistryNoProgress`. Reads take what one ``recv``
gives (``read1``) with the socket's timeout set to the time left, so the
deadline holds however the bytes trickle.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import urllib3

from ...errors import (
    IntegrityError,
    RefNotFound,
    RegistryAuthRequired,
    RegistryError,
    RegistryNoProgress,
    RegistryUnreachable,
    SourceError,
)
from .image import INDEX_TYPES, MANIFEST_TYPES, MAX_DOCUMENT, Descriptor, ImageSource

PREFIX = "docker://"
DEFAULT_TAG = "latest"
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 60.0
DEFAULT_TIMEOUT = 60.0  # seconds a transfer may take to reach its next milestone
BLOB_MILESTONE = 256 << 10  # a blob must bring this many bytes per timeout (or end)
READ_PIECE = 64 << 10
ATTEMPTS = 3  # per request, on connection errors and 5xx/429 answers
BACKOFF = 0.5  # seconds before the second attempt, doubled after
MAX_REDIRECTS = 5
DRAIN_LIMIT = 64 << 10  # a reply with more left unread is closed, not drained
BLOB_BUFFER = 1 << 20

_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)*"
                   r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?::[0-9]{1,5})?$")
_REPO = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
                   r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHALLENGE_PARAM = re.compile(r'([A-Za-z_]+)\s*=\s*"([^"]*)"')
_ERROR_CODE = re.compile(r"^[A-Z_]{1,64}$")

UNREACHABLE = (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError,
               urllib3.exceptions.MaxRetryError)  # fmt: skip
BROKEN = (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError,
          urllib3.exceptions.SSLError)  # fmt: skip


@dataclass(frozen=True)
class RegistryReference:
    """A parsed ``docker://`` reference: registry host (with port), repository,
    and a tag or a digest."""

    host: str
    repository: str
    tag: str
    digest: str | None = None

    @property
    def ref(self) -> str:
        """What to ask ``/manifests/`` for: the digest when given, else the tag."""
        return self.digest or self.tag

    def __str__(self) -> str:
        where = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"{PREFIX}{self.host}/{self.repository}{where}"


def parse_reference(text: str) -> RegistryReference:
    """``[docker://]HOST[:PORT]/REPO[:TAG|@sha256:HEX]``; the tag defaults to ``latest``."""
    rest = text.removeprefix(PREFIX)
    host, slash, path = rest.partition("/")
    if not slash or not _HOST.match(host):
        raise _bad_reference(text)
    digest = None
    if "@" in path:
        path, _, digest = path.partition("@")
        if not _DIGEST.match(digest):
            raise _bad_reference(text)
    tag = DEFAULT_TAG
    name, colon, maybe_tag = path.rpartition(":")
    if colon:
        path, tag = name, maybe_tag
    if not _REPO.match(path) or not _TAG.match(tag):
        raise _bad_reference(text)
    return RegistryReference(host, path, tag, digest)


def _bad_reference(text: str) -> SourceError:
    return SourceError(text, "expected docker://HOST[:PORT]/REPO[:TAG] or ...@sha256:<hex>")


@dataclass(frozen=True)
class Credentials:
    """A user name and password for one registry; the password is never shown."""

    username: str
    password: str = field(repr=False)

    def basic(self) -> str:
        """The value of an ``Authorization: Basic`` header."""
        pair = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")


def auth_file_path(auth_file: str | None = None) -> Path:
    """The credentials file: ``auth_file``, else ``$REGISTRY_AUTH_FILE``, else
    ``~/.docker/config.json``."""
    chosen = auth_file or os.environ.get("REGISTRY_AUTH_FILE")
    return Path(chosen) if chosen else Path.home() / ".docker" / "config.json"


def load_credentials(host: str, auth_file: str | None = None) -> Credentials | None:
    """The credentials stored for ``host`` in the auth file, or None (anonymous)."""
    path = auth_file_path(auth_file)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        reason = f"cannot read the registry auth file: {exc.strerror}"
        raise SourceError(str(path), reason) from None
    try:
        auths = json.loads(text).get("auths") or {}
        entry = _auth_entry(auths, host)
        return None if entry is None else _decode_entry(entry)
    except (ValueError, AttributeError, TypeError):
        raise SourceError(str(path), f"malformed registry auth entry for {host}") from None


def _auth_entry(auths: dict[str, Any], host: str) -> dict[str, Any] | None:
    """The ``auths`` entry whose key names ``host`` (keys may carry a scheme or a path)."""
    for key, entry in auths.items():
        bare = key.split("://", 1)[-1].split("/", 1)[0]
        if bare == host and isinstance(entry, dict):
            return entry
    return None


def _decode_entry(entry: dict[str, Any]) -> Credentials | None:
    if entry.get("auth"):
        pair = base64.b64decode(entry["auth"], validate=True).decode()
        user, colon, password = pair.partition(":")
        if not colon or not user:
            raise ValueError("no user:password")
        return Credentials(user, password)
    if entry.get("username") and "password" in entry:
        return Credentials(str(entry["username"]), str(entry["password"]))
    return None


@dataclass(frozen=True)
class Challenge:
    """A parsed ``WWW-Authenticate`` header: the scheme and its parameters."""

    scheme: str
    params: dict[str, str]


def parse_challenge(header: str) -> Challenge:
    scheme, _, rest = header.strip().partition(" ")
    return Challenge(scheme.lower(), dict(_CHALLENGE_PARAM.findall(rest)))


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib3.util.parse_url(url)
    return (parts.scheme or "", (parts.host or "").lower(), parts.port)


class _AnswerDeadline:
    """A connection whose answer (status line and headers) must come within
    ``answer_timeout`` seconds: else its socket is shut down, which ends the
    blocked read (the request then fails as a broken connection)."""

    answer_timeout = DEFAULT_TIMEOUT
    sock: Any

    def getresponse(self, *args: Any, **kw: Any) -> Any:
        timer = threading.Timer(self.answer_timeout, self._cut)
        timer.daemon = True
        timer.start()
        try:
            return super().getresponse(*args, **kw)  # type: ignore[misc]
        finally:
            timer.cancel()

    def _cut(self) -> None:
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile


def _watched_pools(timeout: float) -> dict[str, Any]:
    """urllib3 pool classes (by scheme) whose connections are :class:`_AnswerDeadline`."""

    class Plain(_AnswerDeadline, urllib3.connection.HTTPConnection):
        answer_timeout = timeout

    class Tls(_AnswerDeadline, urllib3.connection.HTTPSConnection):
        answer_timeout = timeout

    class PlainPool(urllib3.HTTPConnectionPool):
        ConnectionCls = Plain

    class TlsPool(urllib3.HTTPSConnectionPool):
        ConnectionCls = Tls

    return {"http": PlainPool, "https": TlsPool}


class RegistrySource(ImageSource):
    """An image in a registry, pulled over HTTPS (``plain_http``: HTTP)."""

    def __init__(self, reference: str, plain_http: bool = False,
                 auth_file: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.reference = parse_reference(reference)
        self.host = self.reference.host
        self.base = f"{'http' if plain_http else 'https'}://{self.host}/v2/"
        self.plain_http = plain_http
        self.timeout = timeout
        self.credentials = load_credentials(self.host, auth_file)
        self.pool = urllib3.PoolManager(
            retries=False, timeout=urllib3.Timeout(connect=min(CONNECT_TIMEOUT, timeout),
                                                   read=min(READ_TIMEOUT, timeout)))
        self.pool.pool_classes_by_scheme = _watched_pools(timeout)
        self._authorization: str | None = None
        self._lock = threading.Lock()

    def describe(self) -> str:
        return str(self.reference)

    def _url(self, kind: str, ref: str) -> str:
        return f"{self.base}{self.reference.repository}/{kind}/{urllib.parse.quote(ref)}"

    # -- the ImageSource interface ------------------------------------------

    def get_manifest(self, digest: str | None = None) -> tuple[bytes, str]:
        """The manifest or index of the reference (or of ``digest``) and its media type;
        fetched by digest, its bytes are checked against that digest."""
        wanted = digest or self.reference.digest
        ref = wanted or self.reference.tag
        reply = self._get(self._url("manifests", ref), {"Accept": ACCEPT}, "manifest", ref)
        try:
            body = _read_bounded(reply, f"manifest {ref} of {self.describe()}", self.host,
                                 self.timeout)
        finally:
            _release(reply)
        if wanted is not None:
            got = "sha256:" + hashlib.sha256(body).hexdigest()
            if got != wanted:
                raise IntegrityError(f"manifest {wanted} from {self.host}", f"its digest is {got}")
        return body, _media_type(reply.headers.get("Content-Type", ""), body)

    def open_blob(self, desc: Descriptor) -> BinaryIO:
        """The blob's stored bytes as a stream (unverified: the caller checks the digest)."""
        if not _DIGEST.match(desc.digest):
            raise SourceError(self.describe(), f"unsupported blob digest {desc.digest!r}")
        reply = self._get(self._url("blobs", desc.digest), {}, "blob", desc.digest)
        return io.BufferedReader(BlobStream(reply, self.host, desc.digest, self.timeout),
                                 BLOB_BUFFER)

    def close(self) -> None:
        self.pool.clear()

    # -- requests, authentication, redirects --------------------------------

    def _get(self, url: str, headers: dict[str, str], kind: str, ref: str) -> Any:
        """GET ``url`` as this registry's client: authenticate on a 401 (once per
        401), follow redirects, map failures to errors; the reply's body is unread."""
        reply = self._follow(url, headers, self._current_authorization())
        if reply.status == 401:
            challenge = parse_challenge(reply.headers.get("WWW-Authenticate", ""))
            _release(reply)
            authorization = self._authorize(challenge)
            reply = self._follow(url, headers, authorization)
            if reply.status == 401:
                _release(reply)
                raise self._auth_required()
        if reply.status == 200:
            return reply
        raise self._failed(reply, kind, ref)

    def _current_authorization(self) -> str | None:
        with self._lock:
            return self._authorization

    def _follow(self, url: str, headers: dict[str, str], authorization: str | None) -> Any:
        """GET ``url``, following redirects; Authorization goes only to the registry's origin."""
        home = _origin(self.base)
        for _ in range(MAX_REDIRECTS + 1):
            sent = dict(headers)
            if authorization is not None and _origin(url) == home:
                sent["Authorization"] = authorization
            reply = self._send("GET", url, sent)
            location = reply.headers.get("Location")
            if reply.status not in (301, 302, 303, 307, 308) or not location:
                return reply
            _release(reply)
            url = urllib.parse.urljoin(url, location)
            if not url.startswith(("https://", "http://")):
                raise RegistryError(self.host, "redirected to a non-HTTP location")
        raise RegistryError(self.host, f"more than {MAX_REDIRECTS} redirects")

    def _send(self, method: str, url: str, headers: dict[str, str]) -> Any:
        """One request with bounded retries on connection errors and 5xx/429 answers,
        all within the source's timeout."""
        delay = BACKOFF
        started = time.monotonic()
        for attempt in range(1, ATTEMPTS + 1):
            if time.monotonic() - started >= self.timeout:
                raise RegistryNoProgress(self._where(url), f"{self.timeout:g}",
                                         f"no answer to GET {urllib3.util.parse_url(url).path}")
            last = attempt == ATTEMPTS
            try:
                reply = self.pool.request(method, url, headers=headers, redirect=False,
                                          preload_content=False, decode_content=False)
            except UNREACHABLE as exc:
                if last:
                    raise RegistryUnreachable(self._where(url), _reason(exc)) from None
            except BROKEN as exc:
                if last:
                    raise RegistryUnreachable(self._where(url), _reason(exc)) from None
            except urllib3.exceptions.HTTPError as exc:
                raise RegistryError(self._where(url), _reason(exc)) from None
            else:
                if (reply.status < 500 and reply.status != 429) or last:
                    return reply
                _release(reply)
            time.sleep(min(delay, max(0.0, started + self.timeout - time.monotonic())))
            delay *= 2
        raise AssertionError("unreachable")

    def _where(self, url: str) -> str:
        """The host a request went to (the registry, its token realm, a redirect target)."""
        _, host, port = _origin(url)
        return host if port is None else f"{host}:{port}"

    def _authorize(self, challenge: Challenge) -> str:
        """The Authorization header that answers ``challenge``; remembered for later requests."""
        if challenge.scheme == "basic" and self.credentials is not None:
            authorization = self.credentials.basic()
        elif challenge.scheme == "bearer" and challenge.params.get("realm"):
            authorization = "Bearer " + self._fetch_token(challenge.params)
        else:
            raise self._auth_required()
        with self._lock:
            self._authorization = authorization
        return authorization

    def _fetch_token(self, params: dict[str, str]) -> str:
        """A Bearer token from the challenge's realm (Basic credentials sent when known)."""
        realm = params["realm"]
        if not realm.startswith("https://") and not (self.plain_http and
                                                       realm.startswith("http://")):
            raise RegistryError(self.host, "token realm is not an https:// URL")
        query = {"service": params.get("service", ""),
                 "scope": params.get("scope") or f"repository:{self.reference.repository}:pull"}
        query = {key: value for key, value in query.items() if value}
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        headers = {} if self.credentials is None else {"Authorization": self.credentials.basic()}
        reply = self._send("GET", url, headers)
        try:
            if reply.status in (401, 403):
                raise self._auth_required()
            if reply.status != 200:
                raise RegistryError(self._where(url), f"token request answered HTTP {reply.status}")
            body = _read_bounded(reply, f"token from {self._where(url)}", self._where(url),
                                 self.timeout)
        finally:
            _release(reply)
        return _token_of(body, self._where(url))

    def _auth_required(self) -> RegistryAuthRequired:
        return RegistryAuthRequired(self.host, self.reference.repository)

    def _failed(self, reply: Any, kind: str, ref: str) -> Exception:
        """The error for a final answer other than 200 to a GET of a manifest or blob."""
        code = _error_code(reply)
        _release(reply)
        what = f"{kind} {ref}"
        if reply.status == 404 and kind == "manifest":
            return RefNotFound("image", self.describe() if ref == self.reference.ref
                               else f"{ref} in {self.describe()}")
        if reply.status == 404:
            return RefNotFound(kind, f"{ref} in {self.describe()}")
        if reply.status == 403:
            return RegistryError(self.host, f"access denied to {self.reference.repository}")
        if reply.status >= 500 or reply.status == 429:
            return RegistryUnreachable(self.host, f"HTTP {reply.status} for {what}")
        detail = f" ({code})" if code else ""
        return RegistryError(self.host, f"HTTP {reply.status}{detail} for {what}")


def _release(reply: Any) -> None:
    """Give a reply's connection back: drained when little is left, else closed."""
    left = reply.length_remaining
    if left is not None and left <= DRAIN_LIMIT:
        reply.drain_conn()
    else:
        reply.close()
    reply.release_conn()


PLAIN_HTTP_HINT = ("it answers plain HTTP, not TLS: give --plain-http (plain_http=True) "
                   "for a registry served over HTTP")


def _reason(exc: Exception) -> str:
    """A short cause for a connection failure (urllib3's text names the URL: no
    secrets there); a TLS handshake that a plain HTTP server answered
    (OpenSSL's "wrong version number") names the option for such a registry."""
    reason = getattr(exc, "reason", None) or exc
    text = str(reason)
    text = text.split(": ", 1)[-1] if "object at 0x" in text else text
    if "WRONG_VERSION_NUMBER" in text:
        text += f"; {PLAIN_HTTP_HINT}"
    return text


def _read_bounded(reply: Any, what: str, host: str, timeout: float) -> bytes:
    """The body of a document (manifest, index, token answer) up to MAX_DOCUMENT
    bytes, whole within ``timeout`` seconds."""
    declared = reply.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_DOCUMENT:
        raise SourceError(what, f"larger than {MAX_DOCUMENT} bytes")
    milestone = Milestone(host, timeout, what)
    body = bytearray()
    while len(body) <= MAX_DOCUMENT:
        piece = milestone.read(reply, min(READ_PIECE, MAX_DOCUMENT + 1 - len(body)))
        if not piece:
            break
        body += piece
    if len(body) > MAX_DOCUMENT:
        raise SourceError(what, f"larger than {MAX_DOCUMENT} bytes")
    return bytes(body)


class Milestone:
    """The next point a transfer must reach within ``timeout`` seconds
    (:meth:`reached` starts the clock again). :meth:`read` reads what one
    ``recv`` gives, with the socket's timeout set to the time left."""

    def __init__(self, host: str, timeout: float, what: str) -> None:
        self.host, self.timeout, self.what = host, timeout, what
        self.reached()

    def reached(self) -> None:
        self.deadline = time.monotonic() + self.timeout

    def stalled(self, detail: str = "") -> RegistryNoProgress:
        return RegistryNoProgress(self.host, f"{self.timeout:g}", self.what + detail)

    def read(self, reply: Any, size: int, detail: Callable[[], str] = str) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            reply.close()
            raise self.stalled(detail())
        connection = reply.connection
        if connection is not None and connection.sock is not None:
            connection.sock.settimeout(left)
        try:
            data: bytes = reply.read1(size)
        except BROKEN as exc:
            reply.close()  # not drained: what is left may trickle too
            if time.monotonic() >= self.deadline:
                raise self.stalled(detail()) from None
            raise RegistryUnreachable(self.host,
                                      f"{self.what} broke off{detail()}: {_reason(exc)}"
                                      ) from None
        return data


def _media_type(content_type: str, body: bytes) -> str:
    """The media type from Content-Type, else (plain JSON) from the document's ``mediaType``."""
    media_type = content_type.split(";", 1)[0].strip()
    if media_type and media_type not in ("application/json", "text/plain"):
        return media_type
    try:
        declared = json.loads(body).get("mediaType")
    except (ValueError, AttributeError):
        return media_type
    return declared if isinstance(declared, str) else media_type


def _token_of(body: bytes, where: str) -> str:
    try:
        answer = json.loads(body)
        token = answer.get("token") or answer.get("access_token")
    except (ValueError, AttributeError):
        token = None
    if not isinstance(token, str) or not token or any(c in token for c in "\r\n"):
        raise RegistryError(where, "token answer has no token")
    return token


def _error_code(reply: Any) -> str:
    """The first error code of a registry's JSON error body, if it has one."""
    try:
        errors = json.loads(reply.read(64 << 10)).get("errors") or []
        code = errors[0].get("code", "")
    except (ValueError, AttributeError, IndexError, TypeError, *BROKEN):
        return ""
    return code if isinstance(code, str) and _ERROR_CODE.match(code) else ""


class BlobStream(io.RawIOBase):
    """A blob's body as a stream that must bring :data:`BLOB_MILESTONE` bytes
    (or its end) every ``timeout`` seconds; a broken, timed-out or stalled
    connection becomes one error."""

    def __init__(self, reply: Any, host: str, digest: str,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self.reply, self.host, self.digest = reply, host, digest
        self.seen = 0
        self.milestone = Milestone(host, timeout, f"blob {digest}")
        self.next_milestone = BLOB_MILESTONE

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.milestone.read(self.reply, len(view), self._progress)
        view[: len(data)] = data
        self.seen += len(data)
        if self.seen >= self.next_milestone:
            self.milestone.reached()
            self.next_milestone = self.seen + BLOB_MILESTONE
        return len(data)

    def _progress(self) -> str:
        return f" after {self.seen} bytes"

    def close(self) -> None:
        if not self.closed:
            _release(self.reply)
        super().close()
