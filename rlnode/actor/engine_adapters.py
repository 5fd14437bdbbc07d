"""The LoRA adapters one engine serves (``trainer.lora``): each policy
version is a vLLM adapter of its own, so an update needs no pause.

A new version is loaded beside the old one (``AsyncLLM.add_lora``) and new
requests name it (``LoRARequest``); requests in flight keep the adapter they
started with, so every token of a request comes from one version, exact by
construction. An old adapter is removed from the engine, and its files
deleted, once no request uses it. vLLM's own bound (``max_loras``, the
adapters one batch mixes) holds a request of a newer version back while
older ones fill the slots, never an old one.

Owns: which adapter is current, how many requests each one runs, and when
an old one goes. Must not touch: the weight group (weight_receiver writes
the files: rlnode.weights.worker), the scheduler.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlnode.log import get_logger

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

log = get_logger("rlnode.engine")


@dataclass
class ServedAdapter:
    """One version's adapter on the engine."""

    label: str  # the weights_label of its version: what its tokens are tagged with
    request: LoRARequest
    in_flight: int = 0


class AdapterSlots:
    """The adapters of one engine: ``current`` (what new requests get) and
    the older ones that still run requests."""

    def __init__(self, directory: str):
        self.directory = directory  # under the engine's scratch directory: removed with it
        self.current: ServedAdapter | None = None
        self.retiring: dict[int, ServedAdapter] = {}  # adapter id -> one with requests left
        self._next_id = 1  # vLLM's adapter ids start at 1
        self._removals: set[asyncio.Task] = set()
        self.loaded_max = 0  # most adapters loaded at once (current + retiring), for the benchmark
        self.removed = 0

    def next_path(self) -> tuple[int, str]:
        """(id, directory) for the next adapter's files."""
        return self._next_id, os.path.join(self.directory, f"adapter-{self._next_id}")

    async def serve(self, llm: AsyncLLM, label: str, path: str) -> None:
        """Load the adapter in ``path`` (peft's files) as version ``label``
        and make it current: new requests use it from the moment this
        returns; requests in flight finish on theirs."""
        from vllm.lora.request import LoRARequest

        adapter_id, expected = self.next_path()
        if os.path.abspath(path) != os.path.abspath(expected):
            raise ValueError(f"adapter files at {path!r}, expected {expected!r} (next_path)")
        if self.current is not None and self.current.label == label:
            # The version it serves, pushed again (the trainer brings every
            # member of a new epoch to its version): nothing new to serve.
            await asyncio.to_thread(shutil.rmtree, path, True)
            return
        self._next_id += 1
        request = LoRARequest(label, adapter_id, path)
        await llm.add_lora(request)
        old, self.current = self.current, ServedAdapter(label, request)
        if old is not None:
            self.retiring[old.request.lora_int_id] = old
            self._retire_idle(llm)
        self.loaded_max = max(self.loaded_max, 1 + len(self.retiring))

    def acquire(self) -> ServedAdapter | None:
        """The adapter a new request runs on (None: the base model, before
        the first update), counted until ``release``."""
        adapter = self.current
        if adapter is not None:
            adapter.in_flight += 1
        return adapter

    def release(self, llm: AsyncLLM, adapter: ServedAdapter | None) -> None:
        if adapter is None:
            return
        adapter.in_flight -= 1
        if adapter is not self.current and adapter.in_flight == 0:
            self._retire_idle(llm)

    def _retire_idle(self, llm: AsyncLLM) -> None:
        for adapter_id in [i for i, a in self.retiring.items() if a.in_flight == 0]:
            adapter = self.retiring.pop(adapter_id)
            task = asyncio.ensure_future(self._remove(llm, adapter))
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)

    async def _remove(self, llm: AsyncLLM, adapter: ServedAdapter) -> None:
        try:
            await llm.remove_lora(adapter.request.lora_int_id)
        except Exception as e:  # noqa: BLE001 - an engine shutting down; its scratch goes with it
            log.warning("engine.adapter_remove_failed", adapter=adapter.label, error=repr(e))
        await asyncio.to_thread(shutil.rmtree, adapter.request.lora_path, True)
        self.removed += 1

    async def drain(self) -> None:
        """Wait for the removals under way (shutdown, tests)."""
        while self._removals:
            await asyncio.gather(*list(self._removals), return_exceptions=True)
