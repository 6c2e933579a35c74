"""What an S3 error reply means, for both ways layerfs talks to S3 (boto3
calls in :mod:`.s3` and presigned ranged GETs in :mod:`.s3ranges`): one map
from the reply's error code and HTTP status to a kind of failure, so the same
reply is the same :mod:`layerfs.errors` class whichever path met it."""

from __future__ import annotations

import enum

NOT_FOUND = {"NoSuchKey", "NotFound", "404"}
NO_BUCKET = "NoSuchBucket"
DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch",
          "AllAccessDisabled", "ExpiredToken", "InvalidToken", "AccountProblem"}  # fmt: skip
TRANSIENT = {"SlowDown", "RequestTimeout", "Throttling", "ThrottlingException",
             "RequestThrottled", "TooManyRequests", "InternalError", "ServiceUnavailable",
             "ConditionalRequestConflict", "OperationAborted"}  # fmt: skip


class S3Failure(enum.Enum):
    MISSING_OBJECT = "missing object"
    MISSING_BUCKET = "missing bucket"
    DENIED = "denied"  # AccessDenied
    TRANSIENT = "transient"  # TransientStoreError: worth retrying
    OTHER = "other"  # StoreError


def classify(code: str, status: int) -> S3Failure:
    """The kind of failure an S3 error reply (its ``Code`` and HTTP status) is."""
    if code == NO_BUCKET:
        return S3Failure.MISSING_BUCKET
    if code in NOT_FOUND or status == 404:
        return S3Failure.MISSING_OBJECT
    if code in DENIED or status == 403:
        return S3Failure.DENIED
    if code in TRANSIENT or status >= 500 or status == 429:
        return S3Failure.TRANSIENT
    return S3Failure.OTHER
