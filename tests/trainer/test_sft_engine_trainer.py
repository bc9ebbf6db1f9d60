"""Upstream's engine SFT trainer (`verl.trainer.sft_trainer`): its per-step losses equal main_sft's on the
same data and seed, its loss on one batch equals a float64 hand computation, a 2-rank torchrun run resumes
to the same losses as an uninterrupted one, upstream's Ray launcher (`verl.trainer.sft_trainer_ray`) trains to
torchrun's losses, and what it cannot do is refused in one line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed_helpers import free_port
from verl.models.factory import make_tiny
from verl.trainer.config.loader import compose

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def messages_parquet(src: str, dst: str) -> str:
    """The arithmetic task in upstream's multi-turn layout: a `messages` column, the answer as the assistant turn."""
    import pandas as pd

    df = pd.read_parquet(src)
    rows = [
        {"messages": [*list(p), {"role": "assistant", "content": e["answer"]}]}
        for p, e in zip(df["prompt"], df["extra_info"])
    ]
    pd.DataFrame(rows).to_parquet(dst)
    return dst


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from verl.utils.dataset.arith import write_arith_parquet

    root = tmp_path_factory.mktemp("sft_engine")
    model_dir = make_tiny("tiny", str(root / "model"), seed=0)
    train, test = write_arith_parquet(str(root / "arith"), num_train=128, num_test=16, seed=0)
    return {
        "root": root,
        "model": model_dir,
        "train": messages_parquet(train, str(root / "train.parquet")),
        "test": messages_parquet(test, str(root / "test.parquet")),
    }


def _engine_overrides(assets, run_dir) -> list[str]:
    return [
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['test']}",
        "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=4",
        "data.use_dynamic_bsz=false",
        "data.max_length=32",
        f"model.path={assets['model']}",
        "model.enable_gradient_checkpointing=false",
        "engine.dtype=fp32",
        "optim.lr=3e-3",
        "optim.betas=[0.9,0.95]",
        "optim.weight_decay=0.01",
        f"trainer.default_local_dir={run_dir}",
        "trainer.device=cpu",
        "trainer.logger=[console,file]",
    ]


def _engine_config(assets, run_dir, *overrides):
    from omegaconf import OmegaConf

    config = compose("sft_trainer_engine")
    config.merge_with_dotlist([*_engine_overrides(assets, run_dir), *overrides])
    OmegaConf.resolve(config)
    return config


@pytest.mark.slow
def test_per_step_losses_equal_main_sfts_on_the_same_data_and_seed(assets, one_rank_group):
    from tests.trainer.test_sft_trainer import read_metrics
    from verl.trainer import fsdp_sft_trainer, sft_trainer
    from verl.trainer.fsdp_sft_config import sft_config

    engine_history = sft_trainer.run_sft(
        _engine_config(assets, assets["root"] / "engine", "trainer.total_training_steps=4", "trainer.save_freq=-1")
    )

    main_dir = assets["root"] / "main_sft"
    main_config = sft_config(
        [
            f"data.train_files={assets['train']}",
            f"data.val_files={assets['test']}",
            "data.train_batch_size=16",
            "data.micro_batch_size_per_gpu=4",
            "data.max_length=32",
            "data.multiturn.enable=true",
            f"model.partial_pretrain={assets['model']}",
            "model.fsdp_config.mixed_precision.param_dtype=fp32",
            "optim.lr=3e-3",
            "optim.betas=[0.9,0.95]",
            "optim.weight_decay=0.01",
            "optim.lr_warmup_steps_ratio=0.0",
            "optim.lr_scheduler=constant",
            f"trainer.default_local_dir={main_dir}",
            "trainer.total_training_steps=4",
            "trainer.logger=[file]",
            "trainer.device=cpu",
        ],
        demo=True,
    )
    fsdp_sft_trainer.run_sft(main_config)
    main_losses = [m["train/loss"] for m in read_metrics(main_dir / "metrics.jsonl")]
    engine_losses = [m["train/loss"] for m in engine_history]
    assert len(engine_losses) == len(main_losses) == 4
    assert engine_losses[-1] < engine_losses[0]  # it trains
    torch.testing.assert_close(torch.tensor(engine_losses), torch.tensor(main_losses), rtol=1e-5, atol=1e-6)
    for name in ("train/loss", "train/grad_norm", "train/lr", "train/mfu", "train/global_tokens"):
        assert name in engine_history[0], name
    assert "val/loss" in engine_history[-1]


