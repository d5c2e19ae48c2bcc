"""A LoRA adapter's weights in the executor's layout: per decoder layer, one `LoraTarget` per
fused projection (q/k/v, o, gate/up, down), the scaling folded into B, in the model's dtype
and on its device (`kernels.lora`).

`load_lora` reads PEFT's files (`shared.lora_files`), checks their digest against the one
the adapter was registered with (files changed since are refused) and their shapes against
the model; any failure is a `LoraLoadError`, which fails the rows of that adapter, never
the step or the process.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels.lora import LoraTarget
from shared.lora_files import AdapterError, BaseShapes, check_adapter, read_adapter
from shared.messages import LoraAdapter

# our fused projections and the checkpoint projections each stacks, in its output order
FUSED = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)), ("gate_up", ("gate_proj", "up_proj")),
         ("down", ("down_proj",)))


class LoraLoadError(RuntimeError):
    pass


class LayerLora(NamedTuple):
    qkv: LoraTarget | None
    o: LoraTarget | None
    gate_up: LoraTarget | None
    down: LoraTarget | None


class LoraWeights(NamedTuple):
    adapter: LoraAdapter
    rank: int
    layers: list[LayerLora]
    nbytes: int


def load_lora(adapter: LoraAdapter, base: BaseShapes, max_rank: int, dtype: torch.dtype,
              device: torch.device | str) -> LoraWeights:
    try:
        files = read_adapter(adapter.path)
        if files.digest != adapter.digest:
            raise LoraLoadError(f"LoRA adapter {adapter.name!r}: its files changed since it was loaded; "
                                f"unload and load it again")
        check_adapter(files, base, max_rank)
        from safetensors.torch import load_file

        tensors = load_file(files.weights_path(), device="cpu")
    except AdapterError as exc:
        raise LoraLoadError(f"LoRA adapter {adapter.name!r}: {exc}") from exc
    except LoraLoadError:
        raise
    except Exception as exc:  # a file truncated or rewritten under us
        raise LoraLoadError(f"LoRA adapter {adapter.name!r}: {type(exc).__name__}: {exc}") from exc
    scaling, layers, nbytes = files.scaling, [], 0
    for i in range(base.num_layers):
        targets = []
        for _, parts in FUSED:
            target = _fused_target(tensors, i, parts, base, scaling, dtype, device)
            nbytes += 0 if target is None else (target.a.numel() + target.b.numel()) * target.a.element_size()
            targets.append(target)
        layers.append(LayerLora(*targets))
    return LoraWeights(adapter, files.rank, layers, nbytes)


def _fused_target(tensors: dict[str, Tensor], layer: int, parts: tuple[str, ...], base: BaseShapes, scaling: float,
                  dtype: torch.dtype, device) -> LoraTarget | None:
    """The stacked A and block-diagonal B of one fused projection (None if no part is targeted)."""
    found = []
    for proj in parts:
        stem = f"base_model.model.model.layers.{layer}.{'self_attn' if proj in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{proj}"
        a, b = tensors.get(f"{stem}.lora_A.weight"), tensors.get(f"{stem}.lora_B.weight")
        found.append((proj, a, b))
    if all(a is None for _, a, _ in found):
        return None
    rank = sum(a.shape[0] for _, a, _ in found if a is not None)
    fan_in = base.projections[parts[0]][0]
    out_size = sum(base.projections[p][1] for p in parts)
    a_all = torch.zeros(rank, fan_in, dtype=torch.float32)
    b_all = torch.zeros(out_size, rank, dtype=torch.float32)
    r0 = o0 = 0
    blocks = []
    for proj, a, b in found:
        size = base.projections[proj][1]
        if a is not None:
            r = a.shape[0]
            a_all[r0 : r0 + r] = a.float()
            b_all[o0 : o0 + size, r0 : r0 + r] = b.float() * scaling
            blocks.append((r0, r0 + r, o0, o0 + size))
            r0 += r
        o0 += size
    return LoraTarget(a_all.to(dtype=dtype, device=device).contiguous(), b_all.to(dtype=dtype, device=device).contiguous(),
                      torch.tensor(blocks, dtype=torch.long))
