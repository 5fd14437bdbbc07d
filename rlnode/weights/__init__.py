"""The weight path, from the trainer's parameters to the engine's kernels.
Where an update is born, travels and lands:

    broadcast.py     trainer: WeightBroadcaster (plan, rank 0 of the group), WeightGuard (the step lock)
    protocol.py      the conversation trainer <-> actor: JoinEpoch, LoadWeights and their results
    plan.py          the update plan and spec (msgspec Structs) and the byte layout
    rendezvous.py    authenticated group formation (TCPStore behind the gate)
    store_gate.py    the gate process in front of an epoch's TCPStore
    comm.py          WeightComm: gloo / NCCL broadcast, CUDA IPC lending; plan agreement
    ipc.py           CUDA IPC handles and GPU identity
    worker.py        engine: the vLLM worker extension (receive into staging, load)
    engine_model.py  engine: what the kernels compute with (digests), the fp32 head

The actor daemon drives its engines' workers through
``rlnode.actor.weight_receiver`` (pause, load, resume); the trainer daemon
through ``rlnode.trainer.weight_push.WeightPusher``, the conversation with
every actor (epochs, pushes, retries), which only the trainer holds.
"""
