"""A verifiers environment for ``tests/test_verifiers_cube.py`` shaped like an
unchanged upstream one (``reverse_text`` from the verifiers repository): a
taskset and a harness, no ``Env`` of its own, so verifiers plays it with its
``SingleAgentEnv`` whose one seat, ``agent``, keeps verifiers' default
runtime (the remote Prime sandbox).

It is ``vf_guess``'s one-call game with a knob to misbehave:
``taskset.task.exit_in = "harness" | "rubric"`` makes that part raise
``SystemExit``, as code calling ``sys.exit`` (or verifiers' own Prime login
check) does inside an episode; ``"hang"`` makes the harness wait forever.

Like upstream's, its harness shares asyncio objects between episodes:
verifiers' ``SubprocessRuntime`` keeps its script locks on the class, made
once and used by every rollout of the process. Here a lock and a semaphore,
made at import, are taken by every episode and held across a suspension, so
concurrent episodes contend for them: on one loop that is just a queue; on
a loop per episode the second loop to wait binds them and the third fails
("is bound to a different event loop").
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Literal

import verifiers.v1 as vf

from rlnode.cubes import vf_guess


class ExitTaskConfig(vf_guess.GuessTaskConfig):
    exit_in: Literal["", "harness", "rubric", "hang", "tool", "script"] = ""


class ExitConfig(vf_guess.GuessConfig):
    task: ExitTaskConfig = ExitTaskConfig()


class ExitData(vf_guess.GuessData):
    exit_in: str = ""


class ExitTask(vf.Task[ExitData, vf.State, ExitTaskConfig]):
    @property
    def key(self) -> str:
        return self.data.id or self.hash

    @vf.reward
    async def correct(self, task: ExitData, trace: vf.Trace) -> float:
        if task.exit_in == "rubric":
            raise SystemExit("the rubric exits")
        return float(vf_guess.first_int(trace.assistant_messages[-1].content) == task.answer)


class ExitTaskset(vf.Taskset[ExitTask, ExitConfig]):
    def load(self):
        cfg = self.config
        for i in range(cfg.num_tasks):
            yield ExitTask(ExitData(id=f"{cfg.split}-{i:05d}", prompt="Guess a number from 1 to 2.",
                                    system_prompt=vf_guess.SYSTEM_PROMPT, answer=1 + i % 2, max_number=2,
                                    max_turns=1, exit_in=cfg.task.exit_in), cfg.task)


class ExitHarness(vf_guess.GuessHarness):
    # Shared by every episode in the process, as upstream's are.
    shared_lock = asyncio.Lock()
    shared_gate = asyncio.Semaphore(4)
    entered = 0  # episodes that got through both

    reports: dict[str, str] = {}  # task id -> what the "tool" program printed

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw) -> vf.ProgramResult:
        exit_in = getattr(data, "exit_in", "")
        if exit_in == "tool":
            # A harness that runs its agent as a program in the runtime (as
            # upstream's CLI harnesses do): the program makes the model call
            # and, being the policy's tool, tries what a tool call could.
            await runtime.write("tool.py", TOOL_PROGRAM.encode())
            await runtime.write("agent_fixtures.py", (Path(__file__).parent / "agent_fixtures.py").read_bytes())
            passed = {k[len("VF_TEST_"):]: os.environ[k] for k in os.environ if k.startswith("VF_TEST_")}
            result = await runtime.run_program([sys.executable, "tool.py"], {
                **passed, "OPENAI_BASE_URL": endpoint, "OPENAI_API_KEY": secret, "MODEL": ctx.model})
            ExitHarness.reports[data.id] = result.stdout + result.stderr
            return result
        if exit_in == "script":
            # Upstream's harnesses (the null harness's chat program) run a
            # PEP 723 script through verifiers' prepare_uv_script; this one
            # needs no package, so no index either.
            program = await runtime.prepare_uv_script(SCRIPT_PROGRAM, {})
            result = await runtime.run_program([*program], {
                "OPENAI_BASE_URL": endpoint, "OPENAI_API_KEY": secret, "MODEL": ctx.model})
            ExitHarness.reports[data.id] = result.stdout + result.stderr
            return result
        if exit_in == "harness":
            raise SystemExit("the harness exits")
        if exit_in == "hang":
            await asyncio.Event().wait()
        async with ExitHarness.shared_gate:
            async with ExitHarness.shared_lock:
                await asyncio.sleep(0.002)  # held across a suspension: the others queue
                ExitHarness.entered += 1
        return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw)


# What both programs below start with: ``attempt`` records what each try
# got, ``call`` makes one model call through the endpoint it was given.
_ATTEMPT = r"""
import json, os, sys, urllib.request
def attempt(name, fn):
    try:
        out[name] = "ok: %r" % (fn(),)
    except Exception as e:
        out[name] = "refused: " + type(e).__name__
def call():
    body = json.dumps({"model": os.environ["MODEL"], "messages": [{"role": "user", "content": "guess"}]}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=20).status
"""

# The "tool" program: one model call, then every escape a tool call could
# try; prints what each got as JSON.
TOOL_PROGRAM = _ATTEMPT + r"""
import agent_fixtures  # written beside it: the openai-agent tests' escapes, reused
out = {"uid": os.getuid()}
attempt("model_call", call)
attempt("daemon_environ", lambda: open("/proc/%s/environ" % os.environ["DAEMON_PID"], "rb").read(10))
out["fork_bomb"] = agent_fixtures.fork_until_refused()
out.update(agent_fixtures.steal_the_link())
out["secrets_in_env"] = sorted(k for k in os.environ if k in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY"))
print("REPORT " + json.dumps(out))
"""

# The PEP 723 "script" program: one model call, then it tries to change
# what every later episode would run (its own script, its interpreter's
# environment, the uv cache) and reports each attempt.
SCRIPT_PROGRAM = """# /// script
# requires-python = ">=3.10"
# dependencies = []
# ///""" + _ATTEMPT + r"""
out = {"uid": os.getuid(), "executable": sys.executable, "script": os.path.abspath(__file__),
       "virtual_env": os.environ.get("VIRTUAL_ENV", "")}
attempt("model_call", call)
attempt("overwrite_script", lambda: open(__file__, "a").write("# planted"))
attempt("plant_script", lambda: open(os.path.join(os.path.dirname(__file__), "planted.py"), "w").write("x"))
attempt("plant_in_env", lambda: open(os.path.join(sys.prefix, "planted.pth"), "w").write("x"))
attempt("plant_in_uv_cache", lambda: open(os.path.join(os.path.dirname(os.path.dirname(sys.prefix)),
                                                       "planted"), "w").write("x"))
print("REPORT " + json.dumps(out))
"""


__all__ = ["ExitHarness", "ExitTaskset", "SCRIPT_PROGRAM"]
