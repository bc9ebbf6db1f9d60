"""Typed config sections of the role workers, with upstream verl's names (`verl.workers.config`).

Each class is the one definition of its section: its fields carry the runtime defaults (the
YAML holds the same values) and the `doc(...)` metadata the validator and the docs generator read;
`verl.trainer.config.schema` composes them into the whole config tree.

A role's `profiler` section is upstream's `verl.utils.profiler.ProfilerConfig` (not exported here, as
upstream does not): one class declares its keys for the validator and the docs and is what the
workers build their profilers from.
"""

from verl.workers.config.actor import (
    ActorConfig,
    FSDPActorConfig,
    McoreActorConfig,
    PolicyLossConfig,
    RefConfig,
    RouterReplayConfig,
)
from verl.workers.config.checkpoint import CheckpointConfig, McoreCheckpointConfig
from verl.workers.config.critic import (
    CriticConfig,
    CriticModelConfig,
    CriticMtpConfig,
    FSDPCriticConfig,
    FSDPCriticModelCfg,
    McoreCriticConfig,
)
from verl.workers.config.engine import (
    EngineConfig,
    EngineRouterReplayConfig,
    FSDPEngineConfig,
    McoreEngineConfig,
    McoreQATEngineConfig,
    QATEngineConfig,
    TrainingWorkerConfig,
    VeOmniEngineConfig,
)
from verl.workers.config.model import HFModelConfig, MegatronLoRAConfig, MtpConfig, TiledMLPConfig
from verl.workers.config.optimizer import (
    FSDPOptimizerConfig,
    McoreOptimizerConfig,
    OptimizerConfig,
    VeOmniOptimizerConfig,
    build_optimizer,
)
from verl.workers.config.reward import RewardConfig
from verl.workers.config.reward_model import RewardModelConfig, SandboxFusionConfig
from verl.workers.config.rollout import (
    AgentLoopConfig,
    CheckpointEngineConfig,
    CustomAsyncServerConfig,
    DisaggregationConfig,
    MultiTurnConfig,
    PrometheusConfig,
    RolloutConfig,
    SamplingConfig,
    ServerConfig,
    TraceConfig,
)

__all__ = [
    "ActorConfig",
    "AgentLoopConfig",
    "CheckpointConfig",
    "CheckpointEngineConfig",
    "CriticConfig",
    "CriticModelConfig",
    "CriticMtpConfig",
    "CustomAsyncServerConfig",
    "DisaggregationConfig",
    "EngineConfig",
    "EngineRouterReplayConfig",
    "FSDPActorConfig",
    "FSDPCriticConfig",
    "FSDPCriticModelCfg",
    "FSDPEngineConfig",
    "FSDPOptimizerConfig",
    "HFModelConfig",
    "McoreActorConfig",
    "McoreCheckpointConfig",
    "McoreCriticConfig",
    "McoreEngineConfig",
    "McoreOptimizerConfig",
    "McoreQATEngineConfig",
    "MegatronLoRAConfig",
    "MtpConfig",
    "MultiTurnConfig",
    "OptimizerConfig",
    "PolicyLossConfig",
    "PrometheusConfig",
    "QATEngineConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RouterReplayConfig",
    "SamplingConfig",
    "SandboxFusionConfig",
    "ServerConfig",
    "TiledMLPConfig",
    "TraceConfig",
    "TrainingWorkerConfig",
    "VeOmniEngineConfig",
    "VeOmniOptimizerConfig",
    "build_optimizer",
]
