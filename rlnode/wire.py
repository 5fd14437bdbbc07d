"""Messages that cross the actor -> trainer boundary (msgspec Structs).

Owns: the wire contract. ``TrainingSample`` is born in an episode coroutine
(one per LLM call), travels to the trainer, and dies in a batch there.
Change it only by appending fields with defaults (old readers keep working).

Token ids and logprobs travel as compact little-endian arrays (int32 /
float32 bytes), not lists of Python numbers: a 1k-token sample is ~8 KB
instead of ~20 KB of MessagePack ints and floats, and decodes without
creating thousands of Python objects.
"""

from __future__ import annotations

import numpy as np
import msgspec

from rlnode.actor.router import LeaseMetadata


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_i32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


def unpack_f32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<f4")


class TrainingSample(msgspec.Struct, array_like=True, omit_defaults=True, tag="sample"):
    """One LLM call of one episode: actor (episode coroutine) -> trainer."""

    sample_id: str  # f"{episode_id}/{step_index}", unique in the run
    group_id: str  # the `attempts` episodes of one task share it
    episode_id: str
    cube_id: str
    task_id: str
    step_index: int  # 0-based LLM call index within the episode
    prompt_ids: bytes  # int32 LE: exactly the tokens the engine saw
    completion_ids: bytes  # int32 LE: exactly the tokens the engine produced
    logprobs: bytes  # float32 LE, one per completion token, under the sampling distribution
    loss_mask: bytes  # uint8, one per completion token: 1 = train on it
    reward: float  # the episode's reward (set when the episode ends)
    finish_reason: str  # engine: "stop" | "length" | "abort"
    termination_reason: str  # episode: "done" | "max_turns" | "context_limit"
    policy_version: int  # actor's policy version when the generation started
    temperature: float  # the trainer scores tokens at logits / temperature
    lease: LeaseMetadata
    # (version label, start, end) spans over completion tokens, from vLLM.
    weight_versions: list[tuple[str, int, int]] = []
    num_turns: int = 0  # LLM calls in the episode

    @property
    def prompt_token_ids(self) -> np.ndarray:
        return unpack_i32(self.prompt_ids)

    @property
    def completion_token_ids(self) -> np.ndarray:
        return unpack_i32(self.completion_ids)

    @property
    def completion_logprobs(self) -> np.ndarray:
        return unpack_f32(self.logprobs)

    @property
    def completion_mask(self) -> np.ndarray:
        return np.frombuffer(self.loss_mask, dtype=np.uint8)
