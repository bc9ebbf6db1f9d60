"""The FSDP SFT trainer takes upstream's sft_trainer.yaml: upstream's SFT launch scripts compose and pass
the config check, what cannot run is refused in one line before anything loads, and the keys it reads
(LoRA, the optimizer section, checkpoint contents, external_lib, use_shm, trackers) act as their names say."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
import yaml

from tests.trainer.test_sft_trainer import read_metrics
from verl.models.factory import make_tiny
from verl.utils.dataset.arith import write_arith_parquet

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO_ROOT, "verl", "trainer", "config")
SCRIPTS = os.path.join(REPO_ROOT, "tests", "trainer", "config", "upstream", "sft_scripts.yaml")
with open(SCRIPTS) as _f:
    UPSTREAM_SCRIPTS = yaml.safe_load(_f)
# scripts this build refuses on purpose, and the start of the message
REFUSED = {"verl-recipe/recipe/retool/run_qwen2_7b_sft_npu.sh": r"^trainer.device=npu: Ascend NPUs are not supported"}


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="sft_trainer", overrides=list(overrides))


def test_the_yaml_holds_upstreams_defaults():
    config = _compose([])
    assert (config.data.train_batch_size, config.data.micro_batch_size_per_gpu) == (256, 4)
    assert (config.data.prompt_key, config.data.response_key) == ("question", "answer")
    assert config.model.partial_pretrain == "~/models/gemma-1.1-7b-it" and config.model.strategy == "fsdp2"
    assert (config.optim.lr, config.optim.lr_warmup_steps_ratio, config.optim.lr_scheduler) == (1e-5, 0.1, "cosine")
    assert list(config.optim.betas) == [0.9, 0.95] and config.optim.optimizer == "AdamW"
    assert (config.ulysses_sequence_parallel_size, config.use_remove_padding) == (1, False)
    assert list(config.trainer.logger) == ["console", "wandb"] and config.trainer.device == "cuda"
    assert list(config.trainer.checkpoint.load_contents) == ["model", "optimizer", "extra"]
    assert config.trainer.total_epochs == 4 and config.model.enable_gradient_checkpointing is True


@pytest.mark.parametrize("script", sorted(UPSTREAM_SCRIPTS))
def test_upstreams_sft_launch_scripts_compose_and_pass_the_check(script):
    import warnings

    from verl.trainer.fsdp_sft_config import check_sft_config, resolve_micro_batch_size

    config = _compose(UPSTREAM_SCRIPTS[script])
    if script in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[script]):
            check_sft_config(config)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_liger's and micro_batch_size's notes
        check_sft_config(config)
        resolve_micro_batch_size(config)
    if "data.micro_batch_size=4" in UPSTREAM_SCRIPTS[script]:
        assert config.data.micro_batch_size_per_gpu == 4 and config.data.micro_batch_size is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.chat_template=chatml", r"^data.chat_template=chatml: a chat template from the config is not applied"),
        ("data.balance_dp_token=true", r"^data.balance_dp_token=True: balancing tokens"),
        ("model.fsdp_config.wrap_policy.min_num_params=1000", r"^model.fsdp_config.wrap_policy.min_num_params=1000"),
        ("model.fsdp_config.offload_params=true", r"^model.fsdp_config.offload_params=True: .* set cpu_offload=true"),
        ("optim.total_training_steps=10", r"^optim.total_training_steps=10: the PPO trainer fills it in"),
        ("optim.lr_scheduler_type=cosine", r"^optim.lr_scheduler_type / optim.warmup_style=cosine: .* optim.lr_sch"),
        ("optim.warmup_style=cosine", r"^optim.lr_scheduler_type / optim.warmup_style=constant"),
        ("optim.lr_scheduler=linear", r"^optim.lr_scheduler='linear' is not one of \['cosine', 'wsd', 'constant'\]"),
        ("optim.lr_warmup_steps_ratio=1.0", r"^optim.lr_warmup_steps_ratio=1.0 must be in \[0, 1\)"),
        ("model.strategy=megatron", r"^model.strategy='megatron' is not one of \['fsdp', 'fsdp2'\]"),
        ("model.fsdp_config.model_dtype=fp8", r"^model.fsdp_config.model_dtype='fp8' is not one of"),
        ("trainer.checkpoint.save_contents=[optimizer]", r"^trainer.checkpoint.save_contents=\['optimizer'\] lacks"),
        ("trainer.checkpoint.load_contents=[model,weights]", r"\['weights'\] not among"),
        ("trainer.device=tpu", r"^trainer.device='tpu' is not one of"),
        ("trainer.default_hdfs_dir=s3://bucket/ckpt", r"^trainer.default_hdfs_dir='s3://bucket/ckpt': only hdfs://"),
        ("+model.lora_adapter_pth=/x", r"^model.lora_adapter_pth is not a key .* Did you mean model.lora_adapter_path"),
    ],
)
def test_what_cannot_run_is_refused_in_one_line_before_anything_loads(override, message):
    from verl.trainer.fsdp_sft_config import check_sft_config

    with pytest.raises(ValueError, match=message) as raised:
        check_sft_config(_compose([override]))
    assert "\n" not in str(raised.value)


def test_upstreams_undeclared_lora_adapter_path_is_accepted_with_plus():
    from verl.trainer.fsdp_sft_config import check_sft_config

    check_sft_config(_compose(["+model.lora_adapter_path=/adapters/a"]))  # upstream reads it with .get()


def test_the_deprecated_micro_batch_size_is_used_unless_it_disagrees():
    from verl.trainer.fsdp_sft_config import resolve_micro_batch_size

    config = _compose(["data.micro_batch_size=8"])
    with pytest.warns(FutureWarning, match="deprecated name of data.micro_batch_size_per_gpu"):
        resolve_micro_batch_size(config)
    assert config.data.micro_batch_size_per_gpu == 8
    with pytest.raises(ValueError, match="micro_batch_size=8 and data.micro_batch_size_per_gpu=2 disagree"):
        resolve_micro_batch_size(_compose(["data.micro_batch_size=8", "data.micro_batch_size_per_gpu=2"]))


def test_extract_step_reads_the_step_of_a_checkpoint_path():
    from verl.trainer.fsdp_sft_trainer import extract_step

    assert extract_step("/ckpt/run/global_step_120/huggingface") == 120
    assert extract_step("/ckpt/run/latest") is None


def test_liger_is_accepted_with_a_warning_saying_it_is_not_used():
    from verl.trainer.fsdp_sft_config import check_sft_config

    with pytest.warns(UserWarning, match="Liger kernels .* are not in this build"):
        check_sft_config(_compose(["model.use_liger=true"]))


# ------------------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_upstream")
    model_dir = make_tiny("tiny", str(root / "model"), seed=0)
    train_path, test_path = write_arith_parquet(str(root / "data"), num_train=64, num_test=16, seed=0)
    return {"root": root, "model": model_dir, "train": train_path, "test": test_path}


def _run(assets, name, *overrides):
    from verl.trainer.fsdp_sft_config import sft_config
    from verl.trainer.fsdp_sft_trainer import run_sft

    config = sft_config(
        [
            f"data.train_files={assets['train']}",
            f"data.val_files={assets['test']}",
            "data.train_batch_size=16",
            "data.micro_batch_size_per_gpu=8",
            "data.max_length=32",
            f"model.partial_pretrain={assets['model']}",
            "optim.lr=1e-2",
            "optim.lr_warmup_steps_ratio=0.0",
            "optim.lr_scheduler=constant",
            f"trainer.default_local_dir={assets['root'] / name}",
            "trainer.total_training_steps=2",
            "trainer.logger=[file]",
            "trainer.device=cpu",
            *overrides,
        ],
        demo=True,
    )
    return run_sft(config)


def test_lora_trains_only_the_adapters_and_saves_them_beside_merged_weights(assets, one_rank_group):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = _run(assets, "lora", "model.lora_rank=4", "model.lora_alpha=8", "model.target_modules=[q_proj,v_proj]")
    step_dir = assets["root"] / "lora" / "global_step_2"
    base = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float64)
    trained = {name: p.detach().full_tensor() for name, p in trainer.model.named_parameters()}  # FSDP2's DTensors
    adapters = {n: p for n, p in trained.items() if "lora_" in n}
    assert adapters and all(n.endswith(("lora_A.default.weight", "lora_B.default.weight")) for n in adapters)
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # B starts at 0: it trained
    for name, param in base.named_parameters():  # every base weight is where it started
        peft_name = "base_model.model." + name.replace("q_proj.", "q_proj.base_layer.").replace(
            "v_proj.", "v_proj.base_layer."
        )
        torch.testing.assert_close(trained[peft_name].double(), param, rtol=0, atol=0, msg=name)

    # the adapter in peft's own format, on the base model, computes what the merged export computes
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with_adapter = PeftModel.from_pretrained(base, str(step_dir / "lora_adapter")).double()
    merged = AutoModelForCausalLM.from_pretrained(str(step_dir / "huggingface"), dtype=torch.float64)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # the export stores W + scaling * B A in fp32 (the weights' dtype): equal up to that rounding
    torch.testing.assert_close(merged(ids).logits, with_adapter(ids).logits, rtol=1e-5, atol=1e-6)
    plain = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float64)
    assert (merged(ids).logits - plain(ids).logits).abs().max() > 1e-3  # the export is not the base model

    metrics = read_metrics(assets["root"] / "lora" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["train/lr(1e-3)"] == pytest.approx(10.0) and "train/time(s)" in metrics[0]


def test_weights_only_checkpoints_external_lib_and_shm_copies(assets, one_rank_group, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    module = tmp_path / "my_sft_models.py"
    module.write_text("import os\nos.environ['MY_SFT_MODELS_LOADED'] = '1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MY_SFT_MODELS_LOADED", raising=False)
    from verl.utils.fs import SHM_CACHE_ROOT, md5_encode

    shm_dirs = [
        os.path.join(SHM_CACHE_ROOT, md5_encode(os.path.abspath(p))) for p in (assets["model"], assets["train"])
    ]
    for path in shm_dirs:
        shutil.rmtree(path, ignore_errors=True)
    _run(
        assets,
        "weights_only",
        "model.external_lib=my_sft_models",
        "model.use_shm=true",
        "data.use_shm=true",
        "trainer.checkpoint.save_contents=[model,extra]",
        "optim.optimizer=SGD",
    )
    assert os.environ.get("MY_SFT_MODELS_LOADED") == "1" and "my_sft_models" in sys.modules
    saved = dcp.FileSystemReader(str(assets["root"] / "weights_only" / "global_step_2" / "dcp")).read_metadata()
    keys = saved.state_dict_metadata.keys()
    assert any(k.startswith("model.") for k in keys) and not any(k.startswith("optimizer.") for k in keys)
    # the run read the model and the data from their /dev/shm copies
    model_copy = os.path.join(shm_dirs[0], os.path.basename(assets["model"]), "model.safetensors")
    assert os.path.isfile(model_copy) and os.path.isfile(os.path.join(shm_dirs[1], os.path.basename(assets["train"])))
    for path in shm_dirs:
        shutil.rmtree(path, ignore_errors=True)


def test_retool_style_multi_turn_tools_run_packed(assets, one_rank_group, tmp_path):
    """verl-recipe's retool SFT keys (`data.multiturn.enable`, `messages_key`, `tools_key`, `model.strategy=fsdp`,
    `use_remove_padding=true`) on rows with a tools column: the tools reach the prompt, not the loss, and the
    packed forward trains."""
    from tests.trainer.test_sft_engine_trainer import check_tools_rows, messages_parquet, tools_model_and_data

    rows = messages_parquet(assets["train"], str(tmp_path / "messages.parquet"))
    model_dir, tokenizer, path = tools_model_and_data(rows, tmp_path)
    trainer = _run(
        assets,
        "retool",
        f"data.train_files={path}",
        "data.val_files=null",
        f"model.partial_pretrain={model_dir}",
        "data.max_length=64",
        "data.multiturn.enable=true",
        "data.multiturn.messages_key=messages",
        "data.multiturn.tools_key=tools",
        "model.strategy=fsdp",
        "use_remove_padding=true",
        "trainer.total_training_steps=3",
    )
    check_tools_rows(trainer.train_dataset, tokenizer)
    losses = [m["train/loss"] for m in read_metrics(assets["root"] / "retool" / "metrics.jsonl")]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_upstreams_defaults_on_a_fresh_machine_name_every_missing_input(one_rank_group, tmp_path, monkeypatch):
    """Without overrides the yaml points at upstream's ~/models and ~/data, absent here: one error naming the
    model and both data files, and the demo switch, before anything loads."""
    from verl.trainer.fsdp_sft_trainer import run_sft

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError) as raised:
        run_sft(_compose(["trainer.device=cpu"]))
    message = str(raised.value)
    assert message.startswith("model.partial_pretrain=~/models/gemma-1.1-7b-it does not exist")
    assert "data.train_files: '~/data/gsm8k/train.parquet' is not a file" in message
    assert "data.val_files: '~/data/gsm8k/test.parquet'" in message
    assert message.endswith("add +demo=arith_sft)") and "\n" not in message
