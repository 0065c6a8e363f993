"""LoRA adapters over HTTP, in vLLM's shapes. Each adapter loaded in the served model
(runtime/lora.py) is a model of its own in /v1/models, with the base as its `parent`, and a
completions or chat request picks it by its `model`. With `--allow-runtime-lora`,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter change which adapters are loaded while the
server runs.

An adapter's files are found (a hub id downloads) and read on a worker thread: disk and network
work, into the adapter's own CPU tensors, that would stall the event loop there, and every stream
on the engine thread. They go into a slot on the engine thread (EngineLoop.call), between two
steps, like every change to the model's tensors. The slots are written in place, so nothing recompiles, and an
unloaded adapter still serves the requests running with it to their end."""

import asyncio
import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from qrt.checkpoint.hub import locate_adapter
from qrt.checkpoint.lora_adapter import LoraAdapter, read_adapter
from qrt.errors import QrtError
from qrt.runtime.lora import LoraSet, NoFreeSlot, UnknownAdapter, check_name

from .api_errors import ApiError


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str  # a PEFT adapter's folder on the server's machine, or a hub id


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


def adapter_cards(model, base_name: str) -> list[dict]:
    """/v1/models' entries of the loaded adapters."""
    if model.lora is None:
        return []
    residents = list(model.lora.residents.values())  # one read: the engine thread changes the dict
    return [{"id": r.name, "object": "model", "created": int(time.time()), "owned_by": "qrt", "parent": base_name,
             "root": str(r.path), "max_model_len": model.max_seq_len} for r in sorted(residents, key=lambda r: r.name)]


def model_not_found(name: str, base_name: str, model) -> ApiError:
    adapters = model.lora_names
    served = repr(base_name) + (f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else "")
    return ApiError(404, f"the model {name!r} does not exist here; this server serves {served}", "not_found_error",
                    param="model", code="model_not_found")


def add_lora_routes(app: FastAPI, service, allowed: bool) -> None:
    """The load and unload routes; `allowed`: --allow-runtime-lora."""

    def lora_set() -> LoraSet:
        model = service.ready_model()
        if not allowed:
            raise ApiError(404, "loading and unloading LoRA adapters at runtime is off: start qrt serve with "
                                "--allow-runtime-lora", "not_found_error")
        if model.parallel.sharded:  # the other ranks would need the adapter too, at the same step
            raise ApiError(400, "loading LoRA adapters at runtime is not supported with --tp yet; give them at "
                                "start with --lora NAME=PATH")
        if model.lora is None:
            raise ApiError(400, "the model was compiled without LoRA slots (--max-loras)")
        return model.lora

    async def on_engine(fn):
        return await service.loop.call(fn, asyncio.get_running_loop())

    @app.post("/v1/load_lora_adapter")
    async def load(body: LoadLoraAdapter, request: Request):
        service.authorize(request)
        lora = lora_set()
        name = body.lora_name
        try:
            check_name(name)
        except ValueError as err:
            raise ApiError(400, str(err), param="lora_name") from None
        if name == service.model_name:
            raise ApiError(400, f"{name!r} is the base model's name; give the adapter another", param="lora_name")
        started = time.perf_counter()
        try:
            adapter = await asyncio.to_thread(lambda: read_adapter(locate_adapter(body.lora_path, progress=False)))
        except (QrtError, OSError) as err:
            raise ApiError(400, f"lora_path: {err}", param="lora_path") from None
        resident = await on_engine(lambda: _place(lora, name, adapter))
        print(f"qrt: loaded LoRA adapter {name!r} (rank {resident.rank}) from {body.lora_path} in "
              f"{(time.perf_counter() - started) * 1000:.0f} ms", file=sys.stderr, flush=True)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoraAdapter, request: Request):
        service.authorize(request)
        lora = lora_set()
        try:
            await on_engine(lambda: lora.unload(body.lora_name))
        except UnknownAdapter as err:
            raise ApiError(404, str(err), "not_found_error", param="lora_name", code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _place(lora: LoraSet, name: str, adapter: LoraAdapter):
    """Put a read adapter into a free slot (engine thread); each refusal names the field at fault."""
    if name in lora.residents:
        raise ApiError(400, f"a LoRA adapter named {name!r} is loaded already; unload it first", param="lora_name")
    try:
        return lora.add(name, adapter)
    except NoFreeSlot as err:  # no field is at fault
        raise ApiError(400, f"{err} (POST /v1/unload_lora_adapter, or start the server with a larger --max-loras)") \
            from None
    except ValueError as err:  # what the adapter holds does not fit the slots: its rank, its modules
        raise ApiError(400, f"lora_path: {err}", param="lora_path") from None
