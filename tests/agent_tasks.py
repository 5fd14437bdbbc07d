"""A plain ``AgentTask`` for tests of the agent episode itself: task ``t0``
of cube "agent", prompt "say hi", no tools, reward 1 from its evaluator,
closes counted. Subclasses add ``run_agent`` and whatever misbehaviour
their test is about."""

from rlnode.cubes.base import AgentTask, CubeTaskRef, Evaluation, Reset, StepResult


class PlainAgentTask(AgentTask):
    def __init__(self, task_id: str = "t0", timeout_s: float = 90.0):
        self.ref = CubeTaskRef("agent", task_id)
        self.timeout_s = timeout_s
        self.closed = 0

    async def reset(self):
        return Reset(observation="say hi")

    def tools(self):
        return []

    async def step(self, action):
        return StepResult("")

    async def evaluate(self):
        return Evaluation(reward=1.0, success=True)

    async def close(self):
        self.closed += 1
