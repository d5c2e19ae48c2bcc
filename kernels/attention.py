"""Chooses the attention backend: the ops a model calls to fill and read the paged KV cache.

Every backend implements the same three ops with the signatures and layout of
`kernels.reference`, so a model holds one `AttentionBackend` and never knows which
implementation runs. Faster kernels plug in with `register_backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels import reference


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv_to_cache: Callable
    paged_attention: Callable
    copy_blocks: Callable
    devices: tuple[str, ...]  # device types it runs on


_BACKENDS: dict[str, AttentionBackend] = {
    "torch": AttentionBackend(
        name="torch",
        write_kv_to_cache=reference.write_kv_to_cache,
        paged_attention=reference.paged_attention,
        copy_blocks=reference.copy_blocks,
        devices=("cpu", "cuda", "mps", "xpu"),
    ),
}
# "auto" tries these in order and takes the first that runs on the device
_PREFERENCE: list[str] = ["torch"]


def register_backend(backend: AttentionBackend, *, preferred: bool = False) -> None:
    _BACKENDS[backend.name] = backend
    if backend.name not in _PREFERENCE:
        _PREFERENCE.insert(0 if preferred else len(_PREFERENCE), backend.name)


def available_backends() -> list[str]:
    return list(_BACKENDS)


def get_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    device_type = device.split(":")[0]
    if name == "auto":
        for candidate in _PREFERENCE:
            if device_type in _BACKENDS[candidate].devices:
                return _BACKENDS[candidate]
        raise ValueError(f"no attention backend runs on {device!r}")
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; have {available_backends()}")
    backend = _BACKENDS[name]
    if device_type not in backend.devices:
        raise ValueError(f"attention backend {name!r} does not run on {device!r}")
    return backend
