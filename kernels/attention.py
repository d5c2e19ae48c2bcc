"""Chooses the attention backend: the ops a model calls to fill and read the paged KV cache.

Every backend implements the same three ops with the signatures and layout of
`kernels.reference`, so a model holds one `AttentionBackend` and never knows which
implementation runs. Faster kernels plug in with `register_backend`.

The Triton backend (`kernels.triton_backend`) is imported only when it is asked for
by name or "auto" looks for a CUDA backend, so the CPU path never imports triton.
"""

from __future__ import annotations

import importlib.util
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
    slow_devices: tuple[str, ...] = ()  # runs there too, but only when named ("auto" never picks it)
    graph_safe: bool = False  # sizes come from shapes alone (no host sync): a CUDA graph can capture it


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


def _load_triton() -> None:
    if "triton" in _BACKENDS:
        return
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention backend 'triton' needs the triton package (pip install 'pagedserve[triton]')")
    import kernels.triton_backend  # noqa: F401  (registers itself)


def get_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    device_type = str(device).split(":")[0]
    if name == "triton" or (name == "auto" and device_type == "cuda" and importlib.util.find_spec("triton")):
        _load_triton()
    if name == "auto":
        for candidate in _PREFERENCE:
            if device_type in _BACKENDS[candidate].devices:
                return _BACKENDS[candidate]
        raise ValueError(f"no attention backend runs on {device!r}")
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; have {available_backends()}")
    backend = _BACKENDS[name]
    if device_type not in backend.devices + backend.slow_devices:
        raise ValueError(f"attention backend {name!r} does not run on {device!r}")
    return backend
