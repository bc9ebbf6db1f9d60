"""Checkpoints of a megatron mixture-of-experts model reshard across expert-parallel sizes: training
saved at ep=2 (each rank holds 2 of the 4 experts and their Adam moments) with the distributed
optimizer resumes at ep=1 with the Adam state split over the data-parallel ranks, and its next update
equals the uninterrupted run's. A DeepSeek-V3 model (dense first layer, then MoE layers) saved on 2
unevenly sized pipeline stages resumes on stages sized the other way, and without pipeline stages.
DeepSeek-V3 and GLM-4.5 critics (value heads) saved at ep=2 resume on 2 pipeline stages, and back."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import build_loaded_chunks, tiny_dsv3_hf_model, tiny_gptoss_hf_model, tiny_moe_hf_model
from tests.utils.checkpoint.test_megatron_checkpoint_manager import OPTIM, _actor_config, _data, _my_rows, _weights

# float64 weights; the router computes its logits in float32 as HF's does (moe_router_dtype), so layouts
# whose inputs differ by float64 rounding can round a logit differently, and Adam normalises such noise
# where a gradient is near zero: measured at most 3.6e-7 (one embedding entry at tp=2). 1e-6 is that,
# three orders below the 1e-3 a lost Adam state makes (checked below)
ATOL = 1e-6


def _trainer(
    hf_model, ep: int, zero: bool, rows: int, tp: int = 1, etp: int | None = None, pp: int = 1, tf_overrides=None
):
    from verl.models.mcore.moe import optimizer_state_shard_group
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.optim import build_lr_scheduler, build_optimizer
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    chunks = build_loaded_chunks(
        hf_model,
        tp=tp,
        ep=ep,
        etp=etp,
        pp=pp,
        dtype=torch.float64,
        sequence_parallel=tp > 1,
        tf_overrides=tf_overrides,
    )
    shard_over = optimizer_state_shard_group() if zero else None
    optimizer = build_optimizer([p for c in chunks for p in c.parameters()], OPTIM, shard_state_over=shard_over)
    scheduler = build_lr_scheduler(optimizer, OPTIM)
    actor = MegatronPPOActor(_actor_config(rows), chunks, hf_model.config, optimizer)
    manager = MegatronCheckpointManager(chunks, optimizer, scheduler, hf_config=hf_model.config)
    return chunks, actor, scheduler, manager


def _resume_at_another_ep(rank, world_size, ckpt_dir, tp, etp, save_ep=2, shards=None, family="qwen3_moe"):
    """Trained and saved at ep=`save_ep` (tp, etp), resumed at ep=1 with etp=tp. `shards`: the number
    of ranks the saving run's distributed optimizer must split the Adam state over (None: unchecked);
    `family`: qwen3_moe (tiny-moe) or gpt_oss (tiny-gptoss, biased experts)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from verl.models.mcore.moe import optimizer_state_shard_group
    from verl.utils.megatron.parallel_state import destroy_model_parallel

    dp = world_size // tp

    hf_model = (tiny_gptoss_hf_model() if family == "gpt_oss" else tiny_moe_hf_model()).double()
    first, second = _data(1, torch.float64), _data(2, torch.float64)
    saved = f"{ckpt_dir}/saved"

    chunks, actor, scheduler, manager = _trainer(
        copy.deepcopy(hf_model), ep=save_ep, zero=True, rows=8 // dp, tp=tp, etp=etp
    )
    assert len(chunks[0].decoder.layers[0].mlp.experts.local_experts) == 4 // save_ep
    if shards is not None:  # the Adam state really is split, over this many ranks
        assert dist.get_world_size(optimizer_state_shard_group()) == shards
    actor.update_policy(copy.deepcopy(_my_rows(first, mpu.get_data_parallel_rank(), dp)))
    scheduler.step()
    manager.save_checkpoint(saved, global_step=1)
    actor.update_policy(copy.deepcopy(_my_rows(second, mpu.get_data_parallel_rank(), dp)))
    uninterrupted = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), ep=1, zero=True, rows=8 // dp, tp=tp)
    manager.load_checkpoint(saved)
    assert scheduler.last_epoch == 1
    actor.update_policy(copy.deepcopy(_my_rows(second, mpu.get_data_parallel_rank(), dp)))
    resumed = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    chunks, actor, scheduler, manager = _trainer(
        copy.deepcopy(hf_model), ep=1, zero=False, rows=8 // dp, tp=tp, etp=etp
    )
    manager.load_contents = ["model"]
    manager.load_checkpoint(saved)
    actor.update_policy(copy.deepcopy(_my_rows(second, mpu.get_data_parallel_rank(), dp)))
    weights_only = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    _assert_resumed_exactly(uninterrupted, resumed, weights_only, list(uninterrupted))