def test_first_step_loss_is_the_float64_token_mean_cross_entropy_of_its_batch(assets, one_rank_group):
    from transformers import AutoModelForCausalLM

    from verl.trainer import sft_trainer
    from verl.trainer.fsdp_sft_trainer import sft_train_loader
    from verl.utils.dataset.sft_dataset import SFTDataset
    from verl.utils.tokenizer import hf_tokenizer

    # token-budget micro-batches (several per step): the loss is still the global token mean
    trainer = sft_trainer.build_trainer(
        _engine_config(
            assets, assets["root"] / "hand", "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=64",
            "data.val_files=null",
        )
    )  # fmt: skip
    tokenizer = hf_tokenizer(assets["model"])
    data = SFTDataset(assets["train"], tokenizer, {"multiturn": {"enable": True}, "max_length": 32})
    batch = next(iter(sft_train_loader(data, 0, 0, 16, 0, 1, seed=1)))
    assert len(trainer._micro_batches(batch)) > 1
    metrics = trainer.training_step(batch)
    # the same batch, by hand: sum over loss-masked target tokens of -log softmax, in float64, over their count
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float64)
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
    targets = batch["input_ids"][:, 1:]
    mask = batch["loss_mask"][:, 1:].double()
    nll = -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected = float((nll * mask).sum().detach() / mask.sum())
    assert metrics["train/loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["train/global_tokens"] == float(batch["attention_mask"].sum())


def _torchrun(assets, run_dir, *overrides, nproc: int = 2) -> list[dict]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
        "-m", "verl.trainer.sft_trainer", *_engine_overrides(assets, run_dir), "data.val_files=null",
        f"hydra.run.dir={run_dir}/hydra", "hydra.output_subdir=null", *overrides,
    ]  # fmt: skip
    return _run_for_metrics(cmd, run_dir, {"OMP_NUM_THREADS": "1"}, timeout=300)


def _run_for_metrics(cmd: list[str], run_dir, env: dict, timeout: int) -> list[dict]:
    """Run a trainer's command line; its `metrics.jsonl` records."""
    result = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": REPO_ROOT, **env}, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _ray_launcher(assets, run_dir, *overrides) -> list[dict]:
    cmd = [
        sys.executable, "-m", "verl.trainer.sft_trainer_ray", *_engine_overrides(assets, run_dir),
        "data.val_files=null", f"hydra.run.dir={run_dir}/hydra", "hydra.output_subdir=null", *overrides,
    ]  # fmt: skip
    return _run_for_metrics(cmd, run_dir, {"RAY_ADDRESS": ""}, timeout=600)


@pytest.mark.slow
def test_upstreams_ray_launcher_trains_to_torchruns_losses_on_two_ranks(assets):
    """`python -m verl.trainer.sft_trainer_ray trainer.nnodes=1 trainer.n_gpus_per_node=2 ...` (upstream's
    run_sft_engine.sh with mode=ray) against `torchrun --nproc_per_node=2 -m verl.trainer.sft_trainer`."""
    common = ("engine.fsdp_size=2", "trainer.total_training_steps=4", "trainer.resume_mode=disable")
    spmd = _torchrun(assets, assets["root"] / "spmd", *common)
    ray_run = _ray_launcher(assets, assets["root"] / "ray", *common, "trainer.nnodes=1", "trainer.n_gpus_per_node=2")
    spmd_losses = [r["data"]["train/loss"] for r in spmd if "train/loss" in r["data"]]
    ray_losses = [r["data"]["train/loss"] for r in ray_run if "train/loss" in r["data"]]
    assert len(ray_losses) == len(spmd_losses) == 4
    assert ray_losses == spmd_losses  # the same ranks, data, seed and single-threaded kernels: the same floats
    assert (assets["root"] / "ray" / "global_step_4").is_dir()


