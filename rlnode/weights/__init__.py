"""The weight path's transport, shared by the trainer's push
(``rlnode/trainer/weights.py``, ``sync.py``) and the engine's receiver
(``rlnode/actor/weight_receiver.py``):

    protocol.py    the conversation trainer <-> actor: JoinEpoch, LoadWeights and their results
    plan.py        the update plan and spec (msgspec Structs) and the byte layout
    rendezvous.py  authenticated group formation (TCPStore behind the gate)
    store_gate.py  the gate process in front of an epoch's TCPStore
    comm.py        WeightComm: gloo / NCCL broadcast, CUDA IPC lending; plan agreement
    ipc.py         CUDA IPC handles and GPU identity
"""
