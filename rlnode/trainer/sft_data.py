"""SFT data: chat conversations from JSONL, rendered by the chat template
into token ids and the assistant mask, and the order they are trained in
(``rlnode sft``, trainer/sft.py).

Owns: reading and checking the JSONL (every error names the file and
line), rendering a conversation in tokens the way the actor renders a
prompt (the template's text, encoded without added special tokens:
actor/episode.py), the assistant mask, ``sft.max_length`` (truncate or
drop, counted), the held-out split, and the batches of every pass (drawn
from the seed and the pass's number, so a resumed run recomputes them).
Must not touch the model, the optimizer or the run directory.

The mask. For assistant message i of conversation M with tools T:

    head_i = tokens(render(M[:i], T, add_generation_prompt=True))   ends with the assistant header
    turn_i = tokens(render(M[:i+1], T))                             ends after the turn's closing markup
    full   = tokens(render(M, T))                                   what is trained

The assistant's tokens are full[len(head_i) : len(turn_i)], cut after the
last end-of-turn token (the tokenizer's eos, ``<|im_end|>`` in ChatML)
among them: the content and the token that ends the turn, which is what an
engine samples after head_i. The template's own markup is not trained: the
header ``<|im_start|>assistant\\n`` (in head_i), the ``\\n`` ChatML writes
after ``<|im_end|>``, and every system, user and tool turn. head_i and
turn_i must be token prefixes of full, else the turn cannot be trained as
an engine would produce it: a template that rewrites earlier turns when
one is added (one that drops past reasoning, say) is refused with a
ConversationError naming the line and the message.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from rlnode.config import SftConfig
from rlnode.trainer.scoring import PackedRow


class SftDataError(ValueError):
    """A data file that cannot be trained on; the message names the file
    and, where one is to blame, the line."""


class ConversationError(SftDataError):
    """One conversation the chat template cannot render as training needs."""


@dataclass(frozen=True)
class Example:
    """One rendered conversation: ``ids`` [L] int64 token ids, ``mask`` [L]
    bool (True = an assistant token, trained), ``line`` its line in the file."""

    ids: np.ndarray
    mask: np.ndarray
    line: int

    @property
    def trained_tokens(self) -> int:
        return int(self.mask.sum())

    def row(self, first_span: int = 0) -> PackedRow:
        """The forward row of this conversation: one span per run of
        assistant tokens, (span number, start, length), numbered from
        ``first_span`` (spans of one micro-batch must be numbered apart)."""
        m = np.concatenate([[False], self.mask, [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(m))  # starts and ends of the runs, alternating
        spans = [(first_span + j, int(s), int(e - s)) for j, (s, e) in enumerate(zip(edges[::2], edges[1::2]))]
        return PackedRow(self.ids, spans)


@dataclass
class DataCounts:
    """What became of the conversations of one file (sft_data.json)."""

    conversations: int = 0  # JSON objects read
    used: int = 0  # rendered and kept
    no_assistant: int = 0  # skipped: no assistant message
    truncated: int = 0  # longer than max_length, cut to it and kept
    dropped_overlong: int = 0  # longer than max_length, dropped (overlong = "drop", or nothing trainable left)
    tokens: int = 0  # rendered tokens of the kept conversations
    trained_tokens: int = 0  # their assistant tokens


@dataclass
class SftData:
    train: list[Example]
    held_out: list[Example]
    counts: dict[str, DataCounts] = field(default_factory=dict)  # by file
    fingerprint: dict[str, Any] = field(default_factory=dict)  # what fixes the data and its order (resume checks it)


# -- reading -------------------------------------------------------------------


def read_conversations(path: str | Path) -> Iterator[tuple[int, list[dict], list[dict] | None]]:
    """(line number, messages, tools) of every non-blank line of ``path``.
    SftDataError naming ``path:line`` for a line that is not UTF-8 JSON, or
    not an object with a non-empty "messages" list of objects each with a
    string "role" (and "tools", when present, a list of objects). Other keys
    of a line, and of a message, are left to the template."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SftDataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise SftDataError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            yield lineno, *_conversation(obj, where)


