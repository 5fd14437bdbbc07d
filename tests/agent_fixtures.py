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


async def flood_output(task, base_url, api_key):
    """A worker's agent that floods its stdout and stderr (16 MiB each, and
    a forged log line), then ends its worker process."""
    line = b"2026-01-01 00:00:00 [error    ] forged.daemon_line\n"
    for stream in (sys.stdout.buffer, sys.stderr.buffer):
        for _ in range(16):
            stream.write(line + b"y" * (1 << 20))
        stream.write(b"\nFLOOD-END\n")
        stream.flush()
    os._exit(7)


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


def steal_the_link() -> dict:
    """What a tool call could try against the node's link: read the node's
    CURVE keys (KEY_DIR, NODE_ID), register as that node and deliver a group
    (FRAMES: hex of a real Register and GroupDelivery) on LINK_PORT. Each
    entry is what it got; a frame counts only if the trainer answers it."""
    import zmq
    import zmq.auth

    key_dir, node, port = os.environ["KEY_DIR"], os.environ["NODE_ID"], int(os.environ["LINK_PORT"])
    frames = json.loads(os.environ["FRAMES"])
    out, keys = {}, None
    try:
        public, secret = zmq.auth.load_certificate(os.path.join(key_dir, f"{node}.key_secret"))
        server, _ = zmq.auth.load_certificate(os.path.join(key_dir, "trainer.key"))
        keys, out["read_keys"] = (public, secret, server), "ok"
    except Exception as e:  # noqa: BLE001 - refused is the point
        out["read_keys"] = f"refused: {type(e).__name__}"
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = f"{node}/stolen".encode()
        if keys:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
        sock.connect(f"tcp://127.0.0.1:{port}")
        for name in ("register", "deliver"):
            sock.send(bytes.fromhex(frames[name]))
            out[name] = f"ok: {sock.recv()[:40]!r}" if sock.poll(3000) else "refused: no answer"
    finally:
        ctx.destroy(linger=0)
    return out


def fork_until_refused() -> str:
    """A fork bomb held on a leash: children that sleep, forked until the
    kernel refuses; they are killed before this returns."""
    children = []
    try:
        while len(children) < 1000:
            pid = os.fork()
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children.append(pid)
        return f"allowed: forked {len(children)} processes"
    except OSError as e:
        return f"refused: fork after {len(children)} processes: {type(e).__name__}"
    finally:
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def hog_memory() -> str:
    """2 GiB, every page touched."""
    block = bytearray(2 * 2**30)
    block[:: 4096] = b"x" * len(range(0, len(block), 4096))
    return f"allowed: held {len(block) >> 20} MiB"


def memory_herd(processes: int = 8, mib: int = 384) -> str:
    """``processes`` children holding ``mib`` MiB each at once, every page
    touched: each within its own address-space limit, 3 GiB together."""
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            try:
                block = bytearray(mib << 20)
                block[:: 4096] = b"x" * len(range(0, len(block), 4096))
                time.sleep(3)  # held while the others take theirs
                os._exit(0)
            except MemoryError:
                os._exit(3)
        pids.append(pid)
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    killed = sum(os.WIFSIGNALED(s) for s in statuses)
    short = sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) != 0 for s in statuses)
    if killed or short:
        return f"refused: {killed} of {processes} killed, {short} out of memory"
    return f"allowed: held {processes * mib} MiB in {processes} processes"


def write_big_file() -> str:
    """A 64 MiB file in its working folder (the private /tmp here)."""
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "big.bin")
    written = 0
    try:
        with open(path, "wb") as f:
            for _ in range(64):
                f.write(b"z" * (1 << 20))
                f.flush()
                written += 1
        return f"allowed: wrote {written} MiB"
    except OSError as e:
        return f"refused: after {written} MiB: {type(e).__name__} {e.errno}"
    finally:
        if os.path.exists(path):
            os.unlink(path)


def open_connections(base_url: str, count: int = 10_000) -> str:
    """Open ``count`` connections to the gateway and hold them."""
    import socket
    from urllib.parse import urlsplit

    url, held = urlsplit(base_url), []
    try:
        for _ in range(count):
            held.append(socket.create_connection((url.hostname, url.port), 5))
        return f"allowed: held {len(held)} connections"
    except OSError as e:
        return f"refused: after {len(held)} connections: {type(e).__name__}"
    finally:
        for s in held:
            s.close()


