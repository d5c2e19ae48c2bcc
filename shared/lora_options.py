"""LoRA adapters' options (shared.options), taken by the gateway (the adapters given at start,
the rank limit it validates against), the scheduler (how many distinct adapters a step may
run) and the executor (its slot table and host cache). Free of torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.options import option, positive


def lora_module(text: str) -> str:
    """One --lora-modules value, checked to be NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return text


@dataclass(frozen=True)
class LoraOptions:
    """LoRA adapters (multi-LoRA serving)"""

    lora_modules: tuple[str, ...] = option((), "LoRA adapters to serve from the start, each NAME=PATH (a PEFT "
                                               "directory: adapter_config.json + adapter_model.safetensors); "
                                               "more at run time through POST /v1/load_lora_adapter",
                                           nargs="+", parse=lora_module)
    max_loras: int = option(4, "distinct LoRA adapters one step may run (the executor's slot table); a request "
                               "whose adapter finds no free slot waits, without holding others up",
                            parse=positive)
    max_lora_rank: int = option(64, "the largest rank an adapter may have (a larger one is refused with a 400)",
                                parse=positive)
    max_cpu_loras: int | None = option(None, "adapters the executor keeps loaded in host memory, least recently "
                                             "used evicted (default: 4 x --max-loras)", parse=positive)


def parse_lora_modules(specs: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """(name, path) of each NAME=PATH (the flag's parser checked the form)."""
    return [(name.strip(), path.strip()) for name, _, path in (lora_module(spec).partition("=") for spec in specs)]
