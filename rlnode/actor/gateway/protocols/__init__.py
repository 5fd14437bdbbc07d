"""The APIs the gateway speaks, each a ``Protocol`` over one internal
request and reply (``base.py``: ``Call``, ``Answer``): OpenAI Chat
Completions, OpenAI Completions, OpenAI Responses, Anthropic Messages.
A new API is one module here and one line in ``PROTOCOLS``."""

from rlnode.actor.gateway.protocols.base import Answer, Call, Protocol, StreamWriter
from rlnode.actor.gateway.protocols.chat import Chat, ChatRequest
from rlnode.actor.gateway.protocols.completions import Completions
from rlnode.actor.gateway.protocols.messages import Messages
from rlnode.actor.gateway.protocols.responses import Responses

PROTOCOLS: tuple[Protocol, ...] = (Chat(), Completions(), Responses(), Messages())
BY_NAME = {p.name: p for p in PROTOCOLS}

__all__ = ["Answer", "BY_NAME", "Call", "Chat", "ChatRequest", "Completions", "Messages", "PROTOCOLS", "Protocol",
           "Responses", "StreamWriter"]