def test_the_ray_launcher_refuses_a_layout_without_ranks(assets, tmp_path):
    from verl.trainer.sft_trainer_ray import run_sft

    with pytest.raises(ValueError, match="at least one rank"):
        run_sft(_engine_config(assets, tmp_path, "trainer.n_gpus_per_node=0"))


@pytest.mark.parametrize("max_samples, expected", [(5, 5), (-1, 128), (0, 128), (1000, 128)])
def test_max_samples_keeps_the_first_rows_as_upstreams_does(assets, max_samples, expected):
    from omegaconf import OmegaConf

    from verl.trainer.sft_trainer import _dataset
    from verl.utils.tokenizer import hf_tokenizer

    data = OmegaConf.create({"messages_key": "messages", "max_length": 32, "truncation": "error"})
    tokenizer = hf_tokenizer(assets["model"])
    dataset = _dataset(assets["train"], tokenizer, data, max_samples)
    whole = _dataset(assets["train"], tokenizer, data, -1)
    assert len(dataset) == expected
    assert torch.equal(dataset[expected - 1]["input_ids"], whole[expected - 1]["input_ids"])


@pytest.mark.slow
def test_ulysses_groups_of_two_train_to_the_two_data_parallel_ranks_losses(assets):
    """`engine.ulysses_sequence_parallel_size=2` on 2 ranks (one group splitting every packed row) against 2
    data-parallel ranks without sp: the same global batches, so the same losses and gradient norms (fp32)."""
    common = ("engine.fsdp_size=2", "trainer.total_training_steps=3", "data.use_dynamic_bsz=true")
    budget = "data.max_token_len_per_gpu=96"  # per rank: an sp rank holds half of each row, so twice the rows
    dp = _torchrun(assets, assets["root"] / "dp2", *common, budget)
    sp = _torchrun(assets, assets["root"] / "sp2", *common, budget, "engine.ulysses_sequence_parallel_size=2")
    for key in ("train/loss", "train/grad_norm", "train/global_tokens"):
        want = [r["data"][key] for r in dp if key in r["data"]]
        got = [r["data"][key] for r in sp if key in r["data"]]
        assert len(want) == len(got) == 3, key
        assert got == pytest.approx(want, rel=2e-5), key
    assert dp[-1]["data"]["train/loss"] < dp[0]["data"]["train/loss"]


