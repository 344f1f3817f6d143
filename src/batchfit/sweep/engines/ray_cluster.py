"""Joining a Ray cluster for the sweep's Ray engine: ``connect`` (a local cluster started, or an existing one
joined), after ``check_reachable`` has refused, in one line and within ``CONNECT_TIMEOUT_S``, an address where
no cluster answers (``ray.init`` alone would retry for minutes)."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

from batchfit.errors import InputError
from batchfit.sweep.engines.options import available_cores

try:
    import ray
    import ray.exceptions
except ImportError:  # the extra is missing: make_engine names it before this module is used
    pass

CONNECT_TIMEOUT_S = 3.0  # the longest an address is tried before it is refused
CLIENT_PREFIX = "ray://"
CLIENT_PORT = 10001  # Ray Client's default port on the head node
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours Ray puts in its errors


def connect(address: str | None) -> bool:
    """Connect this process to the cluster at ``address`` (``None``: start a local one); ``True`` when this
    call did ``ray.init``. An address nothing answers on is one ``InputError`` line."""
    if address is not None:
        check_reachable(address)
    if ray.is_initialized():
        return False
    try:
        if address is None:
            ray.init(address="local", num_cpus=available_cores(), include_dashboard=False, **QUIET)
        else:
            ray.init(address=address, **QUIET)
    except (ConnectionError, ValueError, RuntimeError) as error:
        where = "start a local Ray cluster" if address is None else f"connect to the Ray cluster at {address}"
        raise InputError(f"cannot {where}: {first_line(error)}") from None
    return True


QUIET = {"log_to_driver": False, "logging_level": logging.WARNING}  # the workers' output stays in Ray's logs


def check_reachable(address: str) -> None:
    """An ``InputError`` (one line) unless the cluster at ``address`` answers within ``CONNECT_TIMEOUT_S``:
    a TCP connection first (a refused or silent address), then, for a head node's address, Ray's own GCS
    client (something else listening there). ``ray.init`` alone would retry for minutes."""
    deadline_s = time.monotonic() + CONNECT_TIMEOUT_S
    host_port = bootstrap_address(address)
    if host_port is None or not accepts_tcp(host_port, deadline_s):
        raise InputError(
            f"cannot reach the Ray cluster at {address}: start it with `ray start --head` or drop --ray-address"
        )
    if address.startswith(CLIENT_PREFIX):
        return
    answer = gcs_answer(host_port, deadline_s)
    if answer == "unauthenticated":
        raise InputError(
            f"the Ray cluster at {address} wants its token: set RAY_AUTH_MODE=token here, with the cluster's "
            "token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN"
        )
    if answer != "ok":
        raise InputError(
            f"no Ray cluster answers at {address} (something else listens on {host_port}): "
            "give the head node's address, as `ray start --head` prints it"
        )


def bootstrap_address(address: str) -> str | None:
    """``host:port`` to try for ``address``: Ray Client's port for ``ray://host``, else the address as
    ``ray.init`` resolves it (``auto``: ``RAY_ADDRESS``, then the last ``ray start``; ``localhost``: this
    node's address); ``None``: no cluster found."""
    if address.startswith(CLIENT_PREFIX):
        rest = address[len(CLIENT_PREFIX) :].split("/")[0]
        return rest if ":" in rest.rpartition("]")[2] else f"{rest}:{CLIENT_PORT}"
    from ray._private.services import canonicalize_bootstrap_address  # private: what ray.init itself calls

    try:
        return canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError):
        return None


def accepts_tcp(host_port: str, deadline_s: float) -> bool:
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=max(deadline_s - time.monotonic(), 0.1)):
            return True
    except (OSError, ValueError):
        return False


def gcs_answer(host_port: str, deadline_s: float) -> str:
    """How a Ray head's GCS at ``host_port`` answers by ``deadline_s``: ``ok``, ``unauthenticated`` (token
    authentication is on and this process has no token), ``error`` or ``silent``. Ray's GCS client waits
    up to 40 s on an address that accepts and says nothing, so it runs in a daemon thread given up on."""
    try:
        from ray._raylet import GcsClient  # private: the client ray.init connects with
    except ImportError:  # another Ray: the TCP check has to do
        return "ok"
    answers: list[str] = []

    def ask() -> None:
        try:
            GcsClient(address=host_port)
            answers.append("ok")
        except Exception as error:  # any error: no usable GCS there
            refused = isinstance(error, getattr(ray.exceptions, "AuthenticationError", ()))
            answers.append("unauthenticated" if refused else "error")

    thread = threading.Thread(target=ask, name="batchfit-ray-probe", daemon=True)
    thread.start()
    thread.join(max(deadline_s - time.monotonic(), 0.1))
    return answers[0] if answers else "silent"


def first_line(error: BaseException, last: bool = False) -> str:
    """The first (or ``last``) line of what ``error`` says, without Ray's colours; its class when empty."""
    lines = [line.strip() for line in ANSI.sub("", str(error)).splitlines() if line.strip()]
    return (lines[-1] if last else lines[0]) if lines else type(error).__name__
