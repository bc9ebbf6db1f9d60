"""main_sft's `use_remove_padding` and `ulysses_sequence_parallel_size` (verl/trainer/sft_ulysses.py).

The math in float64 against the padded, unsplit forward (tight tolerances: only summation orders
differ): the packed loss and gradients on one rank; one optimizer step at sp=2 (dp=1 on 2 gloo
ranks, dp=2 on 4) against sp=1 on the same global batch, with uneven sequence lengths. Then the
trainer end to end in fp32 (sp=2 against dp=2, both on 2 ranks, a checkpoint written at sp=2 loaded
at sp=1) and the config errors.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed_helpers import VOCAB, one_thread, run_distributed, tiny_qwen2_config
from verl.trainer.fsdp_sft_trainer import accumulate_sft_gradients, sft_token_losses
from verl.trainer.sft_ulysses import SFTParallel, check_sft_parallel, packed_sft_token_losses

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

# (prompt, response) lengths of the global batch: uneven, so packed rows and sp slices cut mid-row
LENGTHS = [(3, 4), (5, 2), (2, 6), (4, 1), (6, 3), (1, 5), (3, 3), (2, 2)]
MAX_LENGTH = 12
CONFIG_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "verl",
    "trainer",
    "config",
    "sft_trainer.yaml",
)


def _heads_config(heads: int = 4, kv_heads: int = 2):
    config = tiny_qwen2_config()
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, kv_heads, 16
    return config


def _lm(heads: int = 4, kv_heads: int = 2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_heads_config(heads, kv_heads), attn_implementation="sdpa").to(
        torch.float64
    )


def _sft_batch(rows=LENGTHS) -> dict[str, torch.Tensor]:
    """SFTDataset's layout: right-padded rows, positions from 0, loss on the response tokens."""
    g = torch.Generator().manual_seed(3)
    batch = {k: torch.zeros(len(rows), MAX_LENGTH, dtype=torch.long) for k in ("input_ids", "attention_mask")}
    batch["loss_mask"] = torch.zeros(len(rows), MAX_LENGTH, dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        n = prompt + response
        batch["input_ids"][i, :n] = torch.randint(3, VOCAB, (n,), generator=g)
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, prompt:n] = 1
    batch["position_ids"] = torch.clamp(torch.cumsum(batch["attention_mask"], 1) - 1, min=0)
    return batch


def _micro_batches(batch, size):
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, len(batch["input_ids"]), size)]


# --- (a) packed == padded, one process ------------------------------------------------------------


def test_packed_loss_and_gradients_equal_the_padded_forward_in_float64():
    batch = _sft_batch()
    padded, packed = _lm(), _lm()
    loss, count = sft_token_losses(padded, batch, "cpu")
    packed_loss, packed_count = packed_sft_token_losses(packed, batch, "cpu")
    assert packed_count.item() == count.item() == sum(r for _, r in LENGTHS)  # every response token
    assert packed_loss.dtype == torch.float64
    torch.testing.assert_close(packed_loss, loss, rtol=1e-12, atol=0)
    loss.backward()
    packed_loss.backward()
    for name, param in packed.named_parameters():
        torch.testing.assert_close(param.grad, padded.get_parameter(name).grad, rtol=1e-9, atol=1e-12, msg=name)


def test_packed_rows_do_not_attend_to_each_other():
    """A row's packed loss does not change when the rows before it change."""
    model = _lm()
    batch = _sft_batch()
    last = {k: v[-1:] for k, v in batch.items()}
    alone, _ = packed_sft_token_losses(model, last, "cpu")
    other = dict(batch, input_ids=batch["input_ids"].clone())
    other["input_ids"][:-1] = torch.randint(3, VOCAB, other["input_ids"][:-1].shape) * batch["attention_mask"][:-1]
    rest = {k: v[:-1] for k, v in other.items()}
    together, _ = packed_sft_token_losses(model, other, "cpu")
    rest_loss, _ = packed_sft_token_losses(model, rest, "cpu")
    torch.testing.assert_close(together - rest_loss, alone, rtol=1e-10, atol=1e-12)


# --- (b) one step at sp=2 == sp=1 --------------------------------------------------------------------


