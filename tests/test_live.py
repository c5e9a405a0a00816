"""analysis.live: a level read from the streams while the load still runs, where a request is written
only once it ends."""

from __future__ import annotations

import numpy as np
import pytest

from kvprobe.analysis.levels import LevelWindow, level_stats
from kvprobe.analysis.live import streams_levels, with_in_flight, written_until
from kvprobe.load.records import FLUSH_SECONDS, IN_FLIGHT, Record

USERS, SERVICE, FIRST, TOKENS = 8, 1.0, 0.05, 20  # a closed loop of 8 users, each request 1 s, no queue
RUNNING = USERS * (SERVICE - FIRST) / SERVICE  # as the client sees it: from the first token to the end


def closed_loop(t0: float, t1: float, now: float) -> list[Record]:
    """The requests of USERS back-to-back users from t0, as written by `now`: only those ended by then."""
    out = []
    for user in range(USERS):
        send = t0 + user * SERVICE / USERS
        while send + SERVICE <= min(t1, now):
            out.append(Record(t_send=send, t_first=send + FIRST, t_end=send + SERVICE, status=200,
                              prompt_tokens=16, completion_tokens=TOKENS))
            send += SERVICE
    return out


def sampled_gauge(t0: float, t1: float) -> dict:
    """A gauge that reads one low except at every fifth sample (SGLang's, published at full steps)."""
    t = np.arange(t0, t1, 0.1)
    running = np.where(np.arange(t.size) % 5 == 0, USERS, USERS - 1).astype(float)
    return {"t": t, "ok": np.ones(t.size, dtype=bool), "running": running, "waiting": np.zeros(t.size),
            "usage": np.full(t.size, 0.5), "preemptions": np.zeros(t.size)}


def test_written_until_leaves_the_longest_request_and_a_flush():
    records = [Record(t_send=0.0, t_first=0.1, t_end=3.0), Record(t_send=10.0, t_first=10.2, t_end=11.5),
               Record(kind="lag", t=11.0)]
    assert written_until(records, 12.0, since=5.0) == pytest.approx(12.0 - 1.5 - FLUSH_SECONDS)
    assert written_until(records, 12.0, since=0.0) == pytest.approx(12.0 - 3.0 - FLUSH_SECONDS)


def test_a_level_still_held_is_read_only_as_far_as_its_streams_are_written():
    now = 20.0
    window = LevelWindow(users=USERS, t_start=0.0, t_end=now, t_steady=2.0)
    arrays, records = sampled_gauge(0.0, now), closed_loop(0.0, 60.0, now)
    read_to_now = level_stats(arrays, [window], records=records)[0].client_running_mean
    (level,) = streams_levels(arrays, [window], records, now=now, warmup_fraction=0.3, lead_steps=0.0,
                              counter_lazy=False)
    # to `now`, the requests still running are missing: the last second reads half of them on average
    assert read_to_now < RUNNING - 0.15
    assert level.running_source == "client" and level.running_mean == pytest.approx(RUNNING, abs=0.02)
    assert level.t_end == pytest.approx(now - SERVICE - FLUSH_SECONDS)


def snapshot(t: float, users: int = USERS, t0: float = 0.0, worker: str = "w0") -> Record:
    """What the load process writes at `t` of the closed loop: each user's request in flight then."""
    ids, sends, firsts = [], [], []
    for user in range(users):
        send = t0 + user * SERVICE / USERS
        send += np.floor((t - send) / SERVICE) * SERVICE
        ids.append(f"u{user}-{send:.3f}"), sends.append(send)
        firsts.append(send + FIRST if t >= send + FIRST else None)
    return Record(kind=IN_FLIGHT, t=t, worker=worker, ids=ids, sends=sends, firsts=firsts)


def with_ids(records: list[Record], worker: str = "w0") -> list[Record]:
    for r in records:
        r.request_id, r.worker = f"u{round(r.t_send * USERS) % USERS}-{r.t_send:.3f}", worker
    return records


def test_with_the_snapshot_of_the_requests_in_flight_a_level_is_read_to_the_snapshot():
    now = 20.0
    window = LevelWindow(users=USERS, t_start=0.0, t_end=now, t_steady=2.0)
    arrays = sampled_gauge(0.0, now)
    records = with_ids(closed_loop(0.0, 60.0, now)) + [snapshot(now - 1.3), snapshot(now - 0.3)]
    (level,) = streams_levels(arrays, [window], records, now=now, warmup_fraction=0.3, lead_steps=0.0,
                              counter_lazy=False)
    assert level.t_end == pytest.approx(now - 0.3)  # not a latency and a flush before now
    assert level.running_source == "client" and level.running_mean == pytest.approx(RUNNING, abs=0.02)


def test_the_view_is_whole_to_the_earliest_process_and_counts_each_request_once():
    now = 20.0
    ended = with_ids(closed_loop(0.0, 60.0, now))
    late = ended[-1]
    # the older snapshot still holds a request that has since ended: it is not counted twice
    stale = snapshot(late.t_end - 0.2)
    assert late.request_id in stale.ids
    other = Record(kind=IN_FLIGHT, t=now - 0.7, worker="w1", ids=["x"], sends=[now - 0.9], firsts=[None])
    view, whole = with_in_flight(ended + [stale, other, Record(kind="lag", t=now)])
    assert whole == pytest.approx(min(stale.t, other.t))
    assert sum(r.request_id == late.request_id for r in view) == 1
    waiting = [r for r in view if r.request_id == "x"]
    assert len(waiting) == 1 and waiting[0].t_first is None and waiting[0].t_end is None
    still = [i for i in stale.ids if i not in {r.request_id for r in ended}]
    assert 0 < len(still) < USERS  # some of the snapshot's requests have ended since, the rest run on
    assert len(view) == len(ended) + len(still) + 1
    assert {r.request_id for r in view if r.t_end is None} == set(still) | {"x"}


