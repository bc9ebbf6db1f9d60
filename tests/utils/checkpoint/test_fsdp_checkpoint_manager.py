"""FSDPCheckpointManager: exact round trip on 2 ranks, crash safety, retention, HF export, resharding."""

import os

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from tests.distributed_helpers import make_ppo_batch, make_tiny_causal_lm, one_thread, run_distributed
from verl.utils.checkpoint.checkpoint_manager import BackgroundSaveError
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict
from verl.utils.optim import build_lr_scheduler

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def tiny_tokenizer():
    vocab = {"<pad>": 0, "<unk>": 1, "a": 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), pad_token="<pad>", unk_token="<unk>"
    )


def train_step(model, optimizer, scheduler, seed):
    batch = make_ppo_batch(batch_size=4, seed=seed)
    model(input_ids=batch["input_ids"], use_cache=False).logits.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def local_state(model, optimizer):
    params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    moments = {
        (i, k): v.to_local().clone() if hasattr(v, "to_local") else v.clone()
        for i, state in enumerate(optimizer.state.values())
        for k, v in state.items()
    }
    return params, moments


def assert_state(model, optimizer, expected):
    params, moments = local_state(model, optimizer)
    assert params.keys() == expected[0].keys() and moments.keys() == expected[1].keys()
    assert all(torch.equal(params[k], expected[0][k]) for k in params)
    assert all(torch.equal(moments[k], expected[1][k]) for k in moments)


def _two_rank_checkpoints(rank, world_size, root):
    model = apply_fsdp2(make_tiny_causal_lm())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = build_lr_scheduler(optimizer, {"lr_warmup_steps": 5})
    manager = FSDPCheckpointManager(
        model,
        optimizer,
        scheduler,
        processing_class=tiny_tokenizer(),
        checkpoint_config={"save_contents": ["model", "optimizer", "extra"]},
    )
    train_step(model, optimizer, scheduler, seed=0)
    step1 = os.path.join(root, "global_step_1", "actor")
    manager.save_checkpoint(step1, global_step=1, max_ckpt_to_keep=2)
    saved = local_state(model, optimizer)
    rng_after_save = torch.rand(3)

    for seed in (1, 2):
        train_step(model, optimizer, scheduler, seed)
    assert scheduler.last_epoch == 3

    manager.load_checkpoint(step1)
    assert_state(model, optimizer, saved)
    assert scheduler.last_epoch == 1 and scheduler.get_last_lr() == [1e-2 * 1 / 5]
    assert torch.equal(torch.rand(3), rng_after_save), "the RNG state must be restored per rank"

    # a crash after the shards are written leaves no new checkpoint and the old one intact
    train_step(model, optimizer, scheduler, seed=3)

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    manager._save_extra_state = crash  # fails after the model and optimizer shards are on disk
    step2 = os.path.join(root, "global_step_2", "actor")
    with pytest.raises(OSError, match="simulated"):
        manager.save_checkpoint(step2, global_step=2, max_ckpt_to_keep=1)
    assert os.path.isdir(step2 + ".tmp") and os.listdir(os.path.join(step2 + ".tmp", "optim"))
    assert not os.path.exists(step2)
    with pytest.raises(OSError, match="simulated"):
        manager.save_checkpoint(step1, global_step=1)  # re-saving over the existing one
    del manager._save_extra_state
    torch.distributed.barrier()
    manager.load_checkpoint(step1)
    assert_state(model, optimizer, saved)

    # retention: only after a successful save are older checkpoints removed
    manager.save_contents.append("hf_model")
    step3 = os.path.join(root, "global_step_3", "actor")
    manager.save_checkpoint(step3, global_step=3, max_ckpt_to_keep=1)
    assert os.path.isdir(step3) and not os.path.exists(step3 + ".tmp")
    assert not os.path.exists(step1), "max_ckpt_to_keep=1 keeps only the newest"
    full = get_full_state_dict(model)
    if rank == 0:
        torch.save(full, os.path.join(root, "full_step3.pt"))


