"""Upstream's fully-asynchronous entry point: `python -m verl.experimental.fully_async_policy.fully_async_main`
with its configs (`config/fully_async_ppo[_megatron]_trainer.yaml`); it runs verl's asynchronous training
with upstream's keys translated (verl/trainer/config/async_recipes.py, docs/async.md)."""
