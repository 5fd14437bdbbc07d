"""The gateway: agents rlnode does not run itself.

An agent written against the OpenAI API (the ``openai`` SDK on Chat
Completions or Responses, the Agents SDK, a verifiers environment,
LangChain, a shell script with curl) or Anthropic's (the ``anthropic`` SDK)
gets, per episode, a base URL ``http://HOST:PORT/episodes/{token}/v1`` and
an API key. Each ``POST .../chat/completions``, ``.../responses``,
``.../messages`` or ``.../completions`` is one LLM call of that episode
(``protocols/``: one module per API over one internal call and reply): it
takes one AdmissionRouter lease and one Engine request, like a native turn,
and becomes one ``TrainingSample`` when the episode ends.

Token parity. The engine sees token ids, never re-tokenised text. When the
agent re-sends the conversation (as chat agents do), the gateway compares it
with what it has served: if the earlier messages are exactly the ones it saw
plus the assistant messages it returned, the new prompt is the previous
prompt + the tokens the engine produced + the template tokens of the new
messages only (``ChatRenderer.next_messages``), so prompt k+1 extends prompt
k + completion k token for token. If the agent edited its history (dropped a
turn, rewrote a message, changed its tools) the conversation is rendered
afresh and the reset is counted (``history_resets``): that sample is still
exact for what the engine saw, but it no longer extends the previous one.

The token is unguessable (``secrets``), lives only while its episode runs,
and the API key travels in the Authorization header (paths end up in access
logs; headers do not). Unknown or finished episodes get 404, a wrong key
401, bad requests 400, each in its API's error shape.

The environment side (``/episodes/{token}/env``): ``GET tools``, ``POST
step`` (a tool call or a message, answered by the cube task), ``POST reward``
(the agent's own reward for the episode). A posted reward needs the
episode's *reward key*, not its API key, and exists only for tasks with
``reward_source = "agent"`` (``AgentTask``): everything else is refused
(403) and counted, because the API key is in every tool the agent runs.

Per-call cost. A call's fixed cost is what an agent pays on every turn, so
the path keeps it small: the turn limit is checked before anything is
parsed into tokens; the re-sent history is compared as plain dicts (no
re-serialisation); a body whose text cannot fit the context even at the
tokenizer's longest token is refused before tokenizing; large new messages
are tokenized in a thread, off the event loop; streaming takes vLLM's DELTA
outputs.

Tool calls and reasoning. A reply is read by the same vLLM parsers as a
native turn (``model.tool_parser``, ``model.reasoning_parser``;
``rlnode/actor/parsing.py``) and answered as ``vllm serve`` answers:
``tool_calls`` when the request offered tools (and ``tool_choice`` is not
"none"), ``reasoning`` (and ``reasoning_content``) beside the content.

Owns: sessions, request validation, prompt construction, the reply's shape,
streaming. Must not decide rewards or retries (``agent_episode.py`` and the
scheduler do).

Where it runs (``actor.gateway_host``): "inline", on the daemon's event
loop (``Gateway``); "process", in a gateway host process of its own
(``HostedGateway`` in the daemon, ``host.py`` the process, one typed
channel between them, ``protocol.py``): the host serves HTTP and does the
text work, the daemon keeps the lease, the engine call and the record the
samples are made from.

Modules: ``protocols/`` (each API's requests, replies, streams and
errors), ``api.py`` (the error, messages in the template's form),
``session.py`` (an episode's keys, served calls and history matching),
``stream.py`` (server-sent events), ``server.py`` (``Gateway``: routes and
handlers), ``protocol.py``, ``host.py`` and ``hosted.py`` (the host
process, above).
"""

from rlnode.actor.gateway.api import MAX_REQUEST_BYTES, TOKENIZE_INLINE_CHARS, GatewayError, template_message
from rlnode.actor.gateway.protocols import PROTOCOLS, ChatRequest
from rlnode.actor.gateway.hosted import GatewayHostLost, HostedGateway, make_gateway
from rlnode.actor.gateway.server import Gateway
from rlnode.actor.gateway.session import GatewaySession, GatewayStats, ServedCall

__all__ = [
    "MAX_REQUEST_BYTES", "TOKENIZE_INLINE_CHARS", "ChatRequest", "Gateway", "GatewayError", "GatewayHostLost",
    "HostedGateway", "PROTOCOLS", "make_gateway",
    "GatewaySession", "GatewayStats", "ServedCall", "template_message",
]
