"""systemd's notify protocol (sd_notify), spoken directly on the socket.

Owns: sending READY/STATUS/WATCHDOG/STOPPING datagrams to ``$NOTIFY_SOCKET``
and reading the watchdog interval from ``$WATCHDOG_USEC``. It is a handful
of lines of a documented protocol (sd_notify(3)): a datagram of
newline-separated ``KEY=VALUE`` lines to a unix socket, whose path may be in
the abstract namespace (leading ``@``). Without ``NOTIFY_SOCKET`` (not run by
systemd) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, env: dict[str, str] | None = None):
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "")
        self.address = ("\0" + path[1:]) if path.startswith("@") else path
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # The watchdog applies to us only if WATCHDOG_PID is unset or ours.
        ours = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and ours else 0.0
        self._sock: socket.socket | None = None
        self.sent: list[str] = []  # last messages, for /status and tests
        self.dropped = 0  # notifications that could not be sent

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, **fields: str | int) -> bool:
        """``notify(READY=1, STATUS="serving")``; False if it could not be sent."""
        if not self.address:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # Never block the event loop: a receiver that does not read
                # (full queue) costs us a dropped notification, not a hang.
                self._sock.setblocking(False)
            self._sock.sendto(msg.encode(), self.address)
        except OSError:  # includes BlockingIOError on a full queue
            self.dropped += 1
            return False
        self.sent = (self.sent + [msg])[-20:]
        return True

    def ready(self, status: str) -> bool:
        return self.notify(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.notify(STATUS=status)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify(STOPPING=1, STATUS=status)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
