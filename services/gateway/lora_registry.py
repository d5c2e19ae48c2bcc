"""The gateway's LoRA adapters: name -> `LoraAdapter` (its PEFT directory and the digest of its
files), the one place a request's `model` is resolved to an adapter, for every route that
generates or pools (completions, chat, Anthropic's messages, responses, embeddings).

An adapter is registered (from --lora-modules at start, or POST /v1/load_lora_adapter) only
after its files were read and held to the base model (`shared.lora_files`: the rank limit,
every tensor's shape, base_model_name_or_path), so a bad adapter is a 400 naming what is
wrong, never a stage's failure. Requests carry the registered `LoraAdapter` in their
sampling parameters; the scheduler assigns it an executor slot, the executor loads it from
the path and refuses files whose digest changed since. Unloading stops new requests from
naming it; those in flight finish under it.
"""

from __future__ import annotations

import dataclasses
import logging

import msgspec

from services.gateway.openai.request import ParsedRequest
from shared.lora_files import AdapterError, BaseShapes, check_adapter, read_adapter
from shared.messages import LoraAdapter

log = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(self, base: BaseShapes | None, max_rank: int, base_model_name: str):
        self.base, self.max_rank, self.base_model_name = base, max_rank, base_model_name
        self.adapters: dict[str, LoraAdapter] = {}

    def get(self, name: object) -> LoraAdapter | None:
        return self.adapters.get(name) if isinstance(name, str) else None

    def names(self, base_names: set[str]) -> set[str]:
        """The names a request's `model` may take (any other is the route's 404): the base model's
        and every adapter's."""
        return base_names | set(self.adapters)

    def under(self, model: object, parsed: ParsedRequest) -> ParsedRequest:
        """parsed, run under the adapter `model` names (as it is for a base model name)."""
        lora = self.get(model)
        if lora is None:
            return parsed
        return dataclasses.replace(parsed, params=msgspec.structs.replace(parsed.params, lora=lora))

    def load(self, name: str, path: str, reserved: set[str] = frozenset()) -> LoraAdapter:
        """Register an adapter (AdapterError: 400 when the name is taken or the files do not fit
        the base model, 404 when the directory does not exist)."""
        if name in self.adapters:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        if name in reserved:
            raise AdapterError(f"'{name}' is the base model's name; give the adapter another.")
        if self.base is None:
            raise AdapterError("this server's model config could not be read: LoRA adapters cannot be checked")
        files = read_adapter(path)
        check_adapter(files, self.base, self.max_rank)
        adapter = self.adapters[name] = LoraAdapter(name, str(files.path.resolve()), files.digest)
        log.info("LoRA adapter %s loaded from %s (rank %d, %d tensors)", name, path, files.rank, len(files.tensors))
        return adapter

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.", 404)
        log.info("LoRA adapter %s unloaded", name)

    def load_modules(self, modules: list[tuple[str, str]], reserved: set[str]) -> None:
        """--lora-modules: each is registered, or logged and skipped (a bad file does not stop the gateway)."""
        for name, path in modules:
            try:
                self.load(name, path, reserved)
            except AdapterError as exc:
                log.error("--lora-modules %s=%s skipped: %s", name, path, exc)