def _reference_step(batch, micro_batch_size: int, clip: float, lr: float):
    """sp=1, one process, no FSDP: the gradient of the mean padded token loss, clipped, one AdamW step."""
    model = _lm()
    num_tokens = batch["loss_mask"][:, 1:].sum()
    loss_sum = 0.0
    for micro_batch in _micro_batches(batch, micro_batch_size):
        token_loss_sum, _ = sft_token_losses(model, micro_batch, "cpu")
        (token_loss_sum / num_tokens).backward()
        loss_sum += token_loss_sum.item()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01).step()
    return loss_sum / num_tokens.item(), grad_norm, grads, model


def _sp_step_case(rank, world_size, model_dir, sp_scale):
    from omegaconf import OmegaConf

    from verl.utils.fsdp_utils import apply_fsdp2, iter_full_params

    sp = 2
    config = OmegaConf.create({"ulysses_sequence_parallel_size": sp, "use_remove_padding": True})
    config.model = {"partial_pretrain": model_dir}
    parallel = SFTParallel.from_config(config, "cpu")
    assert (parallel.sp_size, parallel.dp_size, parallel.dp_rank) == (sp, world_size // sp, rank // sp)
    assert dist.get_world_size(parallel.sp_group) == sp

    batch = _sft_batch()
    per_dp = len(LENGTHS) // parallel.dp_size  # the ranks of an sp group read the same rows
    mine = {k: v[parallel.dp_rank * per_dp : (parallel.dp_rank + 1) * per_dp] for k, v in batch.items()}
    micro_batch_size, clip, lr = 2, 1.0, 1e-2
    model = apply_fsdp2(_lm(), {"fsdp_size": -1})
    token_losses = functools.partial(packed_sft_token_losses, model, device="cpu", sp_group=parallel.sp_group)
    loss_sum, num_tokens = accumulate_sft_gradients(
        model, mine, _micro_batches(mine, micro_batch_size), "cpu", 1, token_losses=token_losses, sp_size=sp_scale
    )
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor().item()
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01).step()

    ref_loss, ref_grad_norm, ref_grads, reference = _reference_step(batch, micro_batch_size, clip, lr)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-9, atol=1e-12, msg=f"the gradient of {name} differs")
    assert grad_norm == pytest.approx(ref_grad_norm, rel=1e-10)
    assert ref_grad_norm > clip, "the step must clip for the comparison to cover clipping"
    assert num_tokens.item() == batch["loss_mask"][:, 1:].sum().item()
    # the logged loss is summed in fp32 (the trainer's accumulator), the gradients stay float64
    assert (loss_sum / num_tokens).item() == pytest.approx(ref_loss, rel=1e-6)
    for name, weight in iter_full_params(model):
        torch.testing.assert_close(weight, reference.get_parameter(name).detach(), rtol=1e-9, atol=1e-12, msg=name)


@pytest.fixture(scope="module")
def heads_model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sp_model"))
    _heads_config().save_pretrained(path)  # what the Ulysses check reads: the head counts
    return path


def test_one_step_at_sp2_dp1_equals_sp1_on_the_same_global_batch(heads_model_dir):
    run_distributed(_sp_step_case, 2, heads_model_dir, 2)


@pytest.mark.slow
def test_one_step_at_sp2_dp2_equals_sp1_on_the_same_global_batch(heads_model_dir):
    run_distributed(_sp_step_case, 4, heads_model_dir, 2)


def test_the_comparison_fails_when_the_token_count_is_not_corrected_for_sp(heads_model_dir):
    """Without dividing the all-reduced token count by sp, the loss and the gradient come out halved."""
    with pytest.raises(AssertionError, match="the gradient of .* differs"):
        run_distributed(_sp_step_case, 2, heads_model_dir, 1)


# --- the trainer end to end (fp32) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_assets(tmp_path_factory):
    from verl.models.factory import make_tiny
    from verl.utils.dataset.arith import write_arith_parquet

    root = tmp_path_factory.mktemp("sft_sp")
    model_dir = make_tiny("tiny", str(root / "model"), seed=0)  # 2 attention heads
    train, test = write_arith_parquet(str(root / "data"), num_train=64, num_test=16, seed=0)
    return {"root": str(root), "model": model_dir, "train": train, "test": test}


