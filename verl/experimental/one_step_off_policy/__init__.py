"""Upstream's one-step-off-policy entry point: `python -m verl.experimental.one_step_off_policy.main_ppo`
with its configs (`config/one_step_off_ppo[_megatron]_trainer.yaml`); it runs verl's asynchronous
training (verl/trainer/config/async_recipes.py, docs/async.md)."""
