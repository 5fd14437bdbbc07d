"""rlnode.log helpers."""

from rlnode.log import log_throttled


def test_a_throttled_event_is_logged_the_first_times_then_every_nth():
    logged = []

    def emit(event, **kv):
        logged.append((event, list(kv.items())))

    for n in range(1, 3001):
        log_throttled(emit, "link.trainer.malformed_frame", n, peer="a/1", reason="decode")
    assert [kv[-1] for _, kv in logged] == [("total", n) for n in [*range(1, 11), 1000, 2000, 3000]]
    assert logged[0] == ("link.trainer.malformed_frame", [("peer", "a/1"), ("reason", "decode"), ("total", 1)])
    logged.clear()
    for n in range(1, 301):
        log_throttled(emit, "link.trainer.auth_denied", n, first=2, every=100)
    assert [kv for _, kv in logged] == [[("total", n)] for n in (1, 2, 100, 200, 300)]
