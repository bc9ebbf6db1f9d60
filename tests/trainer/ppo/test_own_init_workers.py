"""A trainer whose own `init_workers` builds the worker groups upstream's way (verl-recipe's rep_exp, specRL
and SPO trainers, users' copies of upstream's): `RayClassWithInitArgs` per role, `create_colocated_worker_cls`,
`ray_worker_group_cls(resource_pool=..., ray_cls_with_init=..., device_name=...)`, `spawn(prefix_set=...)`,
then `self.async_rollout_manager = AgentLoopManager(config=..., worker_group=...)`. Its manager generates
for prompts stamped as upstream's trainer stamps them, and this project's `fit()` trains on the groups it
assigned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.utils import Role


class OwnInitTrainer(RayPPOTrainer):
    def init_workers(self):
        from verl.experimental.agent_loop import AgentLoopManager
        from verl.single_controller.ray import RayClassWithInitArgs
        from verl.single_controller.ray.base import create_colocated_worker_cls

        self.resource_pool_manager.create_resource_pool()
        self.resource_pool_to_cls = {pool: {} for pool in self.resource_pool_manager.resource_pool_dict.values()}
        role = Role.ActorRolloutRef if Role.ActorRolloutRef in self.role_worker_mapping else Role.ActorRollout
        pool = self.resource_pool_manager.get_resource_pool(role)
        self.resource_pool_to_cls[pool][str(role)] = RayClassWithInitArgs(
            cls=self.role_worker_mapping[role], config=self.config.actor_rollout_ref, role=str(role)
        )
        all_wg = {}
        for resource_pool, class_dict in self.resource_pool_to_cls.items():
            if class_dict:
                wg_dict = self.ray_worker_group_cls(
                    resource_pool=resource_pool,
                    ray_cls_with_init=create_colocated_worker_cls(class_dict=class_dict),
                    device_name=self.device_name,
                )
                all_wg.update(wg_dict.spawn(prefix_set=class_dict.keys()))
        self.actor_rollout_wg = all_wg[str(role)]
        self.actor_rollout_wg.init_model()
        self.async_rollout_mode = True
        self.async_rollout_manager = AgentLoopManager(config=self.config, worker_group=self.actor_rollout_wg)


@pytest.fixture(scope="module")
def trainer(ray_session, tmp_path_factory):
    from verl.single_controller.ray import ResourcePoolManager
    from verl.trainer.config import load_ppo_config
    from verl.trainer.main_ppo import build_role_worker_mapping
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.dataset.arith import ensure_arith_data
    from verl.utils.tokenizer import hf_tokenizer

    tmp = tmp_path_factory.mktemp("own_init")
    train, test = ensure_arith_data(str(tmp / "data"))
    config = load_ppo_config(
        [
            f"data.train_files={train}",
            f"data.val_files={test}",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=False",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.progress_bar=false",
            "trainer.logger=[file]",
            f"trainer.run_dir={tmp / 'run'}",
            f"trainer.default_local_dir={tmp / 'ckpt'}",
        ],
        config_name="arith_demo",
    )
    tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
    mapping = build_role_worker_mapping(config)
    pools = ResourcePoolManager(
        resource_pool_spec={"global_pool": [2]}, mapping=dict.fromkeys(mapping, "global_pool"), use_gpu=False
    )
    trainer = OwnInitTrainer(
        config=config,
        tokenizer=tokenizer,
        role_worker_mapping=mapping,
        resource_pool_manager=pools,
        reward_fn=load_reward_manager(config, tokenizer, num_examine=0),
        val_reward_fn=load_reward_manager(config, tokenizer, num_examine=1),
    )
    trainer.init_workers()
    yield trainer
    for pool in pools.resource_pool_dict.values():
        pool.remove_placement_groups()


def test_the_assigned_manager_generates_for_prompts_stamped_as_upstreams_trainer_does(trainer):
    from verl.trainer.ppo.agent_loop_manager import AgentLoopManager

    manager = trainer.async_rollout_manager
    assert isinstance(manager, AgentLoopManager) and manager.worker_group is trainer.actor_rollout_wg
    batch = next(iter(trainer.train_dataloader))
    from verl.protocol import DataProto

    prompts = trainer._get_gen_batch(DataProto.from_single_dict(batch))
    # upstream's trainer stamps the step and the token ids itself; the rollout gets the caller's values
    prompts.meta_info.update(global_steps=7, eos_token_id=trainer.tokenizer.eos_token_id, do_sample=False)
    out = manager.generate_sequences(prompts)
    assert len(out) == len(prompts) and out.batch["responses"].shape[0] == len(prompts)
    # prompt plus response, the prompt's tokens unchanged
    width = prompts.batch["input_ids"].shape[1]
    assert (out.batch["input_ids"][:, :width] == prompts.batch["input_ids"]).all()
    assert out.meta_info["timing"]["generate_sequences"] > 0
    # greedy: the same prompts give the same responses again
    again = manager.generate_sequences(prompts)
    assert (again.batch["responses"] == out.batch["responses"]).all()


def test_fit_trains_on_the_groups_the_trainer_assigned(trainer):
    seen = []  # upstream's hook of a dataset that changes itself: each step's batch but the last one's
    trainer.train_dataset.on_batch_end = lambda batch: seen.append((trainer.global_steps, len(batch)))
    last = trainer.fit()
    assert seen == [(1, 8)]  # 4 prompts x rollout.n=2
    # each step reached the actor update: it trained, or skipped a batch whose groups all scored alike
    updated = ("actor/pg_loss", "actor/skipped_zero_adv")
    assert trainer.global_steps == 2 and any(k in last for k in updated)
    run_dir = Path(trainer.config.trainer.run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if any(k in r["data"] for k in updated)] == [1, 2]


def test_manager_modes_this_build_does_not_have_are_refused():
    from verl.experimental.agent_loop import AgentLoopManager

    with pytest.raises(NotImplementedError, match="standalone mode"):
        AgentLoopManager(config=None)
    with pytest.raises(NotImplementedError, match="scored by the trainer's reward step"):
        AgentLoopManager(config=None, worker_group=object(), rm_wg=object())


@pytest.mark.parametrize(
    ("name", "use_gpu", "match"),
    [
        ("cuda", False, "hold no GPUs"),
        ("cpu", True, "hold GPUs"),
        ("npu", False, "hardware it does not support"),
    ],
)
def test_a_worker_group_device_name_must_match_its_pool(name, use_gpu, match):
    from verl.single_controller.ray.resource_pool import RayResourcePool
    from verl.single_controller.ray.worker_group import _check_device_name

    with pytest.raises(ValueError, match=match):
        _check_device_name(name, RayResourcePool([1], use_gpu=use_gpu))
    assert _check_device_name("auto", RayResourcePool([1], use_gpu=use_gpu)) == ("cuda" if use_gpu else "cpu")
