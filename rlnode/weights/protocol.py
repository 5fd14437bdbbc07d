"""The weight conversation between the trainer and an actor daemon, typed.

Born in the trainer's ``WeightPusher`` (``rlnode.trainer.weight_push``),
carried in a ``wire.ControlRequest`` over the link, answered in a
``wire.ControlReply`` by the actor daemon, which hands it to its engines
(``rlnode.actor.weight_receiver``):

    trainer                                   actor (every engine)
    JoinEpoch(spec)          ------------->   join group epoch spec.epoch
                             <-------------   EpochJoined(epoch)
    LoadWeights(plan)        ------------->   pause (keep), receive, load, resume
                             <-------------   WeightsLoaded(version, stalled_s)
    Probe(timeout_s)         ------------->   every engine answers a call
                             <-------------   ProbeAnswered(engines)

``Probe`` goes only to an actor the trainer left out of the group (benched,
``rlnode.trainer.weight_push``): its answer says the node could take a join now.

The bytes of the weights never travel here: they follow on the group epoch
(``comm.WeightComm``) as one broadcast per bucket of ``plan``.

Every message is a tagged msgspec Struct, decoded by the link's typed
decoder: a frame that does not match is rejected and counted as malformed
before any code of the weight path sees it; what a well-formed message
promises beyond its types (ranks cover the group, buckets tile) is checked
by ``GroupSpec.validate`` / ``WeightUpdatePlan.validate`` where it is used.

Schema evolution: append fields with defaults only (STYLE point 3).
"""

from __future__ import annotations

import msgspec

from rlnode.weights.plan import GroupSpec, WeightUpdatePlan


class _Weights(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    pass


class JoinEpoch(_Weights, tag="join"):
    """trainer -> actor: every engine of the node joins group epoch
    ``spec.epoch`` at the ranks ``spec`` gives it."""

    spec: GroupSpec


class LoadWeights(_Weights, tag="load"):
    """trainer -> actor: the next update. The engines pause (keeping their
    requests), receive ``plan``'s buckets, load them, and resume. From then
    on they tag tokens with ``plan.label`` (version @ the trainer's
    incarnation) and salt their prefix cache with it: a resumed trainer's
    v101 never shares a name, or a cached block, with a lost v101."""

    plan: WeightUpdatePlan


class EpochJoined(_Weights, tag="joined"):
    """actor -> trainer: every engine of the node joined ``epoch``."""

    epoch: int


class WeightsLoaded(_Weights, tag="loaded"):
    """actor -> trainer: every engine of the node serves ``version`` now."""

    version: int
    # The longest time any engine of the node held generation paused.
    stalled_s: float


class Probe(_Weights, tag="probe"):
    """trainer -> actor, benched actors only: answer once every engine has
    no weight job in the way and answered a call through its engine core
    and workers, within ``timeout_s`` (else fail). An actor that predates
    it cannot decode it (counted malformed there, no reply): it stays
    benched until it registers again."""

    timeout_s: float


class ProbeAnswered(_Weights, tag="probed"):
    """actor -> trainer: every one of the node's ``engines`` answered."""

    engines: int


WeightCommand = JoinEpoch | LoadWeights | Probe
WeightResult = EpochJoined | WeightsLoaded | ProbeAnswered