async def burn(task, base_url, api_key):
    """Spends CPU until its worker process has used 8.5 s in all."""
    import resource

    await one_call(base_url, api_key)
    while sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) < 8.5:
        sum(range(100_000))
    return 0.5


async def escape(task, base_url, api_key):
    await one_call(base_url, api_key)
    raise RuntimeError("REPORT " + json.dumps(try_to_escape()))


async def steal(task, base_url, api_key):
    await one_call(base_url, api_key)
    raise RuntimeError("REPORT " + json.dumps(steal_the_link()))


async def bomb(task, base_url, api_key):
    await one_call(base_url, api_key)
    return _limit_outcome(fork_until_refused())


async def hog(task, base_url, api_key):
    await one_call(base_url, api_key)
    return _limit_outcome(hog_memory)


async def flood(task, base_url, api_key):
    await one_call(base_url, api_key)
    return _limit_outcome(open_connections, base_url)


async def herd(task, base_url, api_key):
    await one_call(base_url, api_key)
    return _limit_outcome(memory_herd)


async def bigfile(task, base_url, api_key):
    await one_call(base_url, api_key)
    return _limit_outcome(write_big_file)


def _limit_outcome(what, *args) -> float:
    """0.0 when the agent got all it asked for; raises when a limit held."""
    try:
        got = what(*args) if callable(what) else what
    except MemoryError:
        got = "refused: MemoryError"
    if got.startswith("refused"):
        raise RuntimeError(f"LIMIT {got}")
    return 0.0


def command_main(mode: str) -> int:
    task = json.load(sys.stdin)
    base_url, api_key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    if mode == "hang":
        # A child in the same process group, then a call and a hang: the
        # timeout must kill both. The pids are written first: an engine's
        # first call (kernels compiled on a loaded host) can take longer
        # than the episode's timeout.
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["PID_FILE"], "w") as f:
            json.dump([os.getpid(), child.pid], f)
        asyncio.run(one_call(base_url, api_key))
        time.sleep(600)
    asyncio.run(one_call(base_url, api_key))
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
    if mode == "steal":
        print("REPORT " + json.dumps(steal_the_link()), file=sys.stderr)
        return 3
    if mode in ("bomb", "hog", "flood", "bigfile", "herd"):
        what = {"bomb": fork_until_refused, "hog": hog_memory, "flood": lambda: open_connections(base_url),
                "bigfile": write_big_file, "herd": memory_herd}[mode]
        try:
            _limit_outcome(what)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 3
        return 0
    if mode == "sleep":  # holds its episode open (its sandbox and relay) for a while
        time.sleep(float(os.environ.get("SLEEP_S", "3")))
        return 0
    if mode == "fail":
        print("agent says: cannot continue", file=sys.stderr)
        return 3
    if mode == "stderr_flood":  # 64 MiB on stderr, a last line, a failure
        chunk = b"x" * (1 << 20)
        for _ in range(64):
            sys.stderr.buffer.write(chunk)
        sys.stderr.buffer.write(b"\nSTDERR-END\n")
        sys.stderr.flush()
        return 3
    if mode == "post":
        with httpx.Client(headers={"Authorization": f"Bearer {task['reward_key']}"}) as http:
            http.post(os.environ["RLNODE_ENV_URL"] + "/reward", json={"reward": float(task["info"]["value"])})
    return 0


class _RunsInTheDaemon:
    """Unpickled, makes directory ``path``: proof that code sent by a
    worker ran in the daemon."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


async def forge_frame(task, base_url, api_key):
    """What a tool call in a function agent's worker could do: write to the
    worker's own channel to the daemon (its descriptor is argv[1]) a frame
    as a pickling channel (multiprocessing.connection) reads one: a 4-byte
    length, then a pickle whose loading makes the task's ``marker``."""
    import pickle
    import struct

    payload = pickle.dumps(_RunsInTheDaemon(task["info"]["marker"]))
    os.write(int(sys.argv[1]), struct.pack("!i", len(payload)) + payload)
    await asyncio.sleep(1)
    return 0.25


if __name__ == "__main__":
    sys.exit(command_main(sys.argv[1]))
