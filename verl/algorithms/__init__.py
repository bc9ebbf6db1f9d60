"""The math of PPO-family RL post-training, as a layer the workers and the trainer both import.

Layering (checked by tests/test_layers.py): this package sits above `verl.utils` and
`verl.protocol` and below `verl.workers` and `verl.trainer`; it imports neither of those, so an
actor or critic can compute its loss without pulling in the driver.

Modules, one concern each:

- `aggregation`: `agg_loss` and `LOSS_AGG_MODES` (`*.loss_agg_mode`).
- `advantages`: the advantage estimators and their table `ADV_ESTIMATORS` (`algorithm.adv_estimator`),
  PF-PPO reweighting.
- `policy_losses`: the policy losses, `PolicyLossParams`, their table `POLICY_LOSSES`
  (`actor.policy_loss.loss_mode`) and their shared ending `finish_policy_loss`.
- `value_losses`: the critic's clipped value loss, the entropy bonus, explained variance.
- `kl`: KL estimators, the in-reward penalty, the KL loss and the KL controllers.
- `rollout_corr`: rollout correction (importance weights and rejection against the rollout
  engine's log-probs); upstream's import path `verl.trainer.ppo.rollout_corr_helper` re-exports it.
- `dapo`: DAPO's overlong reward shaping and dynamic-sampling group filter.

Design decisions shared by all of them:

- Pure functions of tensors and plain numbers. No config objects, no torch.distributed, no
  `.item()`: callers read their config and pass numbers in. Everything runs on CPU and GPU
  unchanged and is tested on CPU against float64 references computed another way.
- Variants are chosen by upstream verl's config names through explicit tables; an unknown name
  raises an error listing the valid ones.
- Public names and signatures follow upstream, and `verl.trainer.ppo.core_algos` (upstream's
  import path) re-exports every one of them: the tables are the same dict objects, so a user's
  `register_adv_est` / `register_policy_loss` through either path reaches the same registry.
  Deliberate differences from upstream: losses return a metrics dict;
  `seq-mean-token-sum-norm` divides by the number of sequences as well (Dr. GRPO's 1/G); fully
  padded responses are left out of the `seq-mean-*` means; `grpo_passk` gives a one-response
  group zero advantage instead of raising.

The package imports none of its modules eagerly, so `import verl.algorithms.kl` stays cheap.
Formulas and papers for every option: docs/algorithms.md.
"""
