"""Small agents for the openai-agent cube tests: each misbehaves (or not) in
one way. Loaded by path (``tests/agent_fixtures.py:NAME``) or run as a
command (``python agent_fixtures.py NAME``, task on stdin)."""

import asyncio
import json
import os
import sys
import time

import httpx
import openai


def _env(base_url: str) -> str:
    return base_url.rsplit("/v1", 1)[0] + "/env"


async def one_call(base_url: str, api_key: str) -> None:
    llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    await llm.close()


async def crash(task, base_url, api_key):
    await one_call(base_url, api_key)
    raise RuntimeError("agent bug")


async def returns_reward(task, base_url, api_key):
    await one_call(base_url, api_key)
    return 0.25


async def posts_reward(task, base_url, api_key):
    await one_call(base_url, api_key)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {task['reward_key']}"}) as http:
        (await http.post(_env(base_url) + "/reward", json={"reward": 0.75, "success": True})).raise_for_status()
    return 0.25  # the posted reward wins


async def returns_huge(task, base_url, api_key):
    await one_call(base_url, api_key)
    return 1e30


async def returns_nan(task, base_url, api_key):
    await one_call(base_url, api_key)
    return float("nan")


async def exits(task, base_url, api_key):
    """Foreign code that ends 'the program' (verifiers does, without a key)."""
    await one_call(base_url, api_key)
    raise SystemExit("no API key for the remote sandbox")


async def no_reward(task, base_url, api_key):
    await one_call(base_url, api_key)


async def no_call(task, base_url, api_key):
    return 1.0


async def until_refused(task, base_url, api_key):
    """Calls until the gateway refuses (max_turns), then breaks on the error."""
    llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    try:
        while True:
            r = await llm.chat.completions.create(model="m", messages=messages, max_tokens=4)
            messages += [r.choices[0].message, {"role": "user", "content": "again"}]
    finally:
        await llm.close()


async def off_the_daemon(task, base_url, api_key):
    """1.0 when it runs outside the process that started its cube."""
    await one_call(base_url, api_key)
    return float(os.getpid() != int(os.environ["DAEMON_PID"]))


def blocking_hang(task, base_url, api_key):
    """A blocking agent that never ends: cancellation cannot reach it."""
    llm = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    time.sleep(600)


def blocking_returns(task, base_url, api_key):
    """A plain (blocking) function: runs in a thread."""
    llm = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    llm.close()
    return 0.5


def try_to_escape() -> dict:
    """What a tool call could try from inside the agent: each entry is what
    it got (the test wants every one refused)."""
    import socket

    out = {"uid": os.getuid()}

    def attempt(name, fn):
        try:
            out[name] = f"ok: {fn()!r}"[:80]
        except Exception as e:  # noqa: BLE001 - refused is the point
            out[name] = f"refused: {type(e).__name__}"

    attempt("daemon_environ", lambda: open(f"/proc/{os.environ['DAEMON_PID']}/environ", "rb").read(10))
    attempt("secret_file", lambda: open(os.environ["SECRET_FILE"]).read())
    attempt("run_dir", lambda: os.listdir(os.environ["RUN_DIR"]))
    attempt("link_port", lambda: socket.create_connection(("127.0.0.1", int(os.environ["LINK_PORT"])), 2).close())
    attempt("internet", lambda: socket.create_connection(("1.1.1.1", 53), 2).close())
    attempt("write_outside_tmp", lambda: open(os.path.join(os.environ["RUN_DIR"], "planted"), "w").write("x"))
    attempt("kill_pid_1_of_host", lambda: os.kill(int(os.environ["DAEMON_PID"]), 0))
    out["secrets_in_env"] = sorted(k for k in os.environ if k in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY"))
    return out


def command_main(mode: str) -> int:
    task = json.load(sys.stdin)
    base_url, api_key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    asyncio.run(one_call(base_url, api_key))
    if mode == "hang":
        # A child in the same process group, then hang: the timeout must kill both.
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["PID_FILE"], "w") as f:
            json.dump([os.getpid(), child.pid], f)
        time.sleep(600)
    if mode == "env":  # reported on stderr: a sandboxed agent cannot write the test's files
        print("ENV " + json.dumps(sorted(os.environ)), file=sys.stderr)
        return 3
    if mode == "escape":
        print("REPORT " + json.dumps(try_to_escape()), file=sys.stderr)
        return 3
    if mode == "forge":
        # What a tool call the policy got the agent to run can do: a child
        # process with the agent's environment posts a huge reward, with the
        # only key it can see.
        script = ("import httpx, os, sys; r = httpx.post(os.environ['RLNODE_ENV_URL'] + '/reward', "
                  "json={'reward': 1e30, 'success': True}, "
                  "headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']}); "
                  "sys.exit(0 if r.status_code == 403 else 5)")
        import subprocess

        return subprocess.run([sys.executable, "-c", script]).returncode
    if mode == "fail":
        print("agent says: cannot continue", file=sys.stderr)
        return 3
    if mode == "post":
        with httpx.Client(headers={"Authorization": f"Bearer {task['reward_key']}"}) as http:
            http.post(os.environ["RLNODE_ENV_URL"] + "/reward", json={"reward": float(task["info"]["value"])})
    return 0


if __name__ == "__main__":
    sys.exit(command_main(sys.argv[1]))
