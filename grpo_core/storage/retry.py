"""Storage calls retried with backoff while the failure is one that passes; the rest said plainly.

Object stores fail for a while: HTTP 503 ``SlowDown`` or ``ServiceUnavailable`` (s3fs raises
``OSError(EBUSY)`` once botocore's own retries are spent), 500s (``EREMOTEIO``), timeouts, and refused
or dropped connections while the endpoint restarts (botocore's ``ConnectionError`` family). Those are
*transient*: ``retrying`` calls again, waiting 0.5 s, 1 s, 2 s, ... (at most 15 s) until it succeeds or
``timeout_s`` has passed since the first failure (``grpo_core.retry``'s policy, with ``is_transient`` as what
passes). Anything else (a missing file, no permission, a full
disk) is not retried, and neither is a transient failure past its time: ``StorageError`` names the
operation, the URL and the cause. ``FileNotFoundError`` passes through as it is: callers ask with it.

Every retried call must be safe to repeat: each writes a whole object (a PUT, or a local rename) or
reads or deletes one, so a repeat after a lost reply leaves the same state.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TypeVar

from grpo_core.retry import RetryPolicy

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 600.0
_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 15.0
_EREMOTEIO = getattr(errno, "EREMOTEIO", errno.EIO)
# Errnos of a remote store that is busy, erroring or unreachable (s3fs maps S3's error codes to these).
_REMOTE_TRANSIENT = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE,
                     _EREMOTEIO, errno.EIO}
# On a local (or mounted network) disk EIO is a device error and ENOSPC a full disk: neither passes.
_LOCAL_TRANSIENT = {errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR}


class StorageError(OSError):
    """A storage operation failed for good; the message says which, where, and why."""


def is_transient(err: BaseException, local: bool) -> bool:
    """Whether ``err`` may pass if the same call is made again a little later."""
    if isinstance(err, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError | FileExistsError):
        return False
    if isinstance(err, TimeoutError | ConnectionError):
        return True
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno in (_LOCAL_TRANSIENT if local else _REMOTE_TRANSIENT)
    return not local and _is_client_connection_error(err)


def _is_client_connection_error(err: BaseException) -> bool:
    """botocore's connection/timeout errors and aiohttp's client errors (only when installed)."""
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError

        if isinstance(err, BotoConnectionError | HTTPClientError):
            return True
    except ImportError:
        pass
    try:
        import aiohttp

        if isinstance(err, aiohttp.ClientError):
            return True
    except ImportError:
        pass
    return type(err).__name__ == "FSTimeoutError"  # fsspec's, raised by its sync wrapper


def retrying(what: str, url: str, call: Callable[[], T], *, local: bool, timeout_s: float = DEFAULT_TIMEOUT_S) -> T:
    """``call()``, again with backoff while it fails transiently, for up to ``timeout_s`` after the first
    failure. ``what`` and ``url`` name the operation in log lines and in the ``StorageError`` raised."""
    policy = RetryPolicy(passes=lambda err: is_transient(err, local), deadline_s=timeout_s,
                         first_s=_FIRST_DELAY_S, max_s=_MAX_DELAY_S)
    attempts = policy.attempts()

    def first_failure(err: BaseException) -> None:
        if attempts.count == 1:
            log.warning("%s %s failed (%s); retrying with backoff for up to %.0f s", what, url, _cause(err), timeout_s)

    try:
        result = attempts.call(call, before_wait=first_failure)
    except FileNotFoundError:
        raise  # callers ask with it
    except Exception as err:  # noqa: BLE001 - classified right below
        code = getattr(err, "errno", None) or errno.EIO
        if not is_transient(err, local):
            raise StorageError(code, f"{what} {url} failed: {_cause(err)}") from err
        raise StorageError(code, f"{what} {url} failed {attempts.count} times over {attempts.failing_for_s:.0f} s "
                                 f"(retried for up to {timeout_s:g} s): {_cause(err)}") from err
    if attempts.count > 1:
        log.warning("%s %s succeeded after %d attempts over %.0f s", what, url, attempts.count, attempts.failing_for_s)
    return result


def _cause(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:500]
