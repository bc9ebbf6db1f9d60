"""A trainer written the way verl-recipe's trainers are written against upstream's `RayPPOTrainer`
(DAPO's, the entropy recipe's): a subclass that replaces `fit()` with its own loop over the
dataloader and builds each step from upstream's trainer surface only (`_get_gen_batch`,
`async_rollout_manager`, `compute_reward`, `_balance_batch`, `_compute_old_log_prob`,
`compute_advantage`, `_update_actor`, `_validate`, `_save_checkpoint`). Our own code, not a recipe's:
it exercises the names and return values such a loop relies on, and keeps what each step saw for
the test to check against independent references.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from verl import DataProto
from verl.trainer.main_ppo import TaskRunner
from verl.trainer.ppo.core_algos import agg_loss
from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_timing_metrics
from verl.trainer.ppo.ray_trainer import AdvantageEstimator, RayPPOTrainer, compute_advantage, compute_response_mask
from verl.trainer.ppo.reward import compute_reward
from verl.utils.metric import reduce_metrics
from verl.utils.timer import marked_timer


class RecipeStyleTrainer(RayPPOTrainer):
    """GRPO with its own loop; `self.seen` keeps each step's trained batch, the actor's log-probs of
    it before the update and after it, and the step's metrics."""

    def fit(self):
        from verl.utils.tracking import Tracking

        tracker = Tracking(
            project_name=self.config.trainer.project_name,
            experiment_name=self.config.trainer.experiment_name,
            default_backend=self.config.trainer.logger,
            config=self.config,
        )
        self.seen: list[dict] = []
        self.global_steps = 0
        self._load_checkpoint()
        self.global_steps += 1
        n = self.config.actor_rollout_ref.rollout.n
        for batch_dict in self.train_dataloader:
            metrics, timing_raw = {}, defaultdict(float)
            new_batch = DataProto.from_single_dict(batch_dict)
            new_batch.non_tensor_batch["uid"] = np.array([f"p{i}" for i in range(len(new_batch))], dtype=object)
            gen_batch = self._get_gen_batch(new_batch).repeat(repeat_times=n, interleave=True)
            with marked_timer("step", timing_raw):
                with marked_timer("gen", timing_raw):
                    gen_output = self.async_rollout_manager.generate_sequences(gen_batch)
                    timing_raw.update(gen_output.meta_info.pop("timing"))
                batch = new_batch.repeat(repeat_times=n, interleave=True).union(gen_output)
                batch.batch["response_mask"] = compute_response_mask(batch)
                reward_tensor, _ = compute_reward(batch, self.reward_fn)
                batch.batch["token_level_scores"] = reward_tensor
                batch.batch["token_level_rewards"] = reward_tensor
                self._balance_batch(batch, metrics=metrics)
                batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
                with marked_timer("old_log_prob", timing_raw):
                    old_log_prob, _mfu = self._compute_old_log_prob(batch)
                    entropy = agg_loss(old_log_prob.batch.pop("entropys"), batch.batch["response_mask"], "token-mean")
                    metrics["actor/entropy"] = entropy.item()
                    batch = batch.union(old_log_prob)
                with marked_timer("adv", timing_raw):
                    batch = compute_advantage(
                        batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=n, norm_adv_by_std_in_grpo=True
                    )
                with marked_timer("update_actor", timing_raw):
                    metrics.update(reduce_metrics(self._update_actor(batch).meta_info["metrics"]))
                after, _ = self._compute_old_log_prob(batch)
            self.seen.append({"batch": batch, "after": after.batch["old_log_probs"].clone(), "metrics": metrics})
            metrics.update(compute_data_metrics(batch=batch, use_critic=False))
            metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing_raw))
            tracker.log(data=metrics, step=self.global_steps)
            if self.global_steps >= self.total_training_steps:
                self._save_checkpoint()
                metrics.update(self._validate())
                return metrics
            self.global_steps += 1


def grpo_reference(scores: torch.Tensor, uids, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's per-sequence advantage in float64, by hand: (score - group mean) / (group std + eps),
    the unbiased std; a group of one keeps its score (mean 0, std 1, upstream's rule)."""
    scores = scores.double()
    out = torch.zeros_like(scores)
    for uid in set(uids):
        rows = [i for i, u in enumerate(uids) if u == uid]
        group = scores[rows]
        mean, std = (group.mean(), group.std(unbiased=True)) if len(rows) > 1 else (0.0, 1.0)
        out[rows] = (group - mean) / (std + eps)
    return out


class FinishedTaskRunner(TaskRunner):
    """A recipe's `TaskRunner` whose `run` returns at once (what `run_ppo` hands it back is checked)."""

    def run(self, config):
        return {"runner": type(self).__name__, "steps": int(config.trainer.total_training_steps)}