def _trainer(assets, run: str, *overrides):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from verl.trainer.fsdp_sft_config import sft_config
    from verl.trainer.fsdp_sft_trainer import FSDPSFTTrainer
    from verl.utils.dataset.sft_dataset import SFTDataset

    config = sft_config(
        [
            f"data.train_files={assets['train']}",
            f"data.val_files={assets['test']}",
            f"model.partial_pretrain={assets['model']}",
            f"trainer.default_local_dir={os.path.join(assets['root'], run)}",
            "trainer.device=cpu",
            "trainer.logger=[file]",
            "trainer.total_training_steps=2",
            "data.train_batch_size=8",
            "data.micro_batch_size_per_gpu=2",
            "data.max_length=32",
            *overrides,
        ],
        demo=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    train, val = (SFTDataset(config.data[key], tokenizer, config.data) for key in ("train_files", "val_files"))
    world, sp = dist.get_world_size(), config.ulysses_sequence_parallel_size
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    # upstream's constructor: its test scripts build the ("dp", "sp") mesh themselves
    layout = sp > 1 and world % sp == 0  # (the refusal tests ask for layouts no mesh can have)
    ulysses_mesh = init_device_mesh("cpu", (world // sp, sp), mesh_dim_names=("dp", "sp")) if layout else None
    return FSDPSFTTrainer(
        config=config,
        device_mesh=mesh,
        ulysses_device_mesh=ulysses_mesh,
        tokenizer=tokenizer,
        train_dataset=train,
        val_dataset=val,
    )


def _metrics(assets, run: str) -> list[dict]:
    from tests.trainer.test_sft_trainer import read_metrics

    return read_metrics(os.path.join(assets["root"], run, "metrics.jsonl"))


def _trainer_case(rank, world_size, assets):
    from verl.utils.fsdp_utils import iter_full_params

    os.environ["VERL_DEVICE"] = "cpu"
    dp = _trainer(assets, "dp2")
    dp.fit()
    sp = _trainer(assets, "sp2", "ulysses_sequence_parallel_size=2", "use_remove_padding=true")
    assert (sp.parallel.dp_size, sp.batch_size_per_rank) == (1, 8)
    sp.fit()
    if rank == 0:
        for a, b in zip(_metrics(assets, "dp2"), _metrics(assets, "sp2"), strict=True):
            for key in ("train/loss", "train/grad_norm", "train/response_tokens", "val/loss"):
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key, a[key], b[key])
    # the checkpoint written at sp=2 loads at sp=1 (FSDP shards over all ranks whatever sp is)
    resumed = _trainer(
        assets, "sp1", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={assets['root']}/sp2/global_step_2"
    )
    resumed.load_checkpoint()
    assert resumed.global_step == 2
    saved = dict(iter_full_params(sp.model))
    for name, weight in iter_full_params(resumed.model):
        torch.testing.assert_close(weight, saved[name], rtol=0, atol=0, msg=name)


def test_trainer_at_sp2_logs_the_losses_of_dp2_and_its_checkpoint_loads_at_sp1(sft_assets):
    run_distributed(_trainer_case, 2, sft_assets)


# --- (c) config errors -------------------------------------------------------------------------------


def test_sp_needs_remove_padding():
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=2 needs use_remove_padding=true"):
        check_sft_parallel(2, False, 2)


def test_sp_must_divide_the_number_of_ranks():
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=2 does not divide the 3 ranks"):
        check_sft_parallel(2, True, 3)


def test_heads_not_divisible_by_sp_are_refused():
    check_sft_parallel(2, True, 2, _heads_config(4, 1))  # kv heads repeated up to sp
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=2.*num_attention_heads=3"):
        check_sft_parallel(2, True, 2, _heads_config(3, 3))
    with pytest.raises(ValueError, match=r"num_key_value_heads=3"):
        check_sft_parallel(4, True, 4, _heads_config(12, 3))


def test_sp_without_remove_padding_is_refused_before_the_model_is_built(sft_assets, one_rank_group, monkeypatch):
    from verl.trainer import fsdp_sft_trainer

    def no_model(self):
        raise AssertionError("the model must not be built")

    monkeypatch.setattr(fsdp_sft_trainer.FSDPSFTTrainer, "_build_model", no_model)
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=2 needs use_remove_padding=true"):
        _trainer(sft_assets, "refused", "ulysses_sequence_parallel_size=2")
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=2 does not divide the 1 ranks"):
        _trainer(sft_assets, "refused", "ulysses_sequence_parallel_size=2", "use_remove_padding=true")


def test_the_two_keys_are_known_to_the_trainer(sft_assets):
    from omegaconf import OmegaConf

    from verl.trainer.fsdp_sft_config import refuse_unknown_keys

    config = OmegaConf.load(CONFIG_PATH)
    assert config.ulysses_sequence_parallel_size == 1 and config.use_remove_padding is False
    config.merge_with_dotlist(["ulysses_sequence_parallel_size=2", "use_remove_padding=true"])
    refuse_unknown_keys(config)
