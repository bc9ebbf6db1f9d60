"""The driver's validator: when to validate, and one pass over the validation set.

A component the training loop calls (`validator.should_validate(step, is_last)`,
`validator.run(step)`), built from explicit parts: the validation dataloader, the validation
reward function, the rollout worker group that generates, the tokenizer and the config sections
it reads (`trainer.test_freq`, `trainer.val_before_train`, `trainer.val_only`,
`trainer.validation_data_dir`, `actor_rollout_ref.rollout.val_kwargs`). It never sees the trainer
object.

Every validation prompt is generated `val_kwargs.n` times (greedy unless `val_kwargs.do_sample`)
and scored; the metrics are upstream's `val-core/...`/`val-aux/...` names per data source. With
`trainer.validation_data_dir` set, each pass also writes `<dir>/<step>.jsonl`, one line per sample
with upstream's fields (input, output, gts, score, step, and the reward function's per-sample
extra values). With `trainer.log_val_generations` > 0 the pass keeps its (input, output, score) texts in
`last_samples` for the trainer to log that many of them to the trackers (upstream's
`_maybe_log_val_generations`).
"""

from __future__ import annotations

import numpy as np

from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from verl.trainer.ppo.generation import generation_input, with_generation
from verl.trainer.ppo.metric_utils import flatten_validation_metrics, process_validation_metrics
from verl.trainer.ppo.step_records import dump_generations
from verl.workers.rollout.base import runs_agent_loops


def due(freq: int, step: int, is_last: bool) -> bool:
    """Whether a periodic action (test_freq, save_freq; <= 0 disables) runs at `step`."""
    return freq > 0 and (is_last or step % freq == 0)


class Validator:
    """Validation as a component; see the module docstring.

    dataloader / reward_fn: the validation data and its reward function; either None disables
        validation. generator: the rollout worker group (`generate_sequences`, `world_size`).
    """

    def __init__(self, trainer_cfg, rollout_cfg, dataloader, reward_fn, generator, tokenizer):
        self.trainer_cfg = trainer_cfg
        self.rollout_cfg = rollout_cfg
        self.dataloader = dataloader
        self.reward_fn = reward_fn
        self.generator = generator
        self.tokenizer = tokenizer
        self.last_samples: tuple[list, list, list] | None = None  # (inputs, outputs, scores) of the last pass

    @property
    def enabled(self) -> bool:
        return self.dataloader is not None and self.reward_fn is not None

    def should_validate_before_training(self) -> bool:
        return self.enabled and self.trainer_cfg.val_before_train

    def should_validate(self, step: int, is_last: bool) -> bool:
        return self.enabled and due(self.trainer_cfg.test_freq, step, is_last)

    def run(self, step: int) -> dict[str, float]:
        """Generate for every validation prompt (val_kwargs.n samples) and score; the metrics."""
        val_kwargs = self.rollout_cfg.val_kwargs
        n = val_kwargs.n
        multi_turn = runs_agent_loops(self.rollout_cfg)
        sources, uids, infos = [], [], {"reward": [], "acc": []}
        extra_infos: dict[str, list] = {}
        dp = self.generator.world_size
        dump_dir = self.trainer_cfg.get("validation_data_dir")
        keep_texts = bool(dump_dir) or self.trainer_cfg.get("log_val_generations", 0) > 0
        samples: dict[str, list] = {"input": [], "output": [], "gts": []}
        reported_acc = False
        for batch_dict in self.dataloader:
            batch = DataProto.from_single_dict(batch_dict)
            batch.non_tensor_batch["uid"] = np.array([f"val_{len(uids)}_{i}" for i in range(len(batch))], dtype=object)
            gen = generation_input(
                batch, self.tokenizer, step, multi_turn, validate=True, do_sample=val_kwargs.do_sample
            )
            gen = gen.repeat(repeat_times=n, interleave=True)
            gen, pad = pad_dataproto_to_divisor(gen, dp)
            out = unpad_dataproto(self.generator.generate_sequences(gen), pad)
            batch = with_generation(batch.repeat(repeat_times=n, interleave=True), out)
            result = self.reward_fn(batch, return_dict=True)
            scores = result["reward_tensor"].sum(-1).tolist()
            extra = result.get("reward_extra_info", {})
            infos["reward"].extend(scores)
            infos["acc"].extend(extra.get("acc", scores))
            reported_acc = reported_acc or "acc" in extra
            for key, values in extra.items():
                if key != "acc" and len(values) == len(batch):
                    extra_infos.setdefault(key, []).extend(values)
            sources.extend(batch.non_tensor_batch.get("data_source", np.array(["unknown"] * len(batch))).tolist())
            uids.extend(batch.non_tensor_batch["uid"].tolist())
            if keep_texts:
                samples["input"].extend(self.tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True))
                samples["output"].extend(
                    self.tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
                )
                rm = batch.non_tensor_batch.get("reward_model", [None] * len(batch))
                samples["gts"].extend((r or {}).get("ground_truth") for r in rm)
        if dump_dir:
            columns = {**samples, "score": infos["reward"], **extra_infos}
            if reported_acc:
                columns["acc"] = infos["acc"]
            dump_generations(dump_dir, step, columns)
        self.last_samples = (samples["input"], samples["output"], list(infos["reward"])) if keep_texts else None
        infos.update(extra_infos)
        nested = process_validation_metrics(np.array(sources, dtype=object), np.array(uids, dtype=object), infos)
        return flatten_validation_metrics(nested)
