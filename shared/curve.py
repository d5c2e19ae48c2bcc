"""CURVE keys for the internal sockets: where they come from and when they are required.

One key pair per deployment, made by `pagedserve keygen DIR` (DIR/pagedserve.key holds the
public key, DIR/pagedserve.key_secret both; give every stage the latter). Every binding
socket is a CURVE server with it, every connecting socket a CURVE client with it, and a
binder's ZAP handler lets in only clients that prove they hold that same secret key
(`shared.transport`): a peer without it can neither connect nor read nor inject.

A stage takes its key from --curve-key-file, else $PAGEDSERVE_CURVE_KEY_FILE, else
$PAGEDSERVE_CURVE_SECRET_KEY (the Z85 secret key; its public key is derived). Keys are
required, and a stage refuses to start without them, when any of its addresses is
tcp:// on something other than a loopback host; on loopback and ipc:// they are optional
(used when given).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

KEY_FILE_ENV = "PAGEDSERVE_CURVE_KEY_FILE"
SECRET_KEY_ENV = "PAGEDSERVE_CURVE_SECRET_KEY"
KEY_NAME = "pagedserve"
LOOPBACK_HOSTS = ("localhost", "lo", "[::1]", "::1")


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
    """Write a new key pair into directory; (public file, secret file)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, KEY_NAME)
    os.chmod(secret, 0o600)
    return public, secret


def add_curve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--curve-key-file", default=None,
        help=f"CURVE secret key file from `pagedserve keygen` (or ${KEY_FILE_ENV}, or ${SECRET_KEY_ENV}); "
             "required when an internal address is tcp:// and not loopback",
    )


def is_exposed(address: str | None) -> bool:
    """True for a tcp:// address that others on the network could reach."""
    if not address or not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0]
    if ";" in host:  # source;destination form: the destination decides
        host = host.split(";", 1)[1]
    return not (host.startswith("127.") or host in LOOPBACK_HOSTS)


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