def test_a_process_that_wrote_requests_and_no_snapshot_leaves_the_written_until_rule():
    ended = with_ids(closed_loop(0.0, 60.0, 20.0))
    ended[0].worker = "w1"
    records = ended + [snapshot(19.7)]
    view, whole = with_in_flight(records)
    assert whole is None and view == records
    assert with_in_flight(ended) == (ended, None)


def test_a_level_whose_steady_part_is_not_written_yet_is_left_out():
    now = 11.2
    held = LevelWindow(users=USERS, t_start=0.0, t_end=10.0, t_steady=2.0)
    new = LevelWindow(users=USERS + 4, t_start=10.0, t_end=now, t_steady=10.5)
    arrays, records = sampled_gauge(0.0, now), closed_loop(0.0, 60.0, now)
    levels = streams_levels(arrays, [held, new], records, now=now, warmup_fraction=0.3, lead_steps=0.0,
                            counter_lazy=False)
    assert [lv.users for lv in levels] == [USERS]


def capped_loop(levels: list[tuple[int, float, float]], cap: int, now: float) -> list[Record]:
    """Closed-loop users against an engine that runs at most `cap` requests (FIFO queue, SERVICE each), as
    written by `now`. `levels`: (users, t_start, t_end); a level's new users join at its start."""
    import heapq

    events, records, running, queue, joined = [], [], 0, [], 0
    for users, t0, _ in levels:
        for _ in range(users - joined):
            heapq.heappush(events, (t0, "send", t0))
        joined = users
    end = levels[-1][2]
    while events:
        t, kind, sent = heapq.heappop(events)
        if t > end:
            break
        if kind == "send":
            queue.append(t)
        else:
            running -= 1
            if t <= now:
                records.append(Record(t_send=sent[0], t_first=sent[1] + FIRST, t_end=t, status=200,
                                      prompt_tokens=16, completion_tokens=TOKENS))
            heapq.heappush(events, (t, "send", t))
        while queue and running < cap:
            s = queue.pop(0)
            running += 1
            heapq.heappush(events, (t + SERVICE, "end", (s, t)))
    return records


def test_a_sampled_gauge_held_to_an_uncertainty_settles_on_the_streams():
    """The ramp's settling plan with a sampled gauge and a `ramp.uncertainty`: the streams' plateau
    (the figure the verdict reads), not the gauge's highest readings; otherwise the plan it is given."""
    from types import SimpleNamespace

    from kvprobe.analysis.plateau import find_rejection_point
    from kvprobe.probe import ramp
    from kvprobe.spec.schema import RampSpec

    cap, now = 10, 36.0
    spans = [(6, 0.0, 12.0), (14, 12.0, 24.0), (18, 24.0, 36.0)]
    records = capped_loop(spans, cap, now)
    t = np.arange(0.0, now, 0.1)
    users = np.select([t < 12, t < 24], [6, 14], 18).astype(float)
    full = np.minimum(users, cap)
    arrays = {"t": t, "ok": np.ones(t.size, dtype=bool), "usage": full / cap, "preemptions": np.zeros(t.size),
              "running": np.where(np.arange(t.size) % 5 == 0, full, full - 2), "waiting": users - full}
    windows = [LevelWindow(users=u, t_start=a, t_end=b, t_steady=a + 2.0) for u, a, b in spans]
    profile = SimpleNamespace(ramp=RampSpec("predict", uncertainty=0.25), hold=SimpleNamespace(warmup=0.3))
    pr = SimpleNamespace(exp=SimpleNamespace(profile=profile), windows=windows,
                         dialect=SimpleNamespace(RUNNING_GAUGE_EXACT=False, FIRST_TOKEN_LEAD_STEPS=0.0,
                                                 PREEMPTION_COUNTER_LAZY=False),
                         sampler=SimpleNamespace(series=SimpleNamespace(arrays=lambda: arrays)),
                         load=SimpleNamespace(records=lambda **_: records))
    gauge_plan = find_rejection_point(level_stats(arrays, windows))
    plan = ramp._settle_plan(pr, gauge_plan)
    streams = cap * (SERVICE - FIRST) / SERVICE  # 9.5: running from the first token to the end
    assert plan.confirmed and plan.rejection_point == pytest.approx(streams, abs=0.05)
    assert abs(gauge_plan.rejection_point - streams) > 0.5  # the gauge's mean reads low
    assert ramp._settle_plan(pr, gauge_plan, windows[-1]).rejection_point == pytest.approx(streams, abs=0.05)
    profile.ramp = RampSpec("predict")
    assert ramp._settle_plan(pr, gauge_plan) is gauge_plan
    profile.ramp, pr.dialect.RUNNING_GAUGE_EXACT = RampSpec("predict", uncertainty=0.25), True
    assert ramp._settle_plan(pr, gauge_plan) is gauge_plan
