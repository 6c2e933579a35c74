"""What an S3 error reply means, for both ways layerfs talks to S3 (boto3
calls in :mod:`.s3` and presigned GETs in :mod:`.s3ranges`): one map
from the reply's error code and HTTP status to a kind of failure, so the same
reply is the same :mod:`layerfs.errors` class whichever path met it.

A reply is: the object missing (404), access denied (403), the object
unavailable (5xx, throttling: the store answers but cannot serve it, as when a
volume server is lost; retried, then :class:`~layerfs.errors.ObjectUnavailable`)
or another error. A store that does not answer at all is not a reply: the
callers map connection failures and timeouts to ``StoreUnreachable``."""

from __future__ import annotations

import enum

from ..errors import AccessDenied, ObjectUnavailable, StoreError

NOT_FOUND = {"NoSuchKey", "NotFound", "404"}
NO_BUCKET = "NoSuchBucket"
DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch",
          "AllAccessDisabled", "ExpiredToken", "InvalidToken", "AccountProblem"}  # fmt: skip
UNAVAILABLE = {"SlowDown", "RequestTimeout", "Throttling", "ThrottlingException",
             "RequestThrottled", "TooManyRequests", "InternalError", "ServiceUnavailable",
             "ConditionalRequestConflict", "OperationAborted"}  # fmt: skip


class S3Failure(enum.Enum):
    MISSING_OBJECT = "missing object"
    MISSING_BUCKET = "missing bucket"
    DENIED = "denied"  # AccessDenied
    UNAVAILABLE = "unavailable"  # ObjectUnavailable: worth retrying
    OTHER = "other"  # StoreError


def classify(code: str, status: int) -> S3Failure:
    """The kind of failure an S3 error reply (its ``Code`` and HTTP status) is."""
    if code == NO_BUCKET:
        return S3Failure.MISSING_BUCKET
    if code in NOT_FOUND or status == 404:
        return S3Failure.MISSING_OBJECT
    if code in DENIED or status == 403:
        return S3Failure.DENIED
    if code in UNAVAILABLE or status >= 500 or status == 429:
        return S3Failure.UNAVAILABLE
    return S3Failure.OTHER


def error_class(failure: S3Failure) -> type[StoreError]:
    """The error a reply of this kind (other than a missing object or bucket) raises."""
    if failure is S3Failure.DENIED:
        return AccessDenied
    if failure is S3Failure.UNAVAILABLE:
        return ObjectUnavailable
    return StoreError
