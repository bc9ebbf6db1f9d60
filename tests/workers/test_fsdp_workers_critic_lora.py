"""LoRA on the FSDP critic (`critic.model.lora_rank > 0`, upstream's FSDP critic): `CriticWorker` on
the bundled tiny model in a one-rank gloo group, called directly without Ray.

What upstream's peft TOKEN_CLS wrapping implies, checked against the base critic built the same way
(same seed, so the same fresh value head): at step 0 the values are the base critic's (B = 0); an
update changes only the adapters and the value head (the base weights stay bit for bit); the
checkpoint restores the adapted critic exactly, and its `lora_adapter/` is the adapter peft loads.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import RANK_ENV, make_ppo_batch, one_thread
from verl.models import bundled_model_path
from verl.protocol import DataProto
from verl.trainer.config import load_ppo_config

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def _critic_worker(lora_rank: int, seed: int = 0, remove_padding: bool = False):
    from verl.workers.fsdp_workers import CriticWorker

    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            f"critic.model.path={bundled_model_path()}",
            f"critic.model.lora_rank={lora_rank}",
            "critic.model.lora_alpha=8",
            "critic.model.target_modules=[q_proj,v_proj]",
            "critic.model.enable_gradient_checkpointing=false",
            f"critic.model.use_remove_padding={remove_padding}",
            "critic.optim.lr=0.05",  # one step must move the adapters visibly
            "critic.optim.weight_decay=0.0",
            "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            "algorithm.adv_estimator=gae",
            "trainer.n_gpus_per_node=1",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "critic.ppo_mini_batch_size=8",
            "critic.ppo_micro_batch_size_per_gpu=4",
        ],
        config_name="arith_demo",
    )
    worker = CriticWorker(cfg.critic)
    torch.manual_seed(seed)  # the fresh value head's initialisation
    worker.init_model()
    return worker


def _batch() -> DataProto:
    td = make_ppo_batch(batch_size=8, prompt_length=6, response_length=5, seed=3)
    return DataProto.from_dict(tensors=dict(td.items()))


def _state(worker) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in worker.critic_model.module.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-rank group for the module (as `one_process`), a LoRA critic after one update, its
    checkpoint, and what the tests compare: the base critic's values, the states and values around
    the update."""
    import torch.distributed as dist

    out = tmp_path_factory.mktemp("critic_lora")
    with pytest.MonkeyPatch.context() as env:
        for name in RANK_ENV:
            env.delenv(name, raising=False)
        env.setenv("VERL_DEVICE", "cpu")
        try:
            data = _batch()
            base_values = _critic_worker(0).compute_values(data).batch["values"]
            worker = _critic_worker(4)
            values = worker.compute_values(data).batch["values"]
            before = _state(worker)
            train = _batch()
            train.batch["values"] = values
            g = torch.Generator().manual_seed(5)
            train.batch["returns"] = (torch.randn(values.shape, generator=g) * train.batch["response_mask"]).float()
            worker.update_critic(train)
            worker.save_checkpoint(str(out / "critic"), global_step=1)
            yield {
                "dir": out / "critic",
                "data": data,
                "worker": worker,
                "base_values": base_values,
                "values": values,
                "before": before,
                "after": _state(worker),
                "updated_values": worker.compute_values(data).batch["values"],
            }
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def test_lora_critic_starts_as_the_base_critic_and_trains_only_adapters_and_value_head(trained):
    module = trained["worker"].critic_model.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or ".score.modules_to_save." in n for n in trainable), trainable
    assert any(".score.modules_to_save." in n for n in trainable), "the value head must train (upstream's TOKEN_CLS)"
    assert not any("score.lora_" in n for n in trainable), "the value head gets no adapter of its own"
    assert {n.split(".")[-4] for n in trainable if ".lora_" in n} == {"q_proj", "v_proj"}

    mask = trained["data"].batch["response_mask"].bool()
    assert trained["base_values"][mask].abs().max() > 1e-3
    torch.testing.assert_close(
        trained["values"], trained["base_values"], rtol=0, atol=1e-6, msg="B = 0: the LoRA critic is the base one"
    )
    before, after = trained["before"], trained["after"]
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed, "one update must change the critic"
    assert all(".lora_" in n or ".modules_to_save." in n for n in changed), sorted(changed)
    assert any(".lora_B." in n for n in changed) and any(".modules_to_save." in n for n in changed)
    assert (trained["updated_values"] - trained["values"])[mask].abs().max() > 1e-4


def test_lora_critic_checkpoint_resumes_exactly_also_into_the_packed_forward(trained):
    head = "base_model.model.score.modules_to_save.default.weight"
    resumed = _critic_worker(4, seed=1)  # another fresh head, which the checkpoint replaces
    assert not torch.equal(_state(resumed)[head], trained["after"][head])
    resumed.load_checkpoint(str(trained["dir"]))
    for name, tensor in _state(resumed).items():
        torch.testing.assert_close(tensor, trained["after"][name], rtol=0, atol=0, msg=name)
    data, updated = trained["data"], trained["updated_values"]
    torch.testing.assert_close(resumed.compute_values(data).batch["values"], updated, rtol=0, atol=0)
    # the packed (remove-padding) forward of the peft-wrapped critic gives the same values
    packed = _critic_worker(4, remove_padding=True)
    packed.load_checkpoint(str(trained["dir"]))
    torch.testing.assert_close(packed.compute_values(data).batch["values"], updated, rtol=0, atol=1e-5)


def test_lora_critic_adapter_hf_weights_and_model_merger_give_the_trained_values(trained, tmp_path):
    """lora_adapter/ (adapters and the trained head) is what peft loads onto the base value model;
    huggingface/ holds the merged value model, and so does the model merger's output."""
    from peft import PeftModel

    from verl.model_merger.__main__ import main as model_merger
    from verl.utils.model import load_valuehead_model

    ckpt = trained["dir"]
    model_merger(
        [
            "merge",
            "--backend",
            "fsdp",
            "--is-value-model",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(tmp_path / "merged"),
        ]
    )
    data, expected = trained["data"], trained["updated_values"].double()
    mask = data.batch["response_mask"].bool()

    def base():
        return load_valuehead_model(bundled_model_path(), torch_dtype=torch.float64)

    for kind, load in (
        ("lora_adapter", lambda: PeftModel.from_pretrained(base(), str(ckpt / "lora_adapter"))),
        ("huggingface", lambda: load_valuehead_model(str(ckpt / "huggingface"), torch_dtype=torch.float64)),
        ("model_merger", lambda: load_valuehead_model(str(tmp_path / "merged"), torch_dtype=torch.float64)),
    ):
        model = load().eval()
        with torch.no_grad():
            for i in range(len(data)):
                ids = data.batch["input_ids"][i][data.batch["attention_mask"][i].bool()]
                n = int(mask[i].sum())
                ref = model(input_ids=ids[None]).logits[0, :, 0]
                # the value of response token t is read at the position before it
                torch.testing.assert_close(ref[-n - 1 : -1], expected[i, :n], rtol=0, atol=2e-5, msg=f"{kind} row {i}")
