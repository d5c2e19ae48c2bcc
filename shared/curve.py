"""CURVE keys for the internal sockets: where they come from and when they are required.

One key pair per deployment, made by `pagedserve keygen DIR` (DIR/pagedserve.key holds the
public key, DIR/pagedserve.key_secret both; give every stage the latter). Every binding
socket is a CURVE server with it, every connecting socket a CURVE client with it, and a
binder's ZAP handler lets in only clients that prove they hold that same secret key
(`shared.transport`): a peer without it can neither connect nor read nor inject.

A stage takes its key from --curve-key-file, else $PAGEDSERVE_CURVE_KEY_FILE, else
$PAGEDSERVE_CURVE_SECRET_KEY (the Z85 secret key; its public key is derived). Keys are
required, and a stage refuses to start without them, when any of its addresses could be
reached from the network (`is_exposed`: every endpoint of an address list is parsed, its
host resolved, and each resolved address must be loopback; ipc:// and inproc:// are local,
anything unparsable or unresolvable counts as exposed). On loopback and ipc:// keys are
optional (used when given).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
from dataclasses import dataclass

import zmq
import zmq.auth

KEY_FILE_ENV = "PAGEDSERVE_CURVE_KEY_FILE"
SECRET_KEY_ENV = "PAGEDSERVE_CURVE_SECRET_KEY"
KEY_NAME = "pagedserve"


class CurveKeyError(SystemExit):
    """A key that cannot be read, or none where one is required: the stage does not start."""


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # Z85, 40 bytes
    secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> CurveKeys:
        secret = secret.strip()
        try:
            return cls(zmq.curve_public(secret), secret)
        except (zmq.ZMQError, ValueError) as exc:
            raise CurveKeyError(f"${SECRET_KEY_ENV} is not a Z85 CURVE secret key (40 characters): {exc}") from None

    @classmethod
    def from_file(cls, path: str) -> CurveKeys:
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise CurveKeyError(f"cannot read the CURVE key file {path}: {exc}") from None
        if secret is None:
            raise CurveKeyError(f"{path} holds only a public key: give the .key_secret file `pagedserve keygen` wrote")
        return cls(public, secret)


def keygen(directory: str) -> tuple[str, str]:
    """Write a new key pair into directory; (public file, secret file).

    The secret file is created 0600 (a new directory 0700) by the open call itself, so there
    is no moment when another user could read it; existing key files are never overwritten
    (the running deployment's key stays as it is)."""
    base = os.path.join(directory, KEY_NAME)
    for path in (f"{base}.key", f"{base}.key_secret"):
        if os.path.lexists(path):
            raise CurveKeyError(f"{path} exists: keygen never overwrites a key (remove it first)")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.curve_keypair()
    body = f'curve\n    public-key = "{public.decode()}"\n'
    _create(f"{base}.key", "#   pagedserve CURVE public key\n" + body, 0o644)
    _create(f"{base}.key_secret", "#   pagedserve CURVE SECRET key: keep it private\n"
            + body + f'    secret-key = "{secret.decode()}"\n', 0o600)
    return f"{base}.key", f"{base}.key_secret"


def _create(path: str, text: str, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise CurveKeyError(f"{path} exists: keygen never overwrites a key (remove it first)") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def add_curve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--curve-key-file", default=None,
        help=f"CURVE secret key file from `pagedserve keygen` (or ${KEY_FILE_ENV}, or ${SECRET_KEY_ENV}); "
             "required when an internal address is tcp:// and not loopback",
    )


LOCAL_TRANSPORTS = ("ipc", "inproc")  # never leave the host


def is_exposed(address: str | None) -> bool:
    """True when any endpoint of address (one, or a comma-separated list) could be reached
    from the network: a tcp:// host that does not resolve to loopback addresses only, the
    wildcard, or a transport other than ipc:// and inproc://. Unparsable or unresolvable
    endpoints count as exposed: keys are required where we cannot prove the socket local."""
    if not address:
        return False
    return any(_endpoint_exposed(endpoint.strip()) for endpoint in address.split(","))


def _endpoint_exposed(endpoint: str) -> bool:
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return True
    if scheme in LOCAL_TRANSPORTS:
        return False
    if scheme != "tcp":
        return True
    host = rest.rsplit(";", 1)[-1]  # source;destination form: the destination decides
    host, sep, port = host.rpartition(":")
    if not sep or not host:
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return not _resolves_to_loopback_only(host)


def _resolves_to_loopback_only(host: str) -> bool:
    if host == "*" or not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = []
    for info in infos:
        try:
            addresses.append(ipaddress.ip_address(info[4][0].split("%", 1)[0]))
        except ValueError:
            return False
    return bool(addresses) and all(_is_loopback(a) for a in addresses)


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return (mapped or address).is_loopback


def load_keys(key_file: str | None, addresses: list[str | None]) -> CurveKeys | None:
    """The keys this stage uses (None: plain sockets); exits with a clear message when
    they are required and missing or unreadable."""
    key_file = key_file or os.environ.get(KEY_FILE_ENV)
    if key_file:
        return CurveKeys.from_file(key_file)
    secret = os.environ.get(SECRET_KEY_ENV)
    if secret:
        return CurveKeys.from_secret(secret.encode())
    exposed = [a for a in addresses if is_exposed(a)]
    if exposed:
        raise CurveKeyError(
            f"refusing to start: {', '.join(exposed)} can be reached from the network and no CURVE key was given. "
            f"Run `pagedserve keygen DIR` and pass --curve-key-file DIR/{KEY_NAME}.key_secret (or set "
            f"${KEY_FILE_ENV}) to every stage, or use loopback or ipc:// addresses."
        )
    return None


def stage_keys(args: argparse.Namespace, addresses) -> CurveKeys | None:
    """load_keys for a stage's options and its `shared.config.Addresses`."""
    return load_keys(getattr(args, "curve_key_file", None), list(vars(addresses).values()))