@pytest.mark.slow
def test_two_rank_run_saved_and_resumed_matches_an_uninterrupted_run(assets):
    def losses(records):
        return {r["step"]: r["data"]["train/loss"] for r in records}

    # the model sharded over both ranks by FSDP2 (fsdp_size=2: a model this small is otherwise replicated), and
    # token-budget micro-batches (as many on each rank: FSDP's collectives pair up per pass)
    dynamic = ("engine.fsdp_size=2", "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=96")

    whole = losses(
        _torchrun(
            assets, assets["root"] / "whole", *dynamic, "trainer.total_training_steps=6", "trainer.resume_mode=disable"
        )
    )
    cut, remote = assets["root"] / "cut", assets["root"] / "remote"
    first = losses(
        _torchrun(
            assets,
            cut,
            *dynamic,
            "trainer.total_training_steps=4",
            "trainer.save_freq=2",
            "trainer.max_ckpt_to_keep=1",
            f"trainer.default_hdfs_dir=file://{remote}",
        )
    )
    # saved at steps 2 and 4; max_ckpt_to_keep=1 removed step 2 once step 4 was complete
    assert sorted(p.name for p in cut.iterdir() if p.name.startswith("global_step_")) == ["global_step_4"]
    assert (cut / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    # each saved step was copied to default_hdfs_dir, which keeps them all
    assert sorted(p.name for p in remote.iterdir()) == [
        "global_step_2",
        "global_step_4",
        "latest_checkpointed_iteration.txt",
    ]
    files = sorted(p.relative_to(cut / "global_step_4") for p in (cut / "global_step_4").rglob("*") if p.is_file())
    assert files and files == sorted(
        p.relative_to(remote / "global_step_4") for p in (remote / "global_step_4").rglob("*") if p.is_file()
    )
    assert all((cut / "global_step_4" / f).read_bytes() == (remote / "global_step_4" / f).read_bytes() for f in files)
    resumed = losses(_torchrun(assets, cut, *dynamic, "trainer.total_training_steps=6", "trainer.max_ckpt_to_keep=1"))
    # resume_mode=auto found step 4; the limit counts it too, so step 6 replaced it
    assert sorted(p.name for p in cut.iterdir() if p.name.startswith("global_step_")) == ["global_step_6"]
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert whole[6] < whole[1]
    for step in (1, 2, 3, 4):
        assert first[step] == pytest.approx(whole[step], rel=1e-6)
    for step in (5, 6):  # restored weights, optimizer state and data position
        assert resumed[step] == pytest.approx(whole[step], rel=1e-5)


@pytest.mark.slow
def test_megatron_engine_at_tp1_trains_to_the_fsdp_engines_losses(assets):
    common = (
        "trainer.total_training_steps=3",
        "trainer.resume_mode=disable",
        "optim.lr=3e-3",
        f"data.val_files={assets['test']}",
    )
    fsdp = _torchrun(assets, assets["root"] / "fsdp1", *common, nproc=1)
    megatron = _torchrun(
        assets, assets["root"] / "megatron1", "engine=megatron", "optim=megatron", "engine.dtype=fp32",
        "optim.betas=[0.9,0.95]", "optim.weight_decay=0.01", *common, nproc=1,
    )  # fmt: skip
    fsdp_losses = [r["data"]["train/loss"] for r in fsdp]
    megatron_losses = [r["data"]["train/loss"] for r in megatron]
    assert megatron_losses[-1] < megatron_losses[0]
    torch.testing.assert_close(torch.tensor(megatron_losses), torch.tensor(fsdp_losses), rtol=1e-4, atol=1e-5)
    assert megatron[-1]["data"]["val/loss"] == pytest.approx(fsdp[-1]["data"]["val/loss"], rel=1e-4)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.pad_mod=right", r"^data.pad_mod is not a key .* Did you mean data.pad_mode\?"),
        ("trainer.resume_mode=latest", r"^trainer.resume_mode='latest' is not one of"),
        ("data.balance_dp_token=true", r"^data.balance_dp_token=True: balancing tokens"),
        ("trainer.save_freq=often", r"^trainer.save_freq='often' must be an integer"),
        (
            "trainer.default_hdfs_dir=hdfs://x",
            r"^trainer.default_hdfs_dir='hdfs://x': copying checkpoints to HDFS runs",
        ),
        (
            "checkpoint.async_save=true",
            r"^checkpoint.async_save=true: this SFT trainer writes checkpoints synchronously",
        ),
        (
            "engine.ulysses_sequence_parallel_size=2 model.use_remove_padding=false",
            r"^engine.ulysses_sequence_parallel_size=2 needs model.use_remove_padding=true",
        ),
        (
            "engine.ulysses_sequence_parallel_size=2 trainer.device=cpu",  # one rank here
            r"^engine.ulysses_sequence_parallel_size=2 does not divide the 1 ranks",
        ),
        ("engine.max_token_len_per_gpu=99", r"^engine.max_token_len_per_gpu=99: .* set data.max_token_len_per_gpu$"),
        ("engine.fsdp_sise=2", r"^unknown config key 'engine.fsdp_sise'.* Did you mean engine.fsdp_size\?"),
        ("optim.lr_scheduler_type=linear", r"^optim.lr_scheduler_type='linear' is not"),
    ],
)
def test_bad_keys_and_values_are_refused_in_one_line(assets, override, message, tmp_path):
    from verl.trainer.sft_trainer import run_sft

    config = _engine_config(assets, tmp_path)
    from omegaconf import OmegaConf

    OmegaConf.set_struct(config, False)
    config.merge_with_dotlist(override.split())
    with pytest.raises(ValueError, match=message) as raised:
        run_sft(config)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "group, message",
    [
        ("engine=veomni", r"^engine=veomni selects upstream's VeOmni engine"),
    ],
)
def test_engines_it_does_not_drive_are_refused_before_anything_loads(assets, group, message, tmp_path):
    from omegaconf import OmegaConf

    from verl.trainer.sft_trainer import run_sft

    group, *overrides = group.split()
    config = compose("sft_trainer_engine", group_overrides=[group])
    config.merge_with_dotlist([f"model.path={assets['model']}", f"data.train_files={assets['train']}", *overrides])
    OmegaConf.resolve(config)
    with pytest.raises(ValueError, match=message):
        run_sft(config)


