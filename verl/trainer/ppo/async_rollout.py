"""Generation that runs ahead of training, with bounded staleness (`async_training.*`).

`AsyncRolloutSource` is one of the trainer's rollout sources (the `RolloutSource` interface of
rollout_source.py, whose `next_batch` the step calls first), so the driver's step is not forked:
with `staleness_threshold=k >= 1` the batch a step trains on comes from a queue that a separate
rollout pool keeps filling. It meets the interface by its shape and imports nothing of
rollout_source.py, which chooses between the sources and so imports this module.

    k = 0   the synchronous colocated step (this module is not used)
    k = 1   one-step-off: batch t+1 is generated while the trainer trains on batch t
    k >= 2  generation may run up to k batches ahead of training
    s       a fraction (upstream's fully-async meaning): up to 1 + s batches generated per weight
            version; the stream of prompt groups is submitted up to group floor((p + 1 + s) * G)
            (G groups per batch, pool version p), so a batch may go out in two parts, the rest
            held back until the next sync (and checkpointed). Staleness is bounded by ceil(s).

Versions. The actor's weights after `s` updates are weight version `s`; step `t` trains with
version `t-1`. Every rollout worker stamps each sample with the version it generated it with
(`non_tensor_batch["weight_version"]`, set by the worker, never guessed by the driver). A sample's
staleness at step t is `(t-1) - weight_version`.

Sync schedule (`trigger_parameter_sync_step=N`, default 1). Step t pushes `v(t-1)` to the rollout
pool when `t-1` is a multiple of N, so between syncs the pool holds `p = N * floor((t-1)/N)`,
up to N-1 versions behind the trainer. Prompt batches are submitted behind the push, up to batch
`p + 1 + k`: batch b is then generated with a version >= b-1-k and its staleness at step b is at
most k, whatever N. So the bound stays the bound, and N trades lookahead for fewer syncs: right
after a sync generation runs k batches ahead, right before the next one k-N+1. N > k+1 would
leave the batch before a sync unreachable within the bound: a config error. With N=1 batch b is
generated with `max(0, b-1-k)`, staleness `min(k, b-1)`. The bound is checked again when a batch
is taken, and a group older than it (possible after a change of `k` on resume) is regenerated
with current weights (`stale_sample_policy=regenerate`, no prompt is lost) or dropped (`drop`).

Partial rollouts (`partial_rollout=true`; built-in engine and vLLM, multi-turn agent loops
included). A generation in flight when a push is announced is paused between two decode (engine)
steps, the worker takes the weights, and the unfinished samples go on from prompt + partial
response with them (see `HFRollout`, `vLLMRollout`, `AgentLoopRollout`). A sample's
`weight_version` is then its oldest token's version (staleness and the bound use it) and
`weight_version_max` its newest; `rollout_log_probs` hold each token's log-prob under the version
that sampled it, which is what the off-policy correction needs as behaviour policy.

Streaming. Each prompt batch is cut into group-aligned chunks, one request per rollout worker;
a chunk is scored (reward function) as soon as it is back, and the trainer takes whole groups in
the order they finished, as soon as `train_batch_size` groups are ready.

Off-policy correction (`async_training.off_policy_correction`):
- `decoupled` (default): the trainer recomputes `old_log_probs` with its current weights (the
  proximal policy); the PPO ratio is clipped against them and each token is weighted by
  min(pi_prox / pi_behav, C), the behaviour policy's log-probs being the rollout's own
  (`rollout.calculate_log_probs`, forced on) and C `actor.tis_imp_ratio_cap` (2 when unset).
- `tis`: no proximal pass: `old_log_probs` are the behaviour log-probs, so PPO's clipped ratio
  pi_theta / pi_behav is a truncated importance weight against the policy that generated the
  samples (one forward pass less per step; coarser when samples are stale).
- `none`: recompute `old_log_probs`, ignore the behaviour policy (a baseline to compare with).

Resume. A checkpoint waits for the generations in flight and saves every drawn-but-untrained
group (with its responses, scores and version tags) in `data.pt`, beside the dataloader position
that already counts them; resuming puts them back in the queue, so no sample is lost or trained
twice. The rollout pool then receives the checkpoint's weights before generating anything. The
checkpoint also records the schedule's pool version `p`: a run resumed between two syncs keeps
submitting up to batch `p + 1 + k` until the next sync, as the uninterrupted run does (every
batch within that window was already submitted before the checkpoint, so the checkpoint's newer
weights the restarted pool receives generate nothing but regenerated groups).

Validation keeps running on the trainer pool's own (hybrid) engine, with the current weights.
Not implemented: DAPO dynamic sampling / ReMax / KL-in-reward with `k >= 1`; partial rollouts for
SGLang; replaying partial rollouts identically on resume (where a generation is paused depends on
timing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omegaconf import open_dict

from verl.protocol import DataProto
from verl.trainer.ppo.generation import GEN_BATCH_KEYS, generation_input, with_generation
from verl.utils.logging_utils import get_logger
from verl.utils.timer import marked_timer
from verl.workers.rollout.base import runs_agent_loops

logger = get_logger(__name__, "INFO")

OFF_POLICY_CORRECTIONS = ("decoupled", "tis", "none")
STALE_SAMPLE_POLICIES = ("regenerate", "drop")
DEFAULT_IMP_RATIO_CAP = 2.0


def staleness_threshold(config) -> float:
    """`async_training.staleness_threshold` of a PPO config (null reads as 0: no async training)."""
    return float(config.async_training.staleness_threshold or 0)


def configure_off_policy_correction(config) -> None:
    """Set the keys the chosen correction needs (in place, before the workers are built)."""
    mode = config.async_training.off_policy_correction
    arc = config.actor_rollout_ref
    with open_dict(arc):
        if mode in ("decoupled", "tis"):
            arc.rollout.calculate_log_probs = True
        if mode == "decoupled" and not (arc.actor.tis_imp_ratio_cap or -1) > 0:
            arc.actor.tis_imp_ratio_cap = DEFAULT_IMP_RATIO_CAP


def importance_weight_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, cap: float | None
) -> dict[str, float]:
    """off_policy/is_weight_{mean,min,max} of pi_old / pi_rollout over valid tokens, and the fraction
    of tokens whose weight the cap truncates (`is_weight_truncated_frac`, when a cap is set)."""
    mask = response_mask.bool()
    log_w = (old_log_probs - rollout_log_probs)[mask]
    if log_w.numel() == 0:
        return {}
    w = torch.exp(log_w.clamp(max=20.0))
    out = {
        "off_policy/is_weight_mean": w.mean().item(),
        "off_policy/is_weight_min": w.min().item(),
        "off_policy/is_weight_max": w.max().item(),
    }
    if cap is not None and cap > 0:
        out["off_policy/is_weight_truncated_frac"] = (w > cap).float().mean().item()
    return out


@dataclass
class _Chunk:
    """One generation request: a group-aligned slice of a prompt batch sent to one rollout worker."""

    batch_index: int
    rows: DataProto  # the prompt rows, repeated n times, uid set (what the reward function reads)
    gen: DataProto  # what the rollout engine gets
    rank: int
    ref: Any = None
    output: DataProto | None = None
    seq: int = 0  # submission order: among finished chunks, the oldest is taken first


@dataclass
class _Stats:
    dropped_groups: int = 0
    regenerated_groups: int = 0
    num_syncs: int = 0
    extra: dict = field(default_factory=dict)


class AsyncRolloutSource:
    """The rollout source for `async_training.staleness_threshold >= 1` (see the module docstring).

    Built from explicit parts, never from the trainer:
    config: the composed config (async_training, actor_rollout_ref.rollout, data.train_batch_size).
    rollout_wg: the rollout-only worker group (a separate resource pool); actor_wg: the training
        worker group whose weights it pushes to the rollout pool.
    next_prompts: the prompt stream, `() -> DataProto` (one dataloader batch per call).
    score: the reward scorer, `(batch, state) -> batch` with token_level_scores set.
    tokenizer: for the rollout's eos/pad ids. current_step: `() -> int`, the trainer's step.
    total_steps: `() -> int`, the run's number of training steps (nothing is generated past it).
    """

    def __init__(self, config, rollout_wg, actor_wg, next_prompts, score, tokenizer, current_step, total_steps):
        cfg = config.async_training
        self.rollout_wg = rollout_wg
        self.actor_wg = actor_wg
        self.next_prompts = next_prompts
        self.score = score
        self.tokenizer = tokenizer
        self.current_step = current_step
        self.total_steps = total_steps
        # s batches ahead (a fraction: part of a batch); ceil(s) is the hard bound on a sample's staleness
        self.s = float(cfg.staleness_threshold)
        self.k = math.ceil(self.s)
        self.correction = cfg.off_policy_correction
        self.stale_policy = cfg.stale_sample_policy
        self.timeout_s = float(cfg.weight_sync_timeout_s)
        self.sync_every = int(cfg.trigger_parameter_sync_step or 1)
        self.partial_rollout = bool(cfg.partial_rollout)
        self.partial_check_steps = int(cfg.partial_rollout_check_steps or 8)
        rollout_cfg = config.actor_rollout_ref.rollout
        self.multi_turn = runs_agent_loops(rollout_cfg)  # the agent-loop columns go to the rollout
        self.bucket_mb = int(rollout_cfg.checkpoint_engine.update_weights_bucket_megabytes or 512)
        self.n = int(rollout_cfg.n)
        self.groups_per_step = int(config.data.train_batch_size)
        self.num_drawn = 0
        # Groups of drawn batches submitted so far, and the groups of the last drawn batch (batch
        # `num_drawn`) not yet submitted (a fractional staleness_threshold submits a batch in two parts).
        self.num_submitted_groups = 0
        self._held: DataProto | None = None
        self._seq = 0
        self._chunks: list[_Chunk] = []  # submitted, not yet scored
        self._ready: list[DataProto] = []  # scored, not yet trained (group-aligned)
        # The version the rollout pool holds by the sync schedule (checkpointed: it decides what is
        # submitted next), and the version this process last pushed (None until the first push).
        self._pool_version: int | None = None
        self._pushed_version: int | None = None
        self._receive_refs: list = []
        self._stats = _Stats()

    runs_ahead = True
    """Samples may come from older weights than the trained ones (see `RolloutSource`)."""

    # ------------------------------------------------------------------ the source
    def next_batch(self, state) -> DataProto:
        step = self.current_step()
        self._sync_weights(step, state)
        # Group g of batch b may be generated with the pool's version p only if its position in the
        # stream of groups is within (p + 1 + s) batches; for integer s: whole batches up to p + 1 + s.
        ahead = math.floor((self._pool_version + 1 + self.s) * self.groups_per_step + 1e-9)
        self._submit_groups_until(min(ahead, self.total_steps() * self.groups_per_step))
        with marked_timer("wait_rollout", state.timing):
            batch = self._take(step, state)
        state.metrics.update(self._metrics(batch, step))
        if self.correction == "tis":
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        return batch

    # ------------------------------------------------------------------ weights
    def _sync_weights(self, step: int, state) -> None:
        """Push the trainer's weights (version step-1) when the schedule says so: every
        `trigger_parameter_sync_step` updates, i.e. at steps whose version step-1 is a multiple of
        it. A run resumed between two syncs pushes too (its rollout pool restarted from the model
        path), but keeps the checkpoint's schedule version: what it submits next stays the same."""
        due = self.sync_every * ((step - 1) // self.sync_every)
        scheduled = self._pool_version is None or self._pool_version < due
        if not scheduled and self._pushed_version is not None:
            return
        with marked_timer("sync_weights", state.timing):
            self._push_weights(step - 1)
        if scheduled:
            self._pool_version = step - 1
            self._stats.num_syncs += 1

    def _push_weights(self, version: int) -> None:
        """Make `version` the rollout pool's weights for every request submitted from now on."""
        actor_wg = self.actor_wg
        if self._pushed_version is None:
            self._init_group(actor_wg)
        self._wait(self.rollout_wg, self._receive_refs, "receive_weights")
        # Returns once actor rank 0 holds its packed copy (in the rollout dtype). The broadcast
        # waits in the background until every rollout worker asks for it, on a stream of its
        # own, so the next update does not wait for the rollout pool (`verl.workers.weight_sync`).
        send = actor_wg.send_weights(version)
        # Queued behind the generations already submitted: those keep their older version.
        self._receive_refs = self.rollout_wg.receive_weights(version)
        self._wait(actor_wg, send, "send_weights")
        self._pushed_version = version

    def _init_group(self, actor_wg) -> None:
        host, port = next(a for a in actor_wg.host_weight_sync(self.timeout_s) if a is not None)
        world = 1 + self.rollout_wg.world_size
        args = (host, port, world, self.timeout_s, self.bucket_mb)
        refs = actor_wg.init_weight_sync(*args), self.rollout_wg.init_weight_sync(*args)
        self._wait(actor_wg, refs[0], "init_weight_sync")
        self._wait(self.rollout_wg, refs[1], "init_weight_sync")

    @staticmethod
    def _wait(wg, refs: list, method: str) -> list:
        return wg._wait(list(refs), ranks=list(range(len(refs))), role=wg.role, method=method) if refs else []

    # ------------------------------------------------------------------ generation requests
    def _submit_groups_until(self, limit: int) -> None:
        """Submit the stream of prompt groups (batch after batch, in dataloader order) up to group `limit`."""
        while self.num_submitted_groups < limit:
            if self._held is None:
                self.num_drawn += 1
                batch = self.next_prompts()
                uids = [f"{self.num_drawn}_{i}" for i in range(len(batch))]
                batch.non_tensor_batch["uid"] = np.array(uids, dtype=object)
                self._held = batch.repeat(repeat_times=self.n, interleave=True)
            held_groups = len(self._held) // self.n
            take = min(held_groups, limit - self.num_submitted_groups)
            if take == held_groups:
                part, self._held = self._held, None
            else:
                part = self._held.slice(0, take * self.n)
                self._held = self._held.slice(take * self.n, len(self._held))
            self._submit_groups(self.num_drawn, part)
            self.num_submitted_groups += take

    def _submit_next_batch(self) -> None:
        """Beyond the bound (everything queued was dropped as stale): the rest of the batch held back,
        else one more batch, generated with the pool's current weights."""
        more = len(self._held) // self.n if self._held is not None else self.groups_per_step
        self._submit_groups_until(self.num_submitted_groups + more)

    def _submit_groups(self, batch_index: int, rows: DataProto) -> None:
        """Cut group-aligned rows into one chunk per rollout worker and submit each."""
        num_groups = len(rows) // self.n
        workers = self.rollout_wg.world_size
        per_worker = -(-num_groups // workers)
        for w, start in enumerate(range(0, num_groups, per_worker)):
            part = rows.slice(start * self.n, min(num_groups, start + per_worker) * self.n)
            gen = generation_input(part, self.tokenizer, self.current_step(), self.multi_turn)
            gen.meta_info["global_steps"] = batch_index
            if self.partial_rollout:
                gen.meta_info["partial_rollout"] = True
                gen.meta_info["partial_rollout_check_steps"] = self.partial_check_steps
            rank = (batch_index + w) % workers  # rotate so no worker always gets the short tail chunk
            chunk = _Chunk(batch_index=batch_index, rows=part, gen=gen, rank=rank, seq=self._seq)
            self._seq += 1
            chunk.ref = self.rollout_wg.workers[rank]._verl_rpc.remote(self._generate_name(), gen)
            self._chunks.append(chunk)
            assert set(GEN_BATCH_KEYS) <= set(gen.batch.keys())

    def _generate_name(self) -> str:
        return self.rollout_wg.generate_sequences._remote_name

    def _finish_one(self, state) -> None:
        """Wait for the oldest finished chunk, score it, queue its groups for training."""
        import ray

        done = [c for c in self._chunks if c.output is not None]
        if not done:
            pending = [c.ref for c in self._chunks]
            # Everything already finished, not just the one `ray.wait` happens to report first: it
            # may report a later request before an earlier one that is also done.
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            if not ready:
                ready, _ = ray.wait(pending, num_returns=1, timeout=self.rollout_wg.timeout_s)
            if not ready:
                self._wait(self.rollout_wg, [self._chunks[0].ref], "generate_sequences")  # raises the timeout
            ready_ids = set(ready)
            finished = [c for c in self._chunks if c.ref in ready_ids]
            # A rollout worker runs its requests one at a time in submission order, so the older
            # requests of a worker that finished one are finished too: take them in that order.
            # This keeps which batch a step trains independent of timing (resume replays it).
            newest = {}
            for c in finished:
                newest[c.rank] = max(newest.get(c.rank, -1), c.seq)
            done = [c for c in self._chunks if c.seq <= newest.get(c.rank, -1)]
            for c in done:
                c.output = self._wait(self.rollout_wg, [c.ref], "generate_sequences")[0]
        chunk = min(done, key=lambda c: c.seq)
        self._chunks.remove(chunk)
        scored = self.score(with_generation(chunk.rows, chunk.output), state)
        scored.meta_info.pop("metrics", None)
        self._ready.append(scored)

    def _take(self, step: int, state) -> DataProto:
        """The first `train_batch_size` finished groups within the staleness bound."""
        need = self.groups_per_step * self.n
        while True:
            self._enforce_bound(step)
            if sum(len(b) for b in self._ready) >= need:
                break
            if not self._chunks:  # everything stale was dropped: draw fresh prompts
                self._submit_next_batch()
            self._finish_one(state)
        merged = DataProto.concat(self._ready) if len(self._ready) > 1 else self._ready[0]
        batch = merged.slice(0, need)
        self._ready = [merged.slice(need, len(merged))] if len(merged) > need else []
        return batch

    def _enforce_bound(self, step: int) -> None:
        kept = []
        for part in self._ready:
            stale = (step - 1) - part.non_tensor_batch["weight_version"] > self.k
            if not stale.any():
                kept.append(part)
                continue
            fresh = part.select_idxs(np.nonzero(~stale)[0]) if not stale.all() else None
            if fresh is not None:
                kept.append(fresh)
            old = part.select_idxs(np.nonzero(stale)[0])
            num_groups = len(old) // self.n
            if self.stale_policy == "regenerate":
                self._stats.regenerated_groups += num_groups
                batch_index = int(str(old.non_tensor_batch["uid"][0]).split("_")[0])
                self._submit_groups(batch_index, _prompt_rows(old))
            else:
                self._stats.dropped_groups += num_groups
        self._ready = kept

    # ------------------------------------------------------------------ metrics
    def _metrics(self, batch: DataProto, step: int) -> dict[str, float]:
        versions = batch.non_tensor_batch["weight_version"].astype(np.int64)
        newest = batch.non_tensor_batch.get("weight_version_max", versions).astype(np.int64)
        staleness = (step - 1) - versions  # by each sample's oldest token
        return {
            "async/staleness_mean": float(staleness.mean()),
            "async/staleness_max": float(staleness.max()),
            "async/staleness_min": float(staleness.min()),
            "async/weight_version_min": float(versions.min()),
            "async/weight_version_max": float(versions.max()),
            "async/staleness_threshold": self.s,
            "async/queued_batches": float(self.num_drawn - step),
            "async/dropped_stale_groups": float(self._stats.dropped_groups),
            "async/regenerated_stale_groups": float(self._stats.regenerated_groups),
            "async/weight_syncs": float(self._stats.num_syncs),
            "async/rollout_weight_version": float(self._pool_version),
            "async/mixed_version_frac": float((newest > versions).mean()),
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Every drawn-but-untrained group (waiting for the generations in flight)."""
        for c in self._chunks:
            if c.output is None:
                c.output = self._wait(self.rollout_wg, [c.ref], "generate_sequences")[0]
        return {
            "num_drawn": self.num_drawn,
            "num_submitted_groups": self.num_submitted_groups,
            "held": self._held,
            "ready": list(self._ready),
            "chunks": [(c.batch_index, c.rows, c.gen, c.rank, c.output, c.seq) for c in self._chunks],
            "stats": (self._stats.dropped_groups, self._stats.regenerated_groups),
            "pool_version": self._pool_version,
            "num_syncs": self._stats.num_syncs,
        }

    def load_state_dict(self, state: dict) -> None:
        self.num_drawn = int(state["num_drawn"])
        # older checkpoints (whole batches only): every drawn batch was submitted
        self.num_submitted_groups = int(state.get("num_submitted_groups", self.num_drawn * self.groups_per_step))
        self._held = state.get("held")
        self._ready = list(state["ready"])
        self._chunks = [
            _Chunk(batch_index=b, rows=rows, gen=gen, rank=rank, output=out, seq=seq)
            for b, rows, gen, rank, out, seq in state["chunks"]
        ]
        self._seq = 1 + max((c.seq for c in self._chunks), default=-1)
        self._stats.dropped_groups, self._stats.regenerated_groups = state["stats"]
        self._stats.num_syncs = int(state.get("num_syncs", 0))
        # None (an older checkpoint): sync at the first step, as a run without a schedule would.
        self._pool_version = state.get("pool_version")
        self._pushed_version = None  # the rollout pool restarts from the model path: push weights first


def _prompt_rows(scored: DataProto) -> DataProto:
    """The prompt side of scored rows (what `_submit_groups` needs to generate them again)."""
    prompts = scored.batch["prompts"]
    prompt_len = prompts.shape[1]
    tensors = {
        "input_ids": prompts,
        "attention_mask": scored.batch["attention_mask"][:, :prompt_len],
        "position_ids": scored.batch["position_ids"][..., :prompt_len],  # (B, L) or a VL model's (B, 4, L)
    }
    generated = {"weight_version", "weight_version_max", "token_level_scores", "token_level_rewards"}
    non_tensors = {k: v for k, v in scored.non_tensor_batch.items() if k not in generated}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
