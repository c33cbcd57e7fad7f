"""LoadQueue (adapters/load_queue.py): which queued load starts when, so CPU memory stays bounded."""

from adapters.load_queue import LoadQueue
from adapters.versions import AdapterRef, AdapterVersion


def _versions(count):
    return [AdapterVersion(AdapterRef(f"v{i}", f"/v{i}", None, i), None) for i in range(count)]


def _queue(max_cpu, max_loading):
    submitted = []
    return LoadQueue(max_cpu, max_loading, submit=submitted.append), submitted


def _live(version):
    return True


def test_loads_start_oldest_first_up_to_max_loading():
    queue, submitted = _queue(max_cpu=4, max_loading=2)
    versions = _versions(4)
    for version in versions:
        queue.push(version)
    queue.start(num_ready=0, is_live=_live)
    assert submitted == versions[:2] and queue.num_running == 2 and all(v.started for v in versions[:2])
    queue.finish()
    queue.start(num_ready=1, is_live=_live)
    assert submitted == versions[:3] and queue.num_running == 2


def test_ready_plus_running_stays_under_max_cpu_plus_max_loading():
    queue, submitted = _queue(max_cpu=2, max_loading=3)
    for version in _versions(5):
        queue.push(version)
    queue.start(num_ready=3, is_live=_live)  # 3 ready + 2 running = 5 = max_cpu + max_loading
    assert len(submitted) == 2 and queue.num_running == 2
    queue.finish()
    queue.start(num_ready=4, is_live=_live)  # the finished load became ready: no room
    assert len(submitted) == 2


def test_started_or_dropped_versions_are_skipped():
    queue, submitted = _queue(max_cpu=4, max_loading=4)
    taken, dropped, waiting = _versions(3)
    for version in (taken, dropped, waiting):
        queue.push(version)
    queue.begin(taken)  # an add() caller runs this one itself
    queue.start(num_ready=0, is_live=lambda v: v is not dropped)
    assert submitted == [waiting] and queue.num_running == 2 and not dropped.started


def test_clear_forgets_waiting_loads():
    queue, submitted = _queue(max_cpu=4, max_loading=1)
    for version in _versions(2):
        queue.push(version)
    queue.clear()
    queue.start(num_ready=0, is_live=_live)
    assert submitted == [] and queue.num_running == 0
