"""Chooses the attention backend: the ops a model calls to fill and read the paged KV cache.

Every backend implements the same ops with the signatures and layout of
`kernels.reference` (the three cache ops, plus the fused elementwise ops of a layer,
which default to the reference), so a model holds one `AttentionBackend` and never
knows which implementation runs. Faster kernels plug in with `register_backend`.

Backends with compiled code load lazily: the Triton one (`kernels.triton_backend`)
when asked for by name or when "auto" looks for a CUDA backend, the C++ CPU one
(`kernels.cpu`) when "auto" or "cpu" runs on the CPU. If the CPU extension cannot be
built, "auto" falls back to the torch reference with a logged warning.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kernels import reference
from kernels.custom_ops import reference_paged_attention, traced

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv_to_cache: Callable
    paged_attention: Callable
    copy_blocks: Callable
    devices: tuple[str, ...]  # device types it runs on
    slow_devices: tuple[str, ...] = ()  # runs there too, but only when named ("auto" never picks it)
    graph_safe: bool = False  # sizes come from shapes alone (no host sync): a CUDA graph can capture it
    rms_norm: Callable = reference.rms_norm
    fused_add_rms_norm: Callable = reference.fused_add_rms_norm
    silu_and_mul: Callable = reference.silu_and_mul
    rope_and_cache: Callable = reference.rope_and_cache
    int8_group_linear: Callable = reference.int8_group_linear
    # paged_attention computing each query row one way whatever else the call holds, where paged_attention
    # picks a path by chunk length (`--deterministic` swaps it in); None: paged_attention already is
    row_invariant_paged_attention: Callable | None = None
    # packed Q4_1 weights (kernels.reference.q4_linear; may take out=, a float32 tensor to fill); None: not offered
    q4_linear: Callable | None = None
    # the same for 8-bit codes (kernels.reference.q8_linear); None: not offered
    q8_linear: Callable | None = None
    # q4_linear's arguments, bfloat16 x times the weights dequantized to bfloat16 (kernels.reference.q4_linear_tiles),
    # faster than q4_linear from q4_tiles_min_rows rows on; None: not offered
    q4_linear_tiles: Callable | None = None
    q4_tiles_min_rows: int = 0
    # q8_linear's on AMX tiles (kernels.reference.q8_linear_tiles), for a Q8_0 head's bfloat16 steps of many rows
    q8_linear_tiles: Callable | None = None
    # bfloat16 x @ w.T for a weight in kernels.reference.pack_tiles' layout (kernels.reference.bf16_linear_tiles;
    # may take out=, float32 or bfloat16); None: not offered
    bf16_linear_tiles: Callable | None = None
    # silu(gate) * up of a gate/up weight (the gate's rows, then the up's) in one kernel, the same bits as
    # q4_linear_tiles / bf16_linear_tiles and then silu_and_mul (kernels.reference.q4_gate_up_silu_tiles,
    # bf16_gate_up_silu_tiles); None: not offered
    q4_gate_up_silu_tiles: Callable | None = None
    bf16_gate_up_silu_tiles: Callable | None = None


_BACKENDS: dict[str, AttentionBackend] = {
    "torch": AttentionBackend(
        name="torch",
        write_kv_to_cache=reference.write_kv_to_cache,
        # a custom op while torch.compile traces: its host reads of the lengths would break the graph
        paged_attention=traced(reference.paged_attention, reference_paged_attention),
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


_cpu_tried = False


def _load_cpu(required: bool) -> None:
    global _cpu_tried
    if "cpu" in _BACKENDS or (_cpu_tried and not required):
        return
    _cpu_tried = True
    from kernels.cpu.backend import backend

    built = backend()
    if built is not None:
        register_backend(built, preferred=True)
    elif required:
        raise ValueError("attention backend 'cpu' needs the C++ extension, which failed to build (see the log)")


def get_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    device_type = str(device).split(":")[0]
    if name == "triton" or (name == "auto" and device_type == "cuda" and importlib.util.find_spec("triton")):
        _load_triton()
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        _load_cpu(required=name == "cpu")
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