def tools_model_and_data(messages_parquet: str, tmp_path):
    """A tiny model whose chat template renders the tool names and an empty think marker, and the multi-turn
    training rows with a tools column (JSON text) and alternating enable_thinking flags: (model dir,
    tokenizer, parquet path)."""
    import pandas as pd
    from transformers import AutoTokenizer

    model_dir = str(tmp_path / "model")
    make_tiny("tiny", model_dir, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (
        "{{ bos_token }}"
        "{% if tools %}<|system|>tools:{% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}no-think {% endif %}{{ m['content'] + eos_token }}"
        "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(model_dir)

    df = pd.read_parquet(messages_parquet)
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    df["tools"] = json.dumps([tool])
    df["enable_thinking"] = [i % 2 == 0 for i in range(len(df))]
    path = str(tmp_path / "with_tools.parquet")
    df.to_parquet(path)
    return model_dir, tokenizer, path


def check_tools_rows(dataset, tokenizer) -> None:
    """The first rows of a dataset built from `tools_model_and_data`'s rows: the tools in the prompt (not
    learned), the think marker where the row's flag is off."""
    first, second = dataset[0], dataset[1]
    prompt = tokenizer.decode(first["input_ids"][first["attention_mask"].bool()])
    assert prompt.startswith("<bos><|system|>tools:calculator <|user|>") and "no-think" not in prompt
    assert "no-think" in tokenizer.decode(second["input_ids"])  # rows alternate enable_thinking True/False
    assert "calculator" not in tokenizer.decode(first["input_ids"][first["loss_mask"].bool()])


def test_multi_turn_data_with_tools_and_thinking_flags_trains_with_the_tools_in_the_prompt(assets, tmp_path):
    """A tools column (JSON text) and per-row enable_thinking flags reach the model's chat template (here
    one that renders tool names and an empty think marker) and a short run trains on them."""
    from verl.trainer import sft_trainer

    model_dir, tokenizer, path = tools_model_and_data(assets["train"], tmp_path)
    config = _engine_config(
        assets, tmp_path / "run", f"data.train_files={path}", "data.val_files=null", f"model.path={model_dir}",
        "data.max_length=64", "trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.logger=[console]",
    )  # fmt: skip
    trainer = sft_trainer.build_trainer(config)
    check_tools_rows(trainer.train_dataset, tokenizer)
    losses = [m["train/loss"] for m in trainer.fit()]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


# upstream's tests/special_e2e/sft/run_sft_engine.sh, with its default sizes (1 GPU, sp 1, tp/pp/cp 1) and the
# paths the shell would have expanded
_UPSTREAM_SCRIPT = {
    "fsdp": [
        "engine=fsdp", "optim=fsdp", "optim.lr=1e-5", "optim.lr_warmup_steps_ratio=0.2", "optim.weight_decay=0.1",
        "optim.betas=[0.9,0.95]", "optim.clip_grad=1.0", "optim.min_lr_ratio=0.1", "optim.lr_scheduler_type=cosine",
        "engine.ulysses_sequence_parallel_size=1", "engine.strategy=fsdp", "engine.fsdp_size=1",
    ],
    "megatron": [
        "engine=megatron", "optim=megatron", "optim.lr=1e-5", "optim.lr_warmup_steps_ratio=0.2",
        "optim.weight_decay=0.1", "optim.betas=[0.9,0.95]", "optim.clip_grad=1.0", "optim.lr_warmup_init=0",
        "optim.lr_decay_style=cosine", "optim.min_lr=1e-6", "engine.tensor_model_parallel_size=1",
        "engine.pipeline_model_parallel_size=1", "engine.virtual_pipeline_model_parallel_size=null",
        "engine.context_parallel_size=1", "engine.use_mbridge=True",
    ],
}  # fmt: skip
# upstream's tests/special_e2e/sft/test_sft_engine_all.sh runs the fsdp line at sp 2 on 8 GPUs (FSDP groups of 2)
_UPSTREAM_SCRIPT["fsdp-sp2"] = [
    *_UPSTREAM_SCRIPT["fsdp"][:-3],
    "engine.ulysses_sequence_parallel_size=2",
    "engine.strategy=fsdp2",
    "engine.fsdp_size=2",
]
# upstream's tests/special_e2e/sft/test_sft_engine_all.sh runs the megatron line at tp 2, pp 2, vpp 2, cp 2 on 8 GPUs
_UPSTREAM_SCRIPT["megatron-tp2-pp2-vpp2-cp2"] = [
    *_UPSTREAM_SCRIPT["megatron"][:-5],
    "engine.tensor_model_parallel_size=2",
    "engine.pipeline_model_parallel_size=2",
    "engine.virtual_pipeline_model_parallel_size=2",
    "engine.context_parallel_size=2",
    "engine.use_mbridge=True",
]
_UPSTREAM_COMMON = [
    "data.train_files=/home/u/data/gsm8k_sft/train.parquet", "data.val_files=/home/u/data/gsm8k_sft/test.parquet",
    "data.train_batch_size=128", "data.pad_mode=no_padding", "data.truncation=error", "data.use_dynamic_bsz=True",
    "data.max_token_len_per_gpu=2048", "data.messages_key=messages", "model.path=/home/u/models/Qwen/Qwen2.5-0.5B",
    "model.use_remove_padding=True", "trainer.test_freq=after_each_epoch", "trainer.save_freq=-1",
    "trainer.logger=['console','file']", "trainer.project_name=verl_sft_test", "trainer.experiment_name=x",
    "trainer.total_epochs=2", "trainer.total_training_steps=2", "trainer.default_local_dir=/tmp/ckpts",
    "trainer.resume_mode=disable",
]  # fmt: skip


@pytest.mark.parametrize("backend", sorted(_UPSTREAM_SCRIPT))
def test_upstreams_e2e_command_line_composes_and_passes_every_check(backend):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from verl.trainer.sft_trainer import check_config, check_typed_sections

    config_dir = os.path.join(REPO_ROOT, "verl", "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = hydra_compose("sft_trainer_engine", overrides=[*_UPSTREAM_SCRIPT[backend], *_UPSTREAM_COMMON])
    check_config(config)
    check_typed_sections(config)
    assert config.trainer.test_freq == "after_each_epoch" and config.optim.lr == 1e-5
    if backend.startswith("megatron"):
        from verl.trainer.sft_trainer import check_megatron_layout

        check_megatron_layout(config.engine, 8)  # upstream's NUM_GPUS=8
        if backend != "megatron":  # tp x pp x cp = 8: four ranks cannot hold it
            with pytest.raises(ValueError, match=r"^4 rank\(s\) cannot be split into"):
                check_megatron_layout(config.engine, 4)
