"""RateLimitedRewardManager ("rate_limited") and its token bucket: the bucket's waits on a virtual clock,
the manager's limits with the real one."""

import asyncio
import threading
import time

import pytest
from omegaconf import OmegaConf

from verl.workers.reward_manager import RateLimitedRewardManager, RewardFunctionError, get_reward_manager_cls
from verl.workers.reward_manager.limited import AsyncTokenBucket


@pytest.fixture(autouse=True)
def fresh_limits():
    RateLimitedRewardManager.reset_shared_limits()
    yield
    RateLimitedRewardManager.reset_shared_limits()


def _exact(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str == ground_truth else 0.0


def test_registered_under_upstreams_key():
    assert get_reward_manager_cls("rate_limited") is RateLimitedRewardManager


class _VirtualTime:
    """A clock that moves only when the bucket sleeps, so the bucket's waits are computed exactly and
    do not depend on how busy the machine is (a real clock adds the time the process waits for a
    CPU). It stands in for the `time` and `asyncio` names of the bucket's module; nothing else there
    runs in this test."""

    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_token_bucket_waits_for_refill_at_the_configured_rate(monkeypatch):
    from verl.workers.reward_manager import limited

    clock = _VirtualTime()
    monkeypatch.setattr(limited, "time", clock)
    monkeypatch.setattr(limited, "asyncio", clock)

    async def run():
        bucket = AsyncTokenBucket(rate_limit=10.0)  # capacity 10 tokens, 10 tokens/s
        marks = [clock.now]
        await bucket.acquire(10.0)  # the full bucket: no wait
        marks.append(clock.now)
        await bucket.acquire(5.0)  # empty: 5 tokens take 0.5 s
        marks.append(clock.now)
        await bucket.acquire(25.0)  # more than the capacity: waits for the 25 missing tokens (2.5 s)...
        marks.append(clock.now)
        return [b - a for a, b in zip(marks, marks[1:])], bucket.tokens

    waits, left = asyncio.run(run())
    assert waits == pytest.approx([0.0, 0.5, 2.5], abs=1e-9), f"waits {waits} for 10, 5 and 25 tokens at 10/s"
    assert left == pytest.approx(-25.0, abs=1e-9)  # ...and leaves the bucket in debt


def test_scores_like_naive_and_places_rewards_at_the_last_token(char_tokenizer, make_batch):
    batch = make_batch(["12<eos>", "7", ""], ["12", "8", "1"])
    manager = RateLimitedRewardManager(tokenizer=char_tokenizer, compute_score=_exact, max_concurrent=4)
    out = manager(batch, return_dict=True)
    reward = out["reward_tensor"]
    assert reward[0].tolist() == [0, 0, 1.0, 0, 0, 0, 0, 0]  # "12" + eos: 3 valid tokens (eos skipped in text)
    assert reward[1].sum() == 0 and reward[2].sum() == 0
    assert out["reward_extra_info"]["reward_error"] == [0, 0, 0]


def test_max_concurrent_bounds_calls_in_flight(char_tokenizer, make_batch):
    """Two calls are in flight at once, never three. A barrier of two makes each call wait for a
    partner, so reaching two does not depend on how fast the pool's threads start on a busy
    machine; the 0.1 s hold after it is the window in which a third call, if the limit let one
    through, would be counted."""
    state = {"now": 0, "peak": 0}
    lock = threading.Lock()
    pair = threading.Barrier(2, timeout=60)

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        pair.wait()
        time.sleep(0.1)
        with lock:
            state["now"] -= 1
        return 1.0

    manager = RateLimitedRewardManager(tokenizer=char_tokenizer, compute_score=slow, max_concurrent=2)
    start = time.monotonic()
    reward = manager(make_batch(["1"] * 6, ["1"] * 6))
    elapsed = time.monotonic() - start
    assert reward.sum() == 6.0
    assert state["peak"] == 2, f"{state['peak']} calls ran at once with max_concurrent=2"
    # a lower bound only: a busy machine makes it longer, never shorter
    assert elapsed >= 0.29, f"6 calls of 0.1 s, two at a time, took {elapsed:.2f} s"


def _record_charges(bucket) -> list[float]:
    """The tokens each `acquire` asks of `bucket` (the real bucket still does the waiting)."""
    charges = []
    acquire = bucket.acquire

    async def recording_acquire(num_tokens: float = 1.0) -> None:
        charges.append(num_tokens)
        await acquire(num_tokens)

    bucket.acquire = recording_acquire
    return charges


def test_max_rpm_paces_request_starts(char_tokenizer, make_batch):
    """max_rpm=240 is a bucket of 4 requests refilled at 4/s, charged 1 per request: the charges are
    recorded, the bucket's waits for them are exact on a virtual clock (the test above), and the
    real clock shows that the manager does wait: the 5th to 7th starts come at least 0.25 s apart.
    Only lower bounds on the real clock (a busy machine delays starts, never hastens them); "the
    first 4 start at once" was an upper bound (< 0.2 s) that a loaded machine broke, and is the
    full bucket at start, which the virtual-clock test shows."""
    starts = []

    async def judge(data_source, solution_str, ground_truth, extra_info=None):  # an async reward function
        starts.append(time.monotonic())
        return 1.0

    manager = RateLimitedRewardManager(
        tokenizer=char_tokenizer, compute_score=judge, max_concurrent=8, max_rpm=240
    )  # 4 requests/s, bucket of 4
    bucket = manager._shared_state.rpm_bucket
    assert (bucket.rate_limit, bucket.max_tokens) == (4.0, 4.0)
    charges = _record_charges(bucket)
    t0 = time.monotonic()
    reward = manager(make_batch(["1"] * 7, ["1"] * 7))
    offsets = sorted(s - t0 for s in starts)
    assert reward.sum() == 7.0
    assert charges == [1.0] * 7, charges
    for k in range(4, 7):  # 4 tokens at start, then one more every 0.25 s
        assert offsets[k] >= 0.25 * (k - 3) - 0.02, f"request {k} started at {offsets[k]:.3f} s: {offsets}"


def test_max_tpm_charges_the_estimated_tokens(char_tokenizer, make_batch):
    """600 tokens/min = 10/s, bucket of 10; each request costs 5: two at once, then one per 0.5 s.
    The charges are recorded; the real clock is held to lower bounds only (as above)."""
    starts = []

    def judge(data_source, solution_str, ground_truth, extra_info=None):
        starts.append(time.monotonic())
        return 0.0

    manager = RateLimitedRewardManager(
        tokenizer=char_tokenizer,
        compute_score=judge,
        max_concurrent=4,
        max_tpm=600,
        estimated_tokens_per_request=5,
    )
    bucket = manager._shared_state.tpm_bucket
    assert (bucket.rate_limit, bucket.max_tokens) == (10.0, 10.0)
    assert manager._shared_state.rpm_bucket is None
    charges = _record_charges(bucket)
    t0 = time.monotonic()
    manager(make_batch(["1"] * 4, ["1"] * 4))
    offsets = sorted(s - t0 for s in starts)
    assert charges == [5.0] * 4, charges
    assert offsets[2] >= 0.48 and offsets[3] >= 0.98, offsets


def test_timeouts_score_zero_and_errors_follow_on_error(char_tokenizer, make_batch):
    """The slow call waits on an event that is set only after the manager returned, so it times out
    whatever the machine's load; the fast call has the whole 1 s timeout to start and return 1.0
    (it was 0.2 s, against a 1 s sleep: both sides of the verdict depended on timing)."""
    release = threading.Event()

    def sometimes_slow(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "9":
            release.wait(timeout=60)
        if solution_str == "8":
            raise RuntimeError("judge API returned 500")
        return 1.0

    batch = make_batch(["1", "9"], ["1", "9"])
    manager = RateLimitedRewardManager(
        tokenizer=char_tokenizer, compute_score=sometimes_slow, max_concurrent=2, timeout=1.0
    )
    try:
        out = manager(batch, return_dict=True)
    finally:
        release.set()  # the timed-out call cannot be cancelled: let its thread finish
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0]
    assert out["reward_extra_info"]["reward_timeout"] == [0, 1]
    with pytest.raises(RewardFunctionError, match="judge API returned 500"):
        manager(make_batch(["8"], ["8"]))
    RateLimitedRewardManager.reset_shared_limits()
    lenient = RateLimitedRewardManager(
        tokenizer=char_tokenizer, compute_score=sometimes_slow, max_concurrent=2, timeout=1.0, on_error="zero"
    )
    out = lenient(make_batch(["8", "1"], ["8", "1"]), return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [0.0, 1.0] and out["reward_extra_info"]["reward_error"] == [1, 0]


def test_limits_from_upstream_config_are_shared_by_the_process(char_tokenizer):
    config = OmegaConf.create({"reward_model": {"max_concurrent": 3, "max_rpm": 120, "timeout": 30}})
    first = RateLimitedRewardManager(config, char_tokenizer)
    assert first.limits == {
        "max_concurrent": 3,
        "max_rpm": 120,
        "max_tpm": None,
        "estimated_tokens_per_request": 2000,
        "timeout": 30,
    }
    second = RateLimitedRewardManager(config, char_tokenizer)
    assert second._shared_state is first._shared_state and first._shared_state.rpm_bucket.rate_limit == 2.0
    with pytest.raises(ValueError, match="shared by the whole process"):
        RateLimitedRewardManager(config, char_tokenizer, max_rpm=60)
    with pytest.raises(NotImplementedError, match="router"):
        RateLimitedRewardManager(config, char_tokenizer, reward_router_address="127.0.0.1:1")
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['max_rps'\\]"):
        RateLimitedRewardManager(config, char_tokenizer, max_rps=1)


def test_selected_by_name_through_load_reward_manager(tmp_path, char_tokenizer, make_batch):
    from verl.trainer.ppo.reward import compute_reward, load_reward_manager

    path = tmp_path / "judge.py"
    path.write_text("async def judge(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    config = OmegaConf.create(
        {
            "data": {"reward_fn_key": "data_source"},
            "reward_model": {"reward_manager": "rate_limited", "reward_kwargs": {"max_concurrent": 2, "max_rpm": 600}},
            "custom_reward_function": {"path": str(path), "name": "judge"},
        }
    )
    manager = load_reward_manager(config, char_tokenizer, num_examine=0)
    assert isinstance(manager, RateLimitedRewardManager) and manager.limits["max_rpm"] == 600
    reward, extra = compute_reward(make_batch(["ab", "c"], ["1", "2"]), manager)
    assert reward.sum(-1).tolist() == [0.5, 0.5] and extra["reward_error"] == [0, 0]


def test_the_trainer_config_carries_the_limits_as_typed_reward_model_fields(char_tokenizer):
    from verl.trainer.config import load_ppo_config
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RewardModelConfig

    # upstream's YAML does not list these keys either: `+` adds them, the validator checks them
    config = load_ppo_config(
        ["reward_manager.name=rate_limited", "+reward_model.max_rpm=120", "+reward_model.max_concurrent=3"],
        config_name="arith_demo",
    )
    typed = omega_conf_to_dataclass(config.reward_model, RewardModelConfig)
    assert (typed.max_concurrent, typed.max_rpm, typed.max_tpm, typed.timeout) == (3, 120, None, 300.0)
    manager = load_reward_manager(config, char_tokenizer, num_examine=0)
    assert manager.limits == {
        "max_concurrent": 3,
        "max_rpm": 120,
        "max_tpm": None,
        "estimated_tokens_per_request": 2000,
        "timeout": 300.0,
    }
    assert manager._shared_state.rpm_bucket.rate_limit == 2.0  # 120 per minute
    with pytest.raises(ValueError, match=r"reward_model.max_rpm=-1 must be positive"):
        load_ppo_config(["+reward_model.max_rpm=-1"], config_name="arith_demo")


def test_keyword_limits_are_checked_as_the_section_fields_are(char_tokenizer):
    with pytest.raises(ValueError, match=r"reward_model.max_concurrent=0 must be a positive integer"):
        RateLimitedRewardManager(tokenizer=char_tokenizer, max_concurrent=0)
    with pytest.raises(ValueError, match=r"reward_model.timeout=0(\.0)? must be positive"):
        RateLimitedRewardManager(OmegaConf.create({"reward_model": {"timeout": 0}}), char_tokenizer)
