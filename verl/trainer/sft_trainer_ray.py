"""`python -m verl.trainer.sft_trainer_ray ...`: upstream's Ray launcher of the engine SFT trainer.

Same config (`sft_trainer_engine.yaml`) and overrides as `torchrun -m verl.trainer.sft_trainer`, the ranks
coming from `trainer.nnodes` x `trainer.n_gpus_per_node` instead of torchrun: the driver reserves that many
bundles (GPUs with `trainer.device=cuda`, CPUs with `cpu`; each of the `nnodes` entries pinned to a distinct
node), starts one Ray worker per bundle with the torch.distributed environment of its rank, and each worker
runs the engine trainer (`verl.trainer.sft_trainer.run_sft`) as a torchrun rank would. So the checkpoints,
`metrics.jsonl`, trackers and losses are the torchrun run's (tests/trainer/test_sft_trainer_ray.py checks
the losses against torchrun's on the same data and seed).

Ray: an existing cluster through `RAY_ADDRESS`, else a local one started here (and stopped at the end);
the workers import this checkout's verl.

Differs from upstream's: upstream's driver holds the dataloader and sends each batch to a group of
`TrainingWorker`s; here each rank reads its own share of every batch (the torchrun trainer's data
path), which gives the same batches without shipping them through the driver.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

__all__ = ["SFTRankWorker", "main", "run_sft"]


class SFTRankWorker(Worker):
    """One rank of the engine SFT trainer, in a Ray worker (its torch.distributed environment set by the group)."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fit(self) -> list[dict[str, float]]:
        import torch.distributed as dist

        from verl.trainer.sft_trainer import run_sft as run_rank

        try:
            return run_rank(self.config)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _ray_init_kwargs() -> dict:
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    env_vars = {"PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "true"}
    env_vars.update({k: v for k, v in os.environ.items() if k.startswith("VERL_")})
    return {"runtime_env": {"env_vars": env_vars}, "include_dashboard": False}


def run_sft(config: DictConfig) -> list[dict[str, float]]:
    """Train on `trainer.nnodes` x `trainer.n_gpus_per_node` Ray workers; returns rank 0's per-step metrics."""
    import ray

    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager
    from verl.single_controller.ray.resource_pool_manager import bundles_hold_gpus
    from verl.trainer.sft_trainer import check_config
    from verl.utils.device import _VALID as _VALID_DEVICES
    from verl.utils.device import ACCELERATOR_NAME

    check_config(config)  # before any worker starts: a bad key fails here, in one line
    trainer = config.trainer
    nnodes, per_node = int(trainer.nnodes), int(trainer.n_gpus_per_node)
    if nnodes < 1 or per_node < 1:
        raise ValueError(
            f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={per_node}: the Ray launcher needs at least one "
            "rank on at least one node"
        )
    device = str(trainer.device)
    if device not in _VALID_DEVICES:
        raise ValueError(f"trainer.device={device!r}: the Ray launcher places ranks on one of {list(_VALID_DEVICES)}")
    started = not ray.is_initialized()
    if started:
        ray.init(**_ray_init_kwargs())
    pools = None
    try:
        use_gpu = bundles_hold_gpus(device, ray.cluster_resources().get("GPU", 0))
        pools = ResourcePoolManager(resource_pool_spec={"sft_pool": [per_node] * nnodes}, mapping={}, use_gpu=use_gpu)
        pools.create_resource_pool()
        group = RayWorkerGroup(
            resource_pool=pools.resource_pool_dict["sft_pool"],
            ray_cls_with_init=RayClassWithInitArgs(SFTRankWorker, config=config),
            device_name=ACCELERATOR_NAME if use_gpu else "cpu",
        )
        return group.fit()[0]
    finally:
        if pools is not None:
            for pool in pools.resource_pool_dict.values():
                pool.remove_placement_groups()
        if started:
            ray.shutdown()


def main() -> None:
    import hydra

    # an absolute path: Hydra reads the YAML as a file whether this runs as a module or a script
    config_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config")

    @hydra.main(config_path=config_dir, config_name="sft_trainer_engine", version_base=None)
    def _main(config) -> None:
        run_sft(config)  # the driver joins no process group: the ranks are the Ray workers

    _main()


if __name__ == "__main__":
    main()
