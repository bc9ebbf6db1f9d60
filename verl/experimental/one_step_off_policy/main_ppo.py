"""`python -m verl.experimental.one_step_off_policy.main_ppo [--config-name=...] key=value ...`: upstream's
one-step-off-policy trainer (batch t+1 generated in the rollout pool while batch t trains), run as
main_ppo with `async_training.staleness_threshold=1` (see verl/trainer/config/async_recipes.py)."""

from __future__ import annotations

from verl.trainer.config.async_recipes import EntryPoint, translate_one_step_off

ENTRY = EntryPoint(__file__, "one_step_off_ppo_trainer", translate_one_step_off)


def main(argv: list[str] | None = None) -> None:
    from verl.trainer.main_ppo import main as ppo_main

    ppo_main(argv, entry=ENTRY)


if __name__ == "__main__":
    main()
