"""What every rule-based reward manager shares: decode responses, score them, place the scores.

A reward manager turns a rollout batch (``DataProto`` with ``prompts`` [B,P], ``responses`` [B,R],
``attention_mask`` [B,P+R] and the non-tensor ``data_source`` / ``reward_model`` / ``extra_info``) into
``reward_tensor`` [B,R]: all zeros except the sample's score at its last valid response token, which is
where outcome-reward advantage estimators read it. Subclasses differ only in *how* the scores are
computed (``compute_scores``) and may post-process them (``adjust_scores``, e.g. DAPO's length penalty).

Design decisions:

- Responses are decoded from their valid tokens only (the response part of ``attention_mask``) with
  special tokens skipped, in one ``batch_decode`` call.
- ``compute_score`` may return a float or a dict with a ``"score"`` key; the dict's values are reported
  per sample in ``reward_extra_info`` (``None`` where a sample has no such key).
- ``compute_score`` may be ``async def`` (verl-recipe FAPO's ``compute_score_baseline``, which upstream's
  reward loop awaits): the batch's coroutines are awaited together on one event loop (on a helper
  thread when the calling thread already runs one), so their I/O overlaps; an exception raised inside
  one is that sample's error, as for a plain function.
- A reward function that raises, or returns NaN, infinity or a non-number, is handled by ``on_error``:
  ``"raise"`` (default) stops with the data source, ground truth and response of the failing sample, so
  the bug is fixed rather than trained on; ``"zero"`` scores the sample 0 and flags it in
  ``reward_extra_info["reward_error"]`` (one 0/1 per sample, always present) for the trainer to report
  as ``reward/num_errors``.
- A sample with no valid response token gets no reward (there is no token to carry it).
- ``rm_scores`` already in the batch (a reward model ran) are returned unchanged, as upstream does.
- What the rollout knows about a sample reaches the reward function in ``extra_info``, under upstream's
  keys and per manager as upstream's: ``rollout_reward_scores`` (the batch's ``reward_scores`` column,
  else ``{}``) for naive, batch and dapo (prime and rate_limited add nothing), ``num_turns`` (``__num_turns__``, the multi-turn
  rollout's messages per episode, else None) for naive, and the agent loop's per-episode fields
  (``tool_extra_fields``: ``tool_rewards``, ``turn_scores`` and a loop's own ``extra_fields``) for naive and
  rate_limited (``ROLLOUT_EXTRA_INFO``). A sample whose row has
  no ``extra_info`` gets a dict holding just those keys; the row's own dict is copied, not changed.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verl.utils.ray_utils import run_sync
from verl.utils.reward_score import default_compute_score

ON_ERROR_CHOICES = ("raise", "zero")
_RESPONSE_PREVIEW_CHARS = 500


@dataclass
class Sample:
    """One decoded response and what scoring it needs."""

    index: int
    data_source: Any
    solution_str: str
    ground_truth: Any
    extra_info: Any
    valid_response_length: int


def _with_rollout_info(extra_info, keys: tuple[str, ...], non_tensor, i: int):
    """The sample's ``extra_info`` with the rollout's ``keys`` added (module docstring)."""
    if not keys or not (extra_info is None or isinstance(extra_info, Mapping)):
        return extra_info
    extended = dict(extra_info or {})
    if "tool_extra_fields" in keys:  # the agent loop's per-episode fields (tool_rewards, turn_scores, ...)
        fields = non_tensor.get("tool_extra_fields")
        if fields is not None and isinstance(fields[i], Mapping):
            extended.update(fields[i])
    if "num_turns" in keys:
        num_turns = non_tensor.get("__num_turns__")
        extended["num_turns"] = None if num_turns is None else int(num_turns[i])
    if "rollout_reward_scores" in keys:
        scores = non_tensor.get("reward_scores")
        extended["rollout_reward_scores"] = {} if scores is None else scores[i]
    return extended


@dataclass
class ScoreOutcome:
    """What scoring one sample produced: a result, or an error message (with its exception), or a timeout."""

    result: Any = None
    error: str | None = None
    cause: BaseException | None = None
    timed_out: bool = False


def _await_coroutines(outcomes: list[ScoreOutcome]) -> list[ScoreOutcome]:
    """Outcomes whose result is a coroutine (an ``async def`` reward function) replaced by what it returns."""
    pending = [i for i, outcome in enumerate(outcomes) if inspect.iscoroutine(outcome.result)]
    if not pending:
        return outcomes

    async def gather():
        return await asyncio.gather(*(outcomes[i].result for i in pending), return_exceptions=True)

    results = run_sync(gather())
    outcomes = list(outcomes)
    for i, result in zip(pending, results):
        if isinstance(result, Exception):
            outcomes[i] = ScoreOutcome(error=f"{type(result).__name__}: {result}", cause=result)
        else:
            outcomes[i] = ScoreOutcome(result=result)
    return outcomes


def decode_samples(
    tokenizer, data, reward_fn_key: str = "data_source", rollout_keys: tuple[str, ...] = ()
) -> list[Sample]:
    """The rows of `data` as `Sample`s: each response decoded from its valid tokens (special tokens
    skipped), with its data source (the non-tensor column `reward_fn_key`), ground truth and
    `extra_info` (plus the rollout's `rollout_keys`, module docstring). Shared by the batch managers
    and the reward-loop classes (verl.experimental.reward_loop.reward_manager)."""
    batch, non_tensor, tensor_keys = data.batch, data.non_tensor_batch, _batch_keys(data)
    if "responses" not in tensor_keys:
        raise KeyError(f"the reward manager needs batch['responses']; the batch has {sorted(tensor_keys)}")
    for key in (reward_fn_key, "reward_model"):
        if key not in non_tensor:
            raise KeyError(
                f"the reward manager needs non_tensor_batch[{key!r}] but the batch only has {sorted(non_tensor)}; "
                f"make sure the dataset has a {key!r} column (see examples/data_preprocess) "
                + ("or set data.reward_fn_key" if key == reward_fn_key else "")
            )
    responses = batch["responses"]
    response_len = responses.shape[-1]
    if "attention_mask" in tensor_keys:
        response_mask = batch["attention_mask"][:, -response_len:]
    elif "response_mask" in tensor_keys:
        response_mask = batch["response_mask"]
    else:
        raise KeyError("the reward manager needs batch['attention_mask'] or batch['response_mask']")
    lengths = response_mask.sum(dim=-1).tolist()
    texts = tokenizer.batch_decode(
        [responses[i, : int(n)].tolist() for i, n in enumerate(lengths)], skip_special_tokens=True
    )
    extra_infos = non_tensor.get("extra_info")
    samples = []
    for i, text in enumerate(texts):
        reward_model = non_tensor["reward_model"][i]
        if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
            raise ValueError(
                f"sample {i}: reward_model must be a dict with a 'ground_truth' key, got {reward_model!r}; "
                "see examples/data_preprocess for the expected schema"
            )
        samples.append(
            Sample(
                index=i,
                data_source=non_tensor[reward_fn_key][i],
                solution_str=text,
                ground_truth=reward_model["ground_truth"],
                extra_info=_with_rollout_info(
                    None if extra_infos is None else extra_infos[i], rollout_keys, non_tensor, i
                ),
                valid_response_length=int(lengths[i]),
            )
        )
    return samples


def score_and_details(result) -> tuple[float, dict]:
    """A reward function's result as (score, its per-sample details): a finite number, or a dict with a
    finite number under "score" (the dict is the details). A TypeError / ValueError says what is wrong."""
    details = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"the reward function returned a dict without a 'score' key: {dict(result)!r}")
        details = dict(result)
        result = result["score"]
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        result = result.item()
    if isinstance(result, bool) or not isinstance(result, numbers.Real):
        raise TypeError(f"the reward function returned {result!r} ({type(result).__name__}), not a number")
    score = float(result)
    if not math.isfinite(score):
        raise ValueError(f"the reward function returned a non-finite score {score}")
    return score, details


class RewardFunctionError(RuntimeError):
    """A reward function failed on a sample and ``on_error="raise"``."""


def _batch_keys(data) -> set[str]:
    return set() if data.batch is None else set(data.batch.keys())


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", None) or repr(fn)


class AbstractRewardManager:
    """Base class: subclasses implement ``compute_scores`` (and optionally ``adjust_scores``).

    Args:
        tokenizer: decodes the response tokens.
        num_examine: how many samples per data source to print (prompt, response, ground truth, score).
        compute_score: ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``;
            defaults to ``verl.utils.reward_score.default_compute_score``.
        reward_fn_key: the non-tensor column naming each sample's data source.
        on_error: "raise" or "zero" (see the module docstring).
    """

    ROLLOUT_EXTRA_INFO: tuple[str, ...] = ("rollout_reward_scores",)
    """The rollout's per-sample values added to ``extra_info`` (module docstring)."""

    def __init__(
        self,
        tokenizer,
        num_examine: int,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        on_error: str = "raise",
    ):
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(
                f"on_error={on_error!r} is not one of {list(ON_ERROR_CHOICES)} (custom_reward_function.on_error)"
            )
        self.tokenizer = tokenizer
        self.num_examine = int(num_examine)
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.on_error = on_error

    # ----------------------------------------------------------------------------------------------
    # subclass hooks
    def compute_scores(self, samples: list[Sample]) -> list[ScoreOutcome]:
        raise NotImplementedError

    def adjust_scores(self, samples: list[Sample], scores: list[float], extra_info: dict[str, list]) -> list[float]:
        """Post-process the per-sample scores (default: unchanged)."""
        return scores

    # ----------------------------------------------------------------------------------------------
    def call_one(self, sample: Sample) -> ScoreOutcome:
        """Score one sample with ``compute_score``, capturing an exception as an error outcome."""
        try:
            return ScoreOutcome(
                result=self.compute_score(
                    data_source=sample.data_source,
                    solution_str=sample.solution_str,
                    ground_truth=sample.ground_truth,
                    extra_info=sample.extra_info,
                )
            )
        except Exception as e:
            return ScoreOutcome(error=f"{type(e).__name__}: {e}", cause=e)

    def __call__(self, data, return_dict: bool = False):
        if "rm_scores" in _batch_keys(data):
            rm_scores = data.batch["rm_scores"]
            return {"reward_tensor": rm_scores, "reward_extra_info": {}} if return_dict else rm_scores

        samples = self.decode(data)
        outcomes = self.compute_scores(samples)
        if len(outcomes) != len(samples):
            raise RuntimeError(f"{type(self).__name__} produced {len(outcomes)} scores for {len(samples)} samples")
        outcomes = _await_coroutines(outcomes)
        scores, extra_info = self._collect(samples, outcomes)
        scores = self.adjust_scores(samples, scores, extra_info)

        responses = data.batch["responses"]
        reward_tensor = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        for sample, score in zip(samples, scores):
            if sample.valid_response_length > 0:
                reward_tensor[sample.index, sample.valid_response_length - 1] = score
        self._print_examples(data, samples, scores)
        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": dict(extra_info)}
        return reward_tensor

    # ----------------------------------------------------------------------------------------------
    def decode(self, data) -> list[Sample]:
        """The batch's responses (valid tokens, special tokens skipped) with their scoring inputs."""
        return decode_samples(self.tokenizer, data, self.reward_fn_key, self.ROLLOUT_EXTRA_INFO)

    def _collect(self, samples: list[Sample], outcomes: list[ScoreOutcome]) -> tuple[list[float], dict[str, list]]:
        n = len(samples)
        scores = [0.0] * n
        extra_info: dict[str, list] = defaultdict(lambda: [None] * n)
        extra_info["reward_error"] = [0] * n
        for sample, outcome in zip(samples, outcomes):
            i = sample.index
            if outcome.timed_out:
                extra_info["reward_timeout"][i] = 1
                extra_info["reward_error"][i] = 1
                continue
            if outcome.error is None:
                try:
                    scores[i], details = self._validate(outcome.result)
                except (TypeError, ValueError) as e:
                    outcome = ScoreOutcome(error=str(e), cause=e)
                else:
                    for key, value in details.items():
                        extra_info[key][i] = value
                    continue
            if self.on_error == "raise":
                raise RewardFunctionError(self._describe_failure(sample, outcome.error, n)) from outcome.cause
            extra_info["reward_error"][i] = 1
        if "reward_timeout" in extra_info:
            extra_info["reward_timeout"] = [v or 0 for v in extra_info["reward_timeout"]]
        return scores, extra_info

    @staticmethod
    def _validate(result) -> tuple[float, dict]:
        return score_and_details(result)

    def _describe_failure(self, sample: Sample, error: str, batch_size: int) -> str:
        response = sample.solution_str
        if len(response) > _RESPONSE_PREVIEW_CHARS:
            response = response[:_RESPONSE_PREVIEW_CHARS] + f"... ({len(sample.solution_str)} chars)"
        return (
            f"reward function {_fn_name(self.compute_score)} failed on sample {sample.index} of {batch_size}: {error}\n"
            f"  data_source: {sample.data_source!r}\n"
            f"  ground_truth: {sample.ground_truth!r}\n"
            f"  response: {response!r}\n"
            "Fix the reward function (custom_reward_function.path), or set custom_reward_function.on_error=zero "
            "to score such samples 0 and count them in reward/num_errors."
        )

    def _print_examples(self, data, samples: list[Sample], scores: list[float]) -> None:
        if self.num_examine <= 0:
            return
        printed: dict[Any, int] = defaultdict(int)
        tensor_keys = _batch_keys(data)
        prompts = data.batch["prompts"] if "prompts" in tensor_keys else None
        for sample, score in zip(samples, scores):
            if printed[sample.data_source] >= self.num_examine:
                continue
            printed[sample.data_source] += 1
            if prompts is not None:
                prompt_ids = prompts[sample.index]
                if "attention_mask" in tensor_keys:
                    prompt_ids = prompt_ids[data.batch["attention_mask"][sample.index, : prompts.shape[-1]].bool()]
                print("[prompt]", self.tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True))
            print("[response]", sample.solution_str)
            print("[ground_truth]", sample.ground_truth)
            print("[score]", score)
