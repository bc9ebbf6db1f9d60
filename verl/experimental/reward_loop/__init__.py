"""Upstream's reward-loop package path.

- `reward_manager.base.RewardManagerBase`: the base class of a custom reward loop class
  (`reward_model.reward_loop_source=importlib`); the loop runs as the driver's reward manager
  (verl.workers.reward_manager.reward_loop).
- `reward_manager.limited.RateLimitedRewardManager`: upstream's rate-limited reward loop class (one
  sample per `run_single`, process-wide concurrency / requests / tokens-per-minute limits).
- `reward_model.RewardModelManager`: a generative reward model served to the custom reward function
  (`reward_model.enable` with `custom_reward_function.path`), reached through `reward_router_address`.
- `generation_server`: the HTTP server each of its replicas runs (SGLang's `/generate`, OpenAI's chat and
  completions APIs), also a command: `python -m verl.experimental.reward_loop.generation_server --model DIR`.
"""