def test_two_rank_checkpoints_round_trip_survive_crashes_and_export_hf_weights(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_distributed(_two_rank_checkpoints, 2, str(tmp_path))
    step3 = tmp_path / "global_step_3" / "actor"
    assert sorted(os.listdir(step3)) == [
        "extra_state_world_size_2_rank_0.pt",
        "extra_state_world_size_2_rank_1.pt",
        "huggingface",
        "model",
        "optim",
    ]
    expected = torch.load(tmp_path / "full_step3.pt")
    # DCP reshards on load: the 2-rank checkpoint restores an unsharded model in one process
    model = make_tiny_causal_lm(seed=123)
    FSDPCheckpointManager(model, checkpoint_config={"load_contents": ["model"]}).load_checkpoint(str(step3))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # the huggingface/ folder is a complete HF checkpoint
    exported = AutoModelForCausalLM.from_pretrained(step3 / "huggingface", dtype=torch.float64)
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert AutoTokenizer.from_pretrained(step3 / "huggingface").pad_token == "<pad>"


def test_loading_a_missing_checkpoint_says_how_to_fix_it(tmp_path):
    manager = FSDPCheckpointManager(make_tiny_causal_lm())
    with pytest.raises(FileNotFoundError, match="resume_mode=disable"):
        manager.load_checkpoint(str(tmp_path / "nope"))
    manager.load_checkpoint(None)  # nothing to resume from: a no-op
    with pytest.raises(ValueError, match="save_contents"):
        FSDPCheckpointManager(make_tiny_causal_lm(), checkpoint_config={"save_contents": ["weights"]})


def _files(root):
    """{relative path: bytes} of every file under `root`."""
    out = {}
    for current, _, names in os.walk(root):
        for name in names:
            path = os.path.join(current, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def _async_equals_sync(rank, world_size, root):
    import torch.distributed.checkpoint as dcp

    model = apply_fsdp2(make_tiny_causal_lm())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = build_lr_scheduler(optimizer, {"lr_warmup_steps": 5})
    config = {"save_contents": ["model", "optimizer", "extra"]}
    sync = FSDPCheckpointManager(model, optimizer, scheduler, tiny_tokenizer(), checkpoint_config=config)
    background = FSDPCheckpointManager(
        model, optimizer, scheduler, tiny_tokenizer(), checkpoint_config={**config, "async_save": True}
    )
    train_step(model, optimizer, scheduler, seed=0)
    saved = local_state(model, optimizer)
    sync.save_checkpoint(os.path.join(root, "sync", "actor"), global_step=1)
    background.save_checkpoint(os.path.join(root, "async", "actor"), global_step=1)
    # training goes on at once, changing the live tensors in place, while the copy is written
    train_step(model, optimizer, scheduler, seed=1)
    assert background.finish_pending_save(wait=True)
    assert not os.path.exists(os.path.join(root, "async", "actor.tmp"))

    if rank == 0:
        a, b = _files(os.path.join(root, "sync", "actor")), _files(os.path.join(root, "async", "actor"))
        assert a.keys() == b.keys() and len(a) > 5
        # the shards are byte for byte the same; .metadata carries the writer's random save id, so compare its content
        for name in a:
            if not name.endswith(".metadata"):
                assert a[name] == b[name], name
        for part in ("model", "optim"):
            meta_a = dcp.FileSystemReader(os.path.join(root, "sync", "actor", part)).read_metadata()
            meta_b = dcp.FileSystemReader(os.path.join(root, "async", "actor", part)).read_metadata()
            assert meta_a.state_dict_metadata == meta_b.state_dict_metadata
    torch.distributed.barrier()

    # resuming from either continues identically: the same state, then the same next update
    after = {}
    for name in ("sync", "async"):
        background.load_checkpoint(os.path.join(root, name, "actor"))
        assert_state(model, optimizer, saved)
        assert scheduler.last_epoch == 1
        train_step(model, optimizer, scheduler, seed=7)
        after[name] = local_state(model, optimizer)
    assert_state(model, optimizer, after["sync"])

    # a background write that fails is raised by the next call, naming the checkpoint, and publishes nothing
    bad = os.path.join(root, "bad", "actor")
    if rank == 0:
        os.makedirs(bad)  # an existing checkpoint whose ".old" slot is a file: the swap cannot rename into it
        open(bad + ".old", "w").close()
    torch.distributed.barrier()
    background.save_checkpoint(bad, global_step=2)
    # every rank reports it (rank 1 wrote its part; publishing failed on rank 0)
    with pytest.raises(BackgroundSaveError, match=f"writing checkpoint {bad} in the background failed") as err:
        background.finish_pending_save(wait=True)
    assert isinstance(err.value.__cause__, OSError)
    assert os.listdir(bad) == [] and os.path.isdir(os.path.join(bad + ".tmp", "model"))
    assert background.finish_pending_save(wait=True)  # reported once
    # the next save works
    background.save_checkpoint(os.path.join(root, "next", "actor"), global_step=3)
    background.finish_pending_save(wait=True)
    assert os.path.isdir(os.path.join(root, "next", "actor", "optim"))


def test_background_save_writes_the_same_files_as_a_synchronous_one_and_reports_failures(tmp_path):
    run_distributed(_async_equals_sync, 2, str(tmp_path))


def test_async_save_is_refused_by_a_manager_that_cannot_write_in_the_background():
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    with pytest.raises(ValueError, match="set checkpoint.async_save=false"):
        BaseCheckpointManager(make_tiny_causal_lm(), checkpoint_config={"async_save": True})
