"""vLLM's runtime LoRA routes, behind the API key like every /v1 route:

- POST /v1/load_lora_adapter {"lora_name", "lora_path"} -> 200 text on success; 400 (OpenAI
  error body) when the name is taken or the files do not fit the base model, 404 when the
  path does not exist;
- POST /v1/unload_lora_adapter {"lora_name"} -> 200 text; 404 for a name not loaded.

The files are read and checked off the event loop (`LoraRegistry.load`).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.gateway.lora_registry import LoraRegistry
from services.gateway.openai.errors import ApiError
from services.gateway.openai.request import parse_json
from shared.lora_files import AdapterError


class LoraRoutes:
    def __init__(self, registry: LoraRegistry, reserved_names: set[str], read_body, error_response):
        self.registry, self.reserved = registry, reserved_names
        self._read_body, self._error = read_body, error_response

    def routes(self) -> list:
        return [web.post("/v1/load_lora_adapter", self.load), web.post("/v1/unload_lora_adapter", self.unload)]

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = parse_json(await self._read_body(request))
            name, path = _string(body, "lora_name"), _string(body, "lora_path")
            await asyncio.to_thread(self.registry.load, name, path, self.reserved)
        except ApiError as exc:
            return self._error(exc)
        except AdapterError as exc:
            return self._error(ApiError(str(exc), exc.status, "lora_path",
                                        "NotFoundError" if exc.status == 404 else "BadRequestError"))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        try:
            body = parse_json(await self._read_body(request))
            name = _string(body, "lora_name")
            self.registry.unload(name)
        except ApiError as exc:
            return self._error(exc)
        except AdapterError as exc:
            return self._error(ApiError(str(exc), exc.status, "lora_name", "NotFoundError"))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _string(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ApiError(f"'{name}' must be a non-empty string.", param=name)
    return value.strip()