def _assert_resumed_exactly(uninterrupted: dict, resumed: dict, weights_only: dict, moved: list[str]) -> None:
    """The resumed update equals the uninterrupted one (experts included), and resuming the weights
    alone moves the `moved` tensors away from it: the Adam state was really restored."""
    assert sorted(resumed) == sorted(uninterrupted)
    assert any(".mlp.experts." in name for name in resumed)
    for name, want in uninterrupted.items():
        torch.testing.assert_close(resumed[name], want, atol=ATOL, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    gap = max(float((weights_only[n] - uninterrupted[n]).abs().max()) for n in moved)
    assert gap > 1e-3, f"the Adam state should change the resumed update (weights-only resume moved {gap:.2e})"


@pytest.mark.parametrize(
    "world,tp,etp",
    [
        (2, 1, None),  # expert-data-parallel size 1: every rank owns its whole Adam state
        # 4 ranks (the slow tier): the Adam state split over replica pairs, each moment written by
        # exactly one owner (an expert's in its own pair, a dense weight's in ep rank 0's pair) ...
        pytest.param(4, 1, None, marks=pytest.mark.slow),
        # ... and with experts not split like the dense layers (etp=1 at tp=2, upstream's usual MoE
        # layout; every replica group is one rank here), resumed with the experts split at etp=tp=2
        pytest.param(4, 2, 1, marks=pytest.mark.slow),
        # ... and with each expert split over both tensor ranks too (etp=tp=2 x ep=2: the token
        # dispatcher's uneven gather over the expert-tensor group, gloo's padded form), resumed at ep=1
        pytest.param(4, 2, 2, marks=pytest.mark.slow),
    ],
    ids=["ep2", "ep2_dp4_zero", "tp2_etp1_ep2_zero", "tp2_etp2_ep2_zero"],
)
def test_moe_checkpoint_saved_at_ep2_resumes_training_exactly_at_ep1(tmp_path, world, tp, etp):
    run_distributed(_resume_at_another_ep, world, str(tmp_path / "actor"), tp, etp)


@pytest.mark.slow  # about 10 s on 4 CPU ranks, 5 s on 2
@pytest.mark.parametrize(
    "world,shards",
    [
        # each dense weight on all 4 ranks, each expert half on 2 (etp ranks 0 and 1 alternate): the
        # Adam state is split over the 2 ranks holding the same expert halves, the dense moments
        # written by etp rank 0's pair; the next update after resuming at etp=1 equals the
        # uninterrupted one (the distributed optimizer split over all 4 ranks instead stepped each
        # expert moment for a half its owner does not hold: megatron's "Invalid access pattern")
        (4, 2),
        (2, 1),  # every rank its own replica group: the whole Adam state, each expert half written once
    ],
    ids=["dp4_zero_pairs", "dp2"],
)
def test_moe_checkpoint_saved_with_experts_split_over_more_ranks_than_the_dense_layers_resumes_at_etp1(
    tmp_path, world, shards
):
    """Saved at tp=1, etp=2 (ep=1) with the distributed optimizer, resumed at etp=1 (issue #27)."""
    run_distributed(_resume_at_another_ep, world, str(tmp_path / "actor"), 1, 2, 1, shards)


@pytest.mark.slow  # 2 CPU ranks, three trainers
def test_gpt_oss_checkpoint_saved_with_each_expert_split_over_two_ranks_resumes_at_etp1(tmp_path):
    """gpt-oss at tp=1, etp=2 (the fc1 biases split, the fc2 bias replicated on both expert-tensor
    ranks), saved with the distributed optimizer and resumed with whole experts: the next update
    equals the uninterrupted one."""
    run_distributed(_resume_at_another_ep, 2, str(tmp_path / "actor"), 1, 2, 1, 1, "gpt_oss")


def _resume_at_ep1_with_zero(rank, world_size, ckpt_dir, tp, etp):
    """Save and resume at the same layout, ep=1 and tp=2 with the distributed optimizer (issue #27):
    at etp=1 both tensor ranks hold each expert whole, and only one of them may write its moments."""
    from megatron.core import parallel_state as mpu

    from verl.utils.megatron.parallel_state import destroy_model_parallel

    dp = world_size // tp
    hf_model = tiny_moe_hf_model().double()
    first, second = _data(1, torch.float64), _data(2, torch.float64)
    saved = f"{ckpt_dir}/saved"

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), ep=1, zero=True, rows=8 // dp, tp=tp, etp=etp)
    actor.update_policy(copy.deepcopy(_my_rows(first, mpu.get_data_parallel_rank(), dp)))
    scheduler.step()
    manager.save_checkpoint(saved, global_step=1)
    actor.update_policy(copy.deepcopy(_my_rows(second, mpu.get_data_parallel_rank(), dp)))
    uninterrupted = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), ep=1, zero=True, rows=8 // dp, tp=tp, etp=etp)
    manager.load_checkpoint(saved)
    actor.update_policy(copy.deepcopy(_my_rows(second, mpu.get_data_parallel_rank(), dp)))
    resumed = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), ep=1, zero=True, rows=8 // dp, tp=tp, etp=etp)
    manager.load_contents = ["model"]
    manager.load_checkpoint(saved)
    actor.update_policy(copy.deepcopy(_my_rows(second, mpu.get_data_parallel_rank(), dp)))
    weights_only = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    # the experts' moments in particular were restored, not just any Adam state
    experts = [n for n in uninterrupted if ".mlp.experts." in n]
    _assert_resumed_exactly(uninterrupted, resumed, weights_only, experts)