def _conversation(obj: Any, where: str) -> tuple[list[dict], list[dict] | None]:
    if not isinstance(obj, dict):
        raise SftDataError(f"{where}: expected an object with \"messages\", got {type(obj).__name__}")
    messages, tools = obj.get("messages"), obj.get("tools")
    if not isinstance(messages, list) or not messages:
        raise SftDataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SftDataError(f"{where}: messages[{i}] must be an object with a string \"role\"")
        if not isinstance(m.get("content", ""), (str, list, type(None))):
            raise SftDataError(f"{where}: messages[{i}].content must be a string, a list of parts or null")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise SftDataError(f"{where}: \"tools\" must be a list of objects (OpenAI-style tool specs)")
    return messages, tools or None


# -- rendering and the mask ---------------------------------------------------


class ChatTokens:
    """The chat template in tokens: ``tokenizer``'s template, or
    ``template`` (Jinja text, model.chat_template) in its place."""

    def __init__(self, tokenizer, template: str | None = None):
        self.tok = tokenizer
        self.template = template or None
        if tokenizer.eos_token_id is None:
            raise SftDataError("the tokenizer has no eos token: the end of an assistant turn cannot be found")
        self.eos_id = int(tokenizer.eos_token_id)

    def tokens(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = False) -> list[int]:
        text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            tokenize=False, chat_template=self.template)
        return self.tok.encode(text, add_special_tokens=False)

    def render(self, messages: list[dict], tools: list[dict] | None, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids [L], assistant mask [L]) of one conversation (module
        docstring). ConversationError naming ``where`` when the template
        fails or is not prefix-stable."""
        try:
            full = self.tokens(messages, tools)
        except Exception as e:  # jinja's errors, a template raising on a role it does not know
            raise ConversationError(f"{where}: the chat template cannot render this conversation: {e}") from None
        mask = np.zeros(len(full), dtype=bool)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            try:
                head = self.tokens(messages[:i], tools, add_generation_prompt=True)
                turn = self.tokens(messages[: i + 1], tools)
            except Exception as e:
                raise ConversationError(f"{where}: the chat template cannot render messages[:{i + 1}]: {e}") from None
            for name, part in (("the prompt before it", head), ("its turn", turn)):
                if len(part) > len(full) or full[: len(part)] != part:
                    raise ConversationError(
                        f"{where}: messages[{i}] (assistant): {name} does not render as a token prefix of the "
                        "whole conversation: the chat template changes earlier text when a message is added "
                        "(e.g. drops past reasoning), so the turn cannot be trained as an engine produces it. "
                        "Use a prefix-stable template (model.chat_template)")
            if len(turn) <= len(head):
                raise ConversationError(f"{where}: messages[{i}] (assistant) renders no tokens after the prompt "
                                        "before it")
            span = turn[len(head):]
            ends = [j for j, t in enumerate(span) if t == self.eos_id]
            # Up to and with the last end-of-turn token; the markup after it
            # (ChatML's "\n") is the template's. No eos: the whole span.
            mask[len(head): len(head) + (ends[-1] + 1 if ends else len(span))] = True
        return np.asarray(full, dtype=np.int64), mask


def load_file(path: str | Path, chat: ChatTokens, s: SftConfig) -> tuple[list[Example], DataCounts]:
    """Every usable conversation of ``path``, rendered, cut to
    ``s.max_length`` by ``s.overlong``, and what became of the others."""
    counts, out = DataCounts(), []
    for line, messages, tools in read_conversations(path):
        counts.conversations += 1
        if not any(m["role"] == "assistant" for m in messages):
            counts.no_assistant += 1
            continue
        ids, mask = chat.render(messages, tools, f"{path}:{line}")
        mask[0] = False  # nothing predicts the first token
        if len(ids) > s.max_length:
            if s.overlong == "drop" or not mask[: s.max_length].any():
                counts.dropped_overlong += 1
                continue
            ids, mask = ids[: s.max_length], mask[: s.max_length]
            counts.truncated += 1
        if not mask.any():
            counts.no_assistant += 1
            continue
        out.append(Example(ids, mask, line))
        counts.used += 1
        counts.tokens += len(ids)
        counts.trained_tokens += int(mask.sum())
    return out, counts


# Independent random streams drawn from run.seed.
_SPLIT_STREAM, _ORDER_STREAM = 1, 2


def load_sft_data(s: SftConfig, seed: int, chat: ChatTokens) -> SftData:
    """The training and held-out conversations of ``s`` (sft.data, and
    sft.eval_data or an sft.eval_fraction of sft.data drawn from ``seed``).
    SftDataError when no training conversation is left."""
    train, counts = load_file(s.data, chat, s)
    by_file = {s.data: counts}
    held_out: list[Example] = []
    if s.eval_data:
        held_out, by_file[s.eval_data] = load_file(s.eval_data, chat, s)
    elif s.eval_fraction > 0 and len(train) > 1:
        n = min(len(train) - 1, max(1, round(s.eval_fraction * len(train))))
        pick = set(np.random.default_rng([seed, _SPLIT_STREAM]).permutation(len(train))[:n].tolist())
        held_out = [e for i, e in enumerate(train) if i in pick]
        train = [e for i, e in enumerate(train) if i not in pick]
    if not train:
        raise SftDataError(f"{s.data}: no conversation to train on ({counts.conversations} read, "
                           f"{counts.no_assistant} without an assistant turn, {counts.dropped_overlong} over "
                           f"sft.max_length = {s.max_length})")
    fingerprint = {
        "data_sha256": _sha256(s.data), "eval_data_sha256": _sha256(s.eval_data) if s.eval_data else "",
        "template_sha256": hashlib.sha256((chat.template or chat.tok.chat_template or "").encode()).hexdigest(),
        "seed": seed, "eval_fraction": s.eval_fraction, "batch_size": s.batch_size, "batch_tokens": s.batch_tokens,
        "max_length": s.max_length, "overlong": s.overlong, "shuffle": s.shuffle,
    }
    return SftData(train, held_out, by_file, fingerprint)


def _sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- the order of training ----------------------------------------------------


class BatchOrder:
    """Which conversations each optimizer step trains on: pass p visits the
    training set in a permutation drawn from (seed, p) (file order without
    shuffle), cut into steps of ``batch_size`` conversations, or of at most
    ``batch_tokens`` rendered tokens. A pure function of the step number,
    so a resumed run trains exactly what an uninterrupted one would."""

    def __init__(self, lengths: list[int], s: SftConfig, seed: int):
        self.lengths, self.s, self.seed = lengths, s, seed
        self._cached: tuple[int, list[list[int]]] | None = None
        self._steps: dict[int, int] = {}  # pass -> its number of steps

    def steps_in_pass(self, p: int) -> int:
        if p not in self._steps:
            self._steps[p] = (-(-len(self.lengths) // self.s.batch_size) if self.s.batch_tokens == 0
                              else len(self.pass_batches(p)))
        return self._steps[p]

    def pass_batches(self, p: int) -> list[list[int]]:
        """Pass ``p``'s steps, each a list of conversation indices."""
        if self._cached is not None and self._cached[0] == p:
            return self._cached[1]
        n = len(self.lengths)
        order = (np.random.default_rng([self.seed, _ORDER_STREAM, p]).permutation(n) if self.s.shuffle
                 else np.arange(n)).tolist()
        if self.s.batch_tokens == 0:
            batches = [order[i: i + self.s.batch_size] for i in range(0, n, self.s.batch_size)]
        else:
            batches, size = [], math.inf
            for i in order:
                if size + self.lengths[i] > self.s.batch_tokens:
                    batches.append([])
                    size = 0
                batches[-1].append(i)
                size += self.lengths[i]
        self._cached = (p, batches)
        return batches

    def total_steps(self) -> int:
        """sft.max_steps, else the steps of sft.epochs passes."""
        if self.s.max_steps:
            return self.s.max_steps
        return sum(self.steps_in_pass(p) for p in range(self.s.epochs))

    def batch(self, step: int) -> tuple[int, list[int]]:
        """(pass, conversation indices) of optimizer step ``step`` (0-based)."""
        p = 0
        while step >= (k := self.steps_in_pass(p)):
            step -= k
            p += 1
        return p, self.pass_batches(p)[step]
