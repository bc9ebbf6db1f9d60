"""Upstream's megatron keys on the engine, on 2 gloo ranks (tp=1, two data-parallel replicas):

- `load_weight=false`: no weights read; megatron's seeded initialisation (normal, std 0.02; the
  output projections scaled by 1/sqrt(2 x layers)), the same on both replicas and for a second
  engine (the reference next to the actor); `true` gives the checkpoint's weights.
- `megatron.override_mcore_model_config.moe_config.freeze_moe_router`: the routers get no gradient
  and no update while the experts train; refused on a dense model.
- `optim.use_checkpoint_opt_param_scheduler`: a resumed engine takes the checkpoint's schedule, or
  keeps its own section's at the checkpoint's step.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.distributed_helpers import run_distributed
from tests.megatron_helpers import tiny_hf_model, tiny_moe_hf_model

pytestmark = pytest.mark.slow  # 13.5 s at load 4.4 on 2 cores (10 engine builds on 2 ranks): docs/testing.md

MEGATRON = {"tensor_model_parallel_size": 1, "seed": 7, "dtype": "float32"}
OPTIM = {"lr": 1e-2, "total_training_steps": 10, "weight_decay": 0.0}


def _same_on_every_rank(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _load_weight(model_cfg, want: dict) -> None:
    from verl.workers.engine import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    loaded = dict(MegatronEngineWithLMHead(model_cfg, MEGATRON, OPTIM).iter_hf_params())
    assert all(torch.equal(loaded[name], want[name]) for name in want)

    stream = torch.get_rng_state()
    actor = dict(MegatronEngineWithLMHead(model_cfg, MEGATRON, OPTIM, load_weight=False).iter_hf_params())
    assert torch.equal(torch.get_rng_state(), stream)  # the process's random stream is left alone
    ref = dict(MegatronEngineWithLMHead(model_cfg, MEGATRON, load_weight=False).iter_hf_params())
    assert sorted(actor) == sorted(want)
    for name, tensor in actor.items():
        assert torch.equal(tensor, ref[name]), f"{name}: the reference starts elsewhere than the actor"
        assert _same_on_every_rank(tensor), f"{name}: data-parallel replicas start from different weights"
        if tensor.dim() == 2:
            assert not torch.allclose(tensor, want[name], atol=1e-3), f"{name} holds the checkpoint's values"
    # megatron's init_method (std init_method_std 0.02) and, for the projections into the residual
    # stream, output_layer_init_method (0.02 / sqrt(2 x 2 layers)); norms start at one
    assert 0.019 < float(actor["model.embed_tokens.weight"].std()) < 0.021
    assert 0.0095 < float(actor["model.layers.1.mlp.down_proj.weight"].std()) < 0.0105
    assert 0.0095 < float(actor["model.layers.0.self_attn.o_proj.weight"].std()) < 0.0105
    assert torch.equal(actor["model.norm.weight"], torch.ones_like(actor["model.norm.weight"]))

    critic = dict(MegatronEngineWithValueHead(model_cfg, MEGATRON, OPTIM, load_weight=False).iter_hf_params())
    assert 0.01 < float(critic["score.weight"].std()) < 0.03 and torch.equal(critic["score.bias"], torch.zeros(1))
    assert _same_on_every_rank(critic["score.weight"])


def _freeze_moe_router(moe_cfg, dense_cfg) -> None:
    from verl.workers.engine import MegatronEngineWithLMHead

    frozen = {**MEGATRON, "override_mcore_model_config": {"moe_config": {"freeze_moe_router": True}}}
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    for freeze in (True, False):
        engine = MegatronEngineWithLMHead(moe_cfg, frozen if freeze else MEGATRON, OPTIM)
        mlp = engine.chunks[0].decoder.layers[0].mlp
        router, expert = mlp.router.weight, mlp.experts.local_experts[0].linear_fc1.weight
        optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
        assert (router.requires_grad, id(router) in optimized) == (not freeze, not freeze)
        before = router.detach().clone(), expert.detach().clone()
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        engine.chunks[0](ids, positions, None).float().logsumexp(-1).mean().backward()
        engine.optimizer.step()
        assert not torch.equal(expert, before[1])  # the experts train either way
        assert torch.equal(router, before[0]) == freeze, f"freeze_moe_router={freeze}"
    with pytest.raises(ValueError, match="freeze_moe_router=true, but the model at .* is dense"):
        MegatronEngineWithLMHead(dense_cfg, frozen, OPTIM)


SAVED = {"lr": 1e-3, "lr_decay_style": "cosine", "lr_warmup_steps": 2, "total_training_steps": 10, "min_lr": 1e-4}
SAVED.update(weight_decay=0.1, weight_decay_incr_style="linear")
NEW = {"lr": 5e-4, "total_training_steps": 20, "weight_decay": 0.0}


def _scheduler_from_checkpoint(model_cfg, ckpt) -> None:
    from verl.workers.engine import MegatronEngineWithLMHead

    saved = MegatronEngineWithLMHead(model_cfg, MEGATRON, SAVED)
    for _ in range(3):
        saved.optimizer.step()
        saved.lr_scheduler.step()
    saved.checkpoint_manager.save_checkpoint(ckpt, global_step=3)
    saved_lrs = []
    for _ in range(4):
        saved_lrs.append(saved.optimizer.param_groups[0]["lr"])
        saved.optimizer.step()
        saved.lr_scheduler.step()
    for flag in (True, False):
        engine = MegatronEngineWithLMHead(model_cfg, MEGATRON, {**NEW, "use_checkpoint_opt_param_scheduler": flag})
        engine.checkpoint_manager.load_checkpoint(ckpt)
        group = engine.optimizer.param_groups[0]
        if flag:  # the checkpoint's schedule continues where it stopped
            assert engine.lr_scheduler.settings["lr_scheduler_type"] == "cosine"
            lrs = []
            for _ in range(4):
                assert group["weight_decay"] == 0.1
                lrs.append(group["lr"])
                engine.optimizer.step()
                engine.lr_scheduler.step()
            assert lrs == saved_lrs and lrs[0] != lrs[1]
        else:  # this section's settings (constant lr 5e-4, no weight decay) at the checkpoint's step
            assert engine.lr_scheduler.last_epoch == 3
            assert (group["lr"], group["weight_decay"]) == (5e-4, 0.0)


def _all(rank, world_size, hf_dir, moe_dir, ckpt):
    from verl.utils.megatron.parallel_state import destroy_model_parallel
    from verl.workers.engine import MegatronEngineWithLMHead

    MegatronEngineWithLMHead.init_parallel(MEGATRON)
    model_cfg = OmegaConf.create({"path": hf_dir})
    want = {k: v for k, v in tiny_hf_model("qwen2").state_dict().items() if k != "lm_head.weight"}
    _load_weight(model_cfg, want)
    _freeze_moe_router(OmegaConf.create({"path": moe_dir}), model_cfg)
    _scheduler_from_checkpoint(model_cfg, ckpt)
    destroy_model_parallel()


def test_load_weight_freeze_moe_router_and_the_checkpointed_schedule(tmp_path):
    tiny_hf_model("qwen2").save_pretrained(tmp_path / "hf")
    tiny_moe_hf_model().save_pretrained(tmp_path / "moe")
    run_distributed(_all, 2, str(tmp_path / "hf"), str(tmp_path / "moe"), str(tmp_path / "ckpt"))
