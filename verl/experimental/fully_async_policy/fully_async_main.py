"""`python -m verl.experimental.fully_async_policy.fully_async_main [--config-name=...] key=value ...`:
upstream's fully-asynchronous trainer, run as main_ppo's asynchronous training with upstream's
`async_training` / `rollout` keys translated (verl/trainer/config/async_recipes.py)."""

from __future__ import annotations

from verl.trainer.config.async_recipes import EntryPoint, translate_fully_async

ENTRY = EntryPoint(__file__, "fully_async_ppo_trainer", translate_fully_async)


def main(argv: list[str] | None = None) -> None:
    from verl.trainer.main_ppo import main as ppo_main

    ppo_main(argv, entry=ENTRY)


if __name__ == "__main__":
    main()