@pytest.mark.slow  # about 30 s each on 4 CPU ranks
@pytest.mark.parametrize("etp", [None, 1], ids=["etp2", "etp1"])
def test_moe_checkpoint_with_distributed_optimizer_at_ep1_tp2_resumes_exactly(tmp_path, etp):
    run_distributed(_resume_at_ep1_with_zero, 4, str(tmp_path / "actor"), 2, etp)


FIRST_ALONE = {"num_layers_in_first_pipeline_stage": 1}  # stage 0: the dense layer; stage 1: both MoE layers
LAST_ALONE = {"num_layers_in_last_pipeline_stage": 1}  # stage 0: dense + MoE; stage 1: the last MoE layer


def _deepseek_resume_across_pipeline_splits(rank, world_size, ckpt_dir, elsewhere):
    """DeepSeek-V3 (`tiny-dsv3`, 3 layers) trained on 2 pipeline stages holding 1 and 2 layers, saved,
    resumed at `elsewhere` (stages holding 2 and 1 layers, so layer 1 and its experts' weights and
    moments change stage; or no pipeline, the rows split over 2 data-parallel ranks)."""
    from megatron.core import parallel_state as mpu

    from verl.utils.megatron.parallel_state import destroy_model_parallel

    hf_model = tiny_dsv3_hf_model().double()
    first, second = _data(1, torch.float64), _data(2, torch.float64)
    saved = f"{ckpt_dir}/saved"
    saving = {"ep": 1, "zero": False, "rows": 8, "pp": 2, "tf_overrides": FIRST_ALONE}
    resuming = {"ep": 1, "zero": False, "rows": 8, "pp": 2, "tf_overrides": LAST_ALONE}
    if elsewhere == "pp1_dp2":
        resuming = {"ep": 1, "zero": True, "rows": 4}

    def second_update(actor) -> None:
        dp = mpu.get_data_parallel_world_size()
        actor.update_policy(copy.deepcopy(_my_rows(second, mpu.get_data_parallel_rank(), dp)))

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), **saving)
    assert len(chunks[0].decoder.layers) == (1 if mpu.get_pipeline_model_parallel_rank() == 0 else 2)
    actor.update_policy(copy.deepcopy(first))
    scheduler.step()
    manager.save_checkpoint(saved, global_step=1)
    second_update(actor)
    uninterrupted = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), **resuming)
    manager.load_checkpoint(saved)
    assert scheduler.last_epoch == 1
    second_update(actor)
    resumed = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    chunks, actor, scheduler, manager = _trainer(copy.deepcopy(hf_model), **resuming)
    manager.load_contents = ["model"]
    manager.load_checkpoint(saved)
    second_update(actor)
    weights_only = _weights(chunks, hf_model.config)
    destroy_model_parallel()

    # the layer that changed stage, its experts in particular
    _assert_resumed_exactly(uninterrupted, resumed, weights_only, [n for n in uninterrupted if ".layers.1." in n])


