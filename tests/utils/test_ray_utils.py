"""verl.utils.ray_utils: device-visibility flags, event loops, auto_await, parallel_put, node_ip."""

import asyncio
import socket
import threading

import pytest

from verl.utils.ray_utils import auto_await, get_event_loop, node_ip, parallel_put, ray_noset_visible_devices


def test_ray_noset_visible_devices_reads_every_accelerator_flag():
    assert not ray_noset_visible_devices({})
    assert not ray_noset_visible_devices({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": ""})
    assert ray_noset_visible_devices({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"})
    assert ray_noset_visible_devices({"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"})


def test_node_ip_without_ray_is_the_given_address_else_the_hostnames(monkeypatch):
    import ray

    # as in a process without Ray (a test session may have started one: then Ray's address answers)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert node_ip(without_ray="127.0.0.1") == "127.0.0.1"
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "10.1.2.3")
    assert node_ip() == "10.1.2.3"

    def unresolvable(host):
        raise OSError("no such host")

    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    assert node_ip() == "127.0.0.1"


def test_get_event_loop_in_a_fresh_thread_creates_and_reuses_one():
    loops = []

    def run():
        loops.append(get_event_loop())
        loops.append(get_event_loop())
        loops.append(loops[0].run_until_complete(asyncio.sleep(0, result=5)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert loops[0] is loops[1] and loops[2] == 5


def test_get_event_loop_inside_a_coroutine_is_the_running_loop():
    async def inner():
        return get_event_loop() is asyncio.get_running_loop()

    assert asyncio.run(inner())


@auto_await
async def _add(a, b):
    await asyncio.sleep(0)
    return a + b


def test_auto_await_blocks_outside_a_loop_and_returns_awaitable_inside():
    assert _add(2, 3) == 5

    async def inside():
        pending = _add(4, 5)
        assert asyncio.iscoroutine(pending)
        return await pending

    assert asyncio.run(inside()) == 9


def test_parallel_put_keeps_order(ray_session):
    import ray

    refs = parallel_put([{"i": i} for i in range(20)], max_workers=4)
    assert ray.get(refs) == [{"i": i} for i in range(20)]
    with pytest.raises(AssertionError, match="at least one"):  # upstream's assert
        parallel_put([])
