"""Upstream's reward-loop package path, for custom reward loop classes (`reward_model.reward_loop_source=importlib`).

Only the base class a custom loop subclasses lives here (`reward_manager.base.RewardManagerBase`);
the loop itself runs as the driver's reward manager (verl.workers.reward_manager.reward_loop).
"""