@pytest.mark.parametrize(
    "elsewhere",
    # 5 s to 19 s each on 2 CPU cores (warm or cold start-up): the slow tier
    [pytest.param("pp2_last1", marks=pytest.mark.slow), pytest.param("pp1_dp2", marks=pytest.mark.slow)],
    ids=["pp2_last1", "pp1_dp2_zero"],
)
def test_deepseek_v3_checkpoint_saved_on_uneven_pipeline_stages_resumes_training_exactly(tmp_path, elsewhere):
    run_distributed(_deepseek_resume_across_pipeline_splits, 2, str(tmp_path / "actor"), elsewhere)


def _critic_trainer(hf_value_model, layout: dict):
    """(chunks, critic, scheduler, manager) of a float64 megatron critic at `layout` (ep, pp, stage sizes)."""
    from megatron.core import parallel_state as mpu

    from tests.workers.critic.test_megatron_critic import CONFIG
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.utils.optim import build_lr_scheduler, build_optimizer
    from verl.workers.critic.megatron_critic import MegatronPPOCritic

    chunks = build_loaded_chunks(hf_value_model, value_head=True, dtype=torch.float64, **layout)
    optimizer = build_optimizer([p for c in chunks for p in c.parameters()], OPTIM)
    scheduler = build_lr_scheduler(optimizer, OPTIM)
    rows = 8 // mpu.get_data_parallel_world_size()
    critic = MegatronPPOCritic({**CONFIG, "ppo_mini_batch_size": rows}, chunks, optimizer)
    manager = MegatronCheckpointManager(chunks, optimizer, scheduler, hf_config=hf_value_model.config)
    return chunks, critic, scheduler, manager


def _critic_resume_at_another_layout(rank, world_size, ckpt_dir, family, saving, resuming):
    """A MoE critic trained one step at `saving`, saved, resumed at `resuming`: its next update equals
    the uninterrupted run's (value head, experts and Adam state included)."""
    from megatron.core import parallel_state as mpu

    from tests.workers.critic.test_megatron_critic_moe import critic_data, hf_moe_value_model
    from verl.models.mcore import mcore_to_hf_named_tensors
    from verl.utils.megatron.parallel_state import destroy_model_parallel

    hf_model = hf_moe_value_model(family).double()
    first, second = critic_data(), critic_data()
    for data, shift in ((first, 0.0), (second, 0.5)):  # a second batch with other targets
        for key in ("values", "returns"):
            data.batch[key] = (data.batch[key] + shift * data.batch["response_mask"]).double()
    saved = f"{ckpt_dir}/saved"

    def update(critic, data) -> dict[str, torch.Tensor]:
        dp = mpu.get_data_parallel_world_size()
        critic.update_critic(copy.deepcopy(_my_rows(data, mpu.get_data_parallel_rank(), dp)))
        return {k: v.clone() for k, v in mcore_to_hf_named_tensors(critic.model_chunks, hf_model.config, True)}

    chunks, critic, scheduler, manager = _critic_trainer(copy.deepcopy(hf_model), saving)
    update(critic, first)
    scheduler.step()
    manager.save_checkpoint(saved, global_step=1)
    uninterrupted = update(critic, second)
    destroy_model_parallel()

    chunks, critic, scheduler, manager = _critic_trainer(copy.deepcopy(hf_model), resuming)
    manager.load_checkpoint(saved)
    assert scheduler.last_epoch == 1
    resumed = update(critic, second)
    destroy_model_parallel()

    chunks, critic, scheduler, manager = _critic_trainer(copy.deepcopy(hf_model), resuming)
    manager.load_contents = ["model"]
    manager.load_checkpoint(saved)
    weights_only = update(critic, second)
    destroy_model_parallel()

    assert "score.weight" in resumed
    _assert_resumed_exactly(uninterrupted, resumed, weights_only, [n for n in uninterrupted if ".mlp.experts." in n])


@pytest.mark.slow  # 5 s to 9 s each on 2 CPU cores
@pytest.mark.parametrize(
    "family,saving,resuming",
    [
        ("deepseek_v3", {"ep": 2}, {"pp": 2, "tf_overrides": FIRST_ALONE}),
        ("glm4_moe", {"pp": 2, "tf_overrides": LAST_ALONE}, {"ep": 2}),
    ],
    ids=["deepseek_v3_ep2_to_pp2", "glm4_moe_pp2_to_ep2"],
)
def test_moe_critic_checkpoint_resumes_training_exactly_at_another_layout(tmp_path, family, saving, resuming):
    run_distributed(_critic_resume_at_another_layout, 2, str(tmp_path / "critic"), family, saving, resuming)
