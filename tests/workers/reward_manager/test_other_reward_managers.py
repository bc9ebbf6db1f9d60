import os
import time

import pytest
import torch

from verl.workers.reward_manager import (
    AbstractRewardManager,
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
    RewardFunctionError,
    get_reward_manager_cls,
    register,
)

# ---------------------------------------------------------------------------------------- batch


def test_batch_manager_calls_the_function_once_with_lists(char_tokenizer, make_batch):
    calls = []

    def batched(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        calls.append((list(data_sources), list(solution_strs), list(ground_truths)))
        return [float(s == g) + bonus for s, g in zip(solution_strs, ground_truths)]

    data = make_batch(["1<eos>", "3<eos>"], ["1", "2"])
    reward = BatchRewardManager(char_tokenizer, 0, compute_score=batched, bonus=0.5)(data)
    assert calls == [(["arith", "arith"], ["1", "3"], ["1", "2"])]
    assert reward[:, 1].tolist() == [1.5, 0.5]


def test_batch_manager_without_function_uses_the_default_rules(char_tokenizer, make_batch):
    data = make_batch(["1<eos>", "3<eos>"], ["1", "2"])
    assert BatchRewardManager(char_tokenizer, 0)(data)[:, 1].tolist() == [1.0, 0.0]


def test_batch_manager_wrong_number_of_scores_is_an_error(char_tokenizer, make_batch):
    data = make_batch(["1<eos>", "3<eos>"], ["1", "2"])
    manager = BatchRewardManager(char_tokenizer, 0, compute_score=lambda **kw: [1.0])
    with pytest.raises(ValueError, match="returned 1 scores for 2 samples"):
        manager(data)


def test_batch_manager_failure_zeroes_and_flags_every_sample(char_tokenizer, make_batch):
    def broken(**kw):
        raise ConnectionError("judge unreachable")

    data = make_batch(["1<eos>", "3<eos>"], ["1", "2"])
    with pytest.raises(RewardFunctionError, match="judge unreachable"):
        BatchRewardManager(char_tokenizer, 0, compute_score=broken)(data)
    out = BatchRewardManager(char_tokenizer, 0, compute_score=broken, on_error="zero")(data, return_dict=True)
    assert out["reward_tensor"].sum() == 0 and out["reward_extra_info"]["reward_error"] == [1, 1]


# ---------------------------------------------------------------------------------------- dapo


def test_dapo_overlong_penalty_is_linear_in_the_buffer(char_tokenizer, make_batch):
    # max_resp_len 8, buffer 4: lengths <= 4 are free, 6 tokens lose 2/4 * 0.5, 8 tokens lose 0.5
    data = make_batch(["1<eos>", "11111<eos>", "1111111<eos>"], ["1", "11111", "1111111"])
    cfg = {"enable": True, "len": 4, "penalty_factor": 0.5, "log": True}
    manager = DAPORewardManager(char_tokenizer, 0, max_resp_len=8, overlong_buffer_cfg=cfg)
    out = manager(data, return_dict=True)
    expected = torch.zeros(3, 8)
    expected[0, 1] = 1.0
    expected[1, 5] = 1.0 - 0.25
    expected[2, 7] = 1.0 - 0.5
    assert torch.allclose(out["reward_tensor"], expected)
    assert out["reward_extra_info"]["overlong_reward"] == [0.0, -0.25, -0.5]
    assert out["reward_extra_info"]["overlong"] == [False, True, True]


def test_dapo_reports_a_bare_score_as_acc_before_the_penalty(char_tokenizer, make_batch):
    # upstream's rule: a number returned by the function is the sample's `acc` (DAPO's filter metric);
    # a dict reports its own keys
    data = make_batch(["1<eos>", "1111111<eos>"], ["1", "2"])
    cfg = {"enable": True, "len": 4, "penalty_factor": 0.5}
    out = DAPORewardManager(char_tokenizer, 0, max_resp_len=8, overlong_buffer_cfg=cfg)(data, return_dict=True)
    assert out["reward_extra_info"]["acc"] == [1.0, 0.0]  # scores before the -0.5 overlong penalty of row 1

    def scored(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "pred": solution_str}

    out = DAPORewardManager(char_tokenizer, 0, compute_score=scored)(data, return_dict=True)
    assert "acc" not in out["reward_extra_info"] and out["reward_extra_info"]["score"] == [0.5, 0.5]


def test_dapo_without_buffer_equals_naive(char_tokenizer, make_batch):
    data = make_batch(["1<eos>", "11111<eos>"], ["1", "2"])
    assert torch.equal(DAPORewardManager(char_tokenizer, 0)(data), NaiveRewardManager(char_tokenizer, 0)(data))


def test_dapo_buffer_configuration_errors(char_tokenizer):
    with pytest.raises(ValueError, match="needs max_resp_len"):
        DAPORewardManager(char_tokenizer, 0, overlong_buffer_cfg={"enable": True, "len": 4})
    with pytest.raises(ValueError, match="must be in"):
        DAPORewardManager(char_tokenizer, 0, max_resp_len=8, overlong_buffer_cfg={"enable": True, "len": 16})


# ---------------------------------------------------------------------------------------- prime


def _slow_on_hang(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        while True:  # pure-Python infinite loop: the worker's alarm interrupts it
            pass
    return float(solution_str == ground_truth)


def test_prime_matches_naive_and_times_out_hanging_samples(char_tokenizer, make_batch):
    data = make_batch(["1<eos>", "hang<eos>", "3<eos>", "2<eos>"], ["1", "1", "2", "2"])
    manager = PrimeRewardManager(char_tokenizer, 0, compute_score=_slow_on_hang, num_processes=2, timeout=0.5)
    start = time.monotonic()
    out = manager(data, return_dict=True)
    # a sample's alarm that never fired would hang forever; 60 s leaves room for starting the
    # processes on a loaded machine (the verdict is the timeout columns below, not the speed)
    assert time.monotonic() - start < 60
    assert out["reward_tensor"].sum(dim=1).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out["reward_extra_info"]["reward_timeout"] == [0, 1, 0, 0]
    assert out["reward_extra_info"]["reward_error"] == [0, 1, 0, 0]


def test_prime_runs_closures_and_reports_worker_errors(char_tokenizer, make_batch):
    offset = 0.25

    def closure(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "bad":
            raise KeyError("missing")
        return float(solution_str == ground_truth) + offset

    data = make_batch(["1<eos>", "bad<eos>"], ["1", "1"])
    out = PrimeRewardManager(char_tokenizer, 0, compute_score=closure, num_processes=2, on_error="zero")(
        data, return_dict=True
    )
    assert out["reward_tensor"].sum(dim=1).tolist() == [1.25, 0.0]
    with pytest.raises(RewardFunctionError, match="KeyError.*prime reward worker"):
        PrimeRewardManager(char_tokenizer, 0, compute_score=closure, num_processes=2)(data)


def test_prime_workers_die_on_sigterm_even_when_the_parent_catches_it(char_tokenizer, make_batch):
    """Inside a Ray process SIGTERM has a handler (Ray's failure handler, which can hang a forked
    child); forked pool workers would inherit it, and `Pool.terminate()` ends them with SIGTERM.
    The workers reset it: each sample scores 1 only if its worker has SIGTERM's default action."""
    import signal

    def sigterm_is_default(data_source, solution_str, ground_truth, extra_info=None):
        return float(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)

    data = make_batch(["1<eos>", "2<eos>"], ["1", "1"])
    manager = PrimeRewardManager(char_tokenizer, 0, compute_score=sigterm_is_default, num_processes=2)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a handler that does not exit
    try:
        reward = manager(data)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert reward.sum(dim=1).tolist() == [1.0, 1.0]


_FORKS = {"count": 0, "slow": False}


def _slow_second_fork_child():
    if _FORKS["slow"] and _FORKS["count"] == 2:
        time.sleep(2.0)  # the second pool worker is still starting when the work is done


def _count_fork():
    _FORKS["count"] += 1


os.register_at_fork(before=_count_fork, after_in_child=_slow_second_fork_child)


def test_prime_pool_ends_a_worker_signalled_while_it_is_still_starting(char_tokenizer, make_batch):
    """Worker 1 scores both samples while worker 2 is still starting; `Pool.terminate()` then sends
    worker 2 SIGTERM before its initializer has run. Under a parent SIGTERM handler that does not exit
    (Ray's, in a Ray process) the worker must still die, or the call never returns."""
    import signal
    import threading

    data = make_batch(["1<eos>", "2<eos>"], ["1", "1"])
    manager = PrimeRewardManager(char_tokenizer, 0, num_processes=2)
    done = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    _FORKS.update(count=0, slow=True)
    try:
        worker = threading.Thread(target=lambda: done.append(manager(data)), daemon=True)
        worker.start()
        worker.join(timeout=30)
    finally:
        _FORKS["slow"] = False
        signal.signal(signal.SIGTERM, previous)
    assert done, "the prime reward manager hung: a worker signalled while starting never exited"
    assert done[0].sum(dim=1).tolist() == [1.0, 0.0]


# ---------------------------------------------------------------------------------------- registry


def test_registry_has_upstream_names():
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    assert get_reward_manager_cls("batch") is BatchRewardManager
    assert get_reward_manager_cls("dapo") is DAPORewardManager
    assert get_reward_manager_cls("prime") is PrimeRewardManager


def test_unknown_manager_lists_the_registered_names():
    with pytest.raises(ValueError, match=r"^Unknown reward manager: navie .*'batch', 'dapo', 'naive', 'prime'"):
        get_reward_manager_cls("navie")


@pytest.fixture
def registry_restored():
    """The registry is process-wide: a name registered here would show in other tests (the config
    reference lists the registered managers)."""
    from verl.workers.reward_manager import REWARD_MANAGER_REGISTRY

    before = dict(REWARD_MANAGER_REGISTRY)
    yield
    REWARD_MANAGER_REGISTRY.clear()
    REWARD_MANAGER_REGISTRY.update(before)


def test_register_a_custom_manager_and_reject_name_clashes(registry_restored):
    @register("test_constant")
    class Constant(AbstractRewardManager):
        def compute_scores(self, samples):
            return [self.call_one(s) for s in samples]

    assert get_reward_manager_cls("test_constant") is Constant
    register("test_constant")(Constant)  # same class again: fine (modules re-imported in Ray workers)
    with pytest.raises(ValueError, match="already taken"):

        @register("naive")
        class Other(AbstractRewardManager):
            pass


# ------------------------------------------------------------------- parallel_compute_score_async


def _task_score(task, completion, reference, extra_info):
    if completion == "boom":
        raise ValueError("bad row")
    if completion == "slow":
        import time

        time.sleep(30)
    if task == "tuple":
        return (completion == reference, "extracted")
    return float(completion == reference) + (extra_info or 0)


def test_parallel_compute_score_async_scores_rows_positionally_with_zero_for_failures():
    import asyncio

    from verl.workers.reward_manager.prime import parallel_compute_score_async, run_reward_scoring

    completions = ["a", "b", "boom", "slow", "x"]
    references = ["a", "c", "a", "a", "x"]
    tasks = ["plain", "plain", "plain", "plain", "tuple"]
    scores = asyncio.run(
        parallel_compute_score_async(
            _task_score, completions, references, tasks, [0.5, 0.0, 0.0, 0.0, None], num_processes=3, timeout=1.0
        )
    )
    assert scores == [1.5, 0.0, 0.0, 0.0, 1.0]
    assert run_reward_scoring(_task_score, ["a"], ["a"], ["plain"], num_processes=1) == [1.0]
    with pytest.raises(ValueError, match="one of each per row"):
        asyncio.run(parallel_compute_score_async(_task_score, ["a"], [], ["plain"]))
