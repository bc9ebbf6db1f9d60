"""A custom reward loop class (upstream's `reward_model.reward_loop_source=importlib`) as a reward manager.

Upstream's reward loop scores each sample with a reward-loop manager: a class built as
`cls(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)` whose
coroutine `run_single(data)` takes a one-row DataProto and returns
`{"reward_score": float, "reward_extra_info": {name: value}}` (upstream's
`verl.experimental.reward_loop.reward_manager.base.RewardManagerBase`, which this package provides
under the same path). With `reward_loop_source=importlib` the class is
`reward_loop_class_name` of the file `reward_loop_module_path`.

Here rule rewards are computed by the driver's reward manager, so `RewardLoopManager` is that
manager for a custom loop class: it runs `run_single` on every row of the batch concurrently, in an
event loop of its own, and places each `reward_score` at the sample's last valid response token
like every other manager (abstract.py), with the extra info reported per sample and a failing or
malformed result handled by `custom_reward_function.on_error`.

Design decisions:
- The class and its interface are checked when the manager is built (a missing file or class, a
  class without a coroutine `run_single`, a constructor that does not take upstream's five
  arguments: one error each, naming the key to fix); the instance is built on first use, inside the
  manager's event loop, because upstream's base class keeps the loop it was built in
  (`self.loop`) to run blocking work in an executor, and the manager may be shipped to another
  process (`launch_reward_fn_async`) before it scores anything.
- `reward_router_address` and `reward_model_tokenizer` are None, except with `reward_model.enable` and a
  custom reward function: the generative reward model's servers (verl/experimental/reward_loop/reward_model.py)
  are then handed to the class, as upstream's reward loop does. `reward_model.enable` without a custom
  function is refused with a custom loop (upstream then scores with the discriminative model and never
  calls the loop).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping

from verl.workers.reward_manager.abstract import AbstractRewardManager, Sample, ScoreOutcome

_KEYS = "reward_model.reward_loop_module_path / reward_loop_class_name"


def check_reward_loop_class(cls, where: str) -> None:
    """Raise a TypeError naming `where` when `cls` does not have upstream's reward-loop interface."""
    if not isinstance(cls, type):
        raise TypeError(f"{where} is a {type(cls).__name__}, not a class; point {_KEYS} at a reward-loop class")
    run_single = getattr(cls, "run_single", None)
    if run_single is None or not inspect.iscoroutinefunction(run_single):
        raise TypeError(
            f"{where} ({cls.__name__}) has no coroutine `async def run_single(self, data)`: a reward loop scores one "
            "sample per call and returns {'reward_score': float, 'reward_extra_info': dict} (upstream's "
            "verl.experimental.reward_loop.reward_manager.base.RewardManagerBase)"
        )
    if getattr(run_single, "__isabstractmethod__", False):
        raise TypeError(f"{where} ({cls.__name__}) leaves run_single abstract; implement it")
    try:
        inspect.signature(cls).bind(None, None, None, None, None)
    except TypeError as err:
        raise TypeError(
            f"{where} ({cls.__name__}) cannot be built as upstream builds a reward loop, "
            "cls(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer): "
            f"{err}"
        ) from err


def load_reward_loop_class(reward_model) -> type:
    """The class ``reward_model.reward_loop_class_name`` of the file ``reward_loop_module_path``
    (``reward_loop_source=importlib``; `reward_model` the typed RewardModelConfig), checked for upstream's
    reward-loop interface."""
    from verl.utils.import_utils import _public_callables, load_module

    path, name = reward_model.reward_loop_module_path, reward_model.reward_loop_class_name
    module = load_module(path, config_key="reward_model.reward_loop_module_path")
    if not hasattr(module, name):
        raise AttributeError(
            f"reward_model.reward_loop_class_name={name!r} is not defined in reward_model.reward_loop_module_path="
            f"{path!r}; the file defines: {_public_callables(module)}. Set reward_loop_class_name to the reward "
            "loop class"
        )
    cls = getattr(module, name)
    check_reward_loop_class(cls, f"reward_model.reward_loop_class_name={name!r} in {path!r}")
    return cls


class RewardLoopManager(AbstractRewardManager):
    """Scores a batch with a custom reward loop class (see the module docstring).

    loop_cls: the class (checked with `check_reward_loop_class`). config: the trainer config, handed
    to the class as upstream does. compute_score: the custom reward function (None: the class's own
    default), handed to the class. reward_model: with a generative reward model served to the custom
    function, an object whose `get()` returns `{"reward_router_address", "reward_model_tokenizer"}`
    (verl.experimental.reward_loop.reward_model), handed to the class too; None: both None.
    """

    def __init__(
        self, loop_cls, config, tokenizer, num_examine: int = 0, compute_score=None, reward_model=None, **kwargs
    ):
        check_reward_loop_class(loop_cls, "the reward loop class")
        super().__init__(tokenizer, num_examine, compute_score=None, **kwargs)
        self.loop_cls = loop_cls
        self.config = config
        self.custom_compute_score = compute_score
        self.reward_model = reward_model
        self._event_loop = None
        self._instance = None
        self._data = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_event_loop=None, _instance=None, _data=None)  # rebuilt where it is used
        return state

    def __call__(self, data, return_dict: bool = False):
        self._data = data
        try:
            return super().__call__(data, return_dict=return_dict)
        finally:
            self._data = None

    def compute_scores(self, samples: list[Sample]) -> list[ScoreOutcome]:
        loop = self._loop()
        rows = [self._data[s.index : s.index + 1] for s in samples]
        return loop.run_until_complete(self._score_all(rows))

    async def _score_all(self, rows) -> list[ScoreOutcome]:
        return list(await asyncio.gather(*(self._score(row) for row in rows)))  # gathered inside the loop

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self._event_loop is None:
            self._event_loop = asyncio.new_event_loop()
            # built inside the loop: upstream's base class keeps the loop it is built in
            self._instance = self._event_loop.run_until_complete(self._build())
        return self._event_loop

    async def _build(self):
        served = self.reward_model.get() if self.reward_model is not None else {}
        return self.loop_cls(
            self.config,
            self.tokenizer,
            self.custom_compute_score,
            served.get("reward_router_address"),
            served.get("reward_model_tokenizer"),
        )

    def _describe_failure(self, sample: Sample, error: str, batch_size: int) -> str:
        return (
            f"reward loop {self.loop_cls.__name__} (reward_model.reward_loop_class_name) failed on sample "
            f"{sample.index} of {batch_size}: {error}\n"
            f"  data_source: {sample.data_source!r}\n"
            f"  ground_truth: {sample.ground_truth!r}\n"
            f"  response: {sample.solution_str[:500]!r}\n"
            "Fix its run_single (reward_model.reward_loop_module_path), or set custom_reward_function.on_error=zero "
            "to score such samples 0 and count them in reward/num_errors."
        )

    async def _score(self, row) -> ScoreOutcome:
        try:
            result = await self._instance.run_single(row)
        except Exception as e:
            return ScoreOutcome(error=f"{self.loop_cls.__name__}.run_single raised {type(e).__name__}: {e}", cause=e)
        if not isinstance(result, Mapping) or "reward_score" not in result:
            return ScoreOutcome(
                error=f"{self.loop_cls.__name__}.run_single returned {result!r}, not a dict with a 'reward_score' key"
            )
        extra = result.get("reward_extra_info") or {}
        return ScoreOutcome(result={**extra, "score": result["reward_score"]})
