"""The reward-model worker on the engine interface: a sequence classifier scoring each response
(`reward_model.enable` with a discriminative model), written once for every backend; the backend's
subclass (`verl.workers.fsdp_workers.RewardModelWorker`, the Megatron one) builds the model.
Split from `verl.workers.engine_workers`, whose process-group set-up it shares."""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig

from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.profiler import DistProfiler, DistProfilerExtension
from verl.utils.speed_paths import model_speed_paths
from verl.utils.ulysses_keys import role_sp
from verl.workers.config import RewardModelConfig
from verl.workers.group_setup import _join_group
from verl.workers.ulysses_rows import UlyssesRows

__all__ = ["RewardModelWorker"]


def _keep_last_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, max_length: int, pad_id: int):
    """Each row's last `max_length` real tokens (the end of the response, which the score judges,
    survives; the start of the prompt goes), right-padded with `pad_id` to the longest kept row."""
    rows = [ids[mask.bool()][-max_length:] for ids, mask in zip(input_ids, attention_mask, strict=True)]
    width = max(len(r) for r in rows)
    out_ids = torch.full((len(rows), width), pad_id, dtype=input_ids.dtype)
    out_mask = torch.zeros((len(rows), width), dtype=attention_mask.dtype)
    for i, row in enumerate(rows):
        out_ids[i, : len(row)] = row
        out_mask[i, : len(row)] = 1
    return out_ids, out_mask


def _same_tokenizer(a, b) -> bool:
    """Whether two HF tokenizers turn every chat into the same ids (same vocabulary, special tokens and
    chat template)."""
    return (
        a.get_vocab() == b.get_vocab()
        and a.all_special_tokens == b.all_special_tokens
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
    )


class RewardModelWorker(Worker, DistProfilerExtension):
    """Scores responses with a sequence-classification model; re-tokenises when its tokenizer differs.

    A backend's subclass implements `_build_model` and `_sequence_scores` (and may re-register
    `compute_rm_score` with its dispatch); inputs, re-tokenisation and the placement of the score on
    the last response token are written here once. A backend whose forward splits sequences with Ulysses
    sets `sequence_parallel` (the rows of an sp group are gathered and each rank returns its own)."""

    sequence_parallel: bool = False

    def __init__(self, config: DictConfig | RewardModelConfig):
        super().__init__()
        # the `reward_model` section, typed once (upstream's RewardModelConfig) and read by attribute
        self.config = cfg = omega_conf_to_dataclass(config, RewardModelConfig)
        os.environ["VERL_ROLE"] = "reward_model"
        sp, sp_key = role_sp(cfg, "reward_model")
        if sp > 1 and not self.sequence_parallel:  # before joining the group: a config error needs no peers
            raise ValueError(
                f"{sp_key}={sp}: {type(self).__name__} has no Ulysses forward (reward_model.strategy={cfg.strategy}); "
                f"set {sp_key}=1"
            )
        # only a Megatron reward model's section has its own nccl_timeout (upstream's megatron_reward_model.yaml);
        # an FSDP one joins with the default (VERL_DIST_TIMEOUT_S / 600 s)
        _join_group(self, cfg.nccl_timeout if cfg.strategy == "megatron" else None)
        self.init_profiler(self.rank, cfg.profiler, "reward_model")
        # with sp > 1 the ranks of a group score the group's rows together (`_sequence_scores` splits each sequence)
        self.ulysses = UlyssesRows(sp, sp_key)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.import_utils import import_external_libs

        import_external_libs(self.config.model.external_lib)  # as the actor's (ActorRolloutRefWorker.init_model)
        self._build_model()
        self._load_tokenizers()

    def _build_model(self) -> None:
        """Load the reward model on this rank (the backend's part)."""
        raise NotImplementedError(f"{type(self).__name__} builds no reward model")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def speed_paths(self) -> list[dict]:
        """This rank's speed paths (`verl.utils.speed_paths`) as dicts: remove padding is on where the backend
        packs rows (its `use_remove_padding`: the FSDP one), fused kernels are reported off (the reward model
        computes no log-probs)."""
        model = self.config.model
        return [path.to_dict() for path in model_speed_paths(self, model.use_remove_padding, model.use_fused_kernels)]

    def _load_tokenizers(self) -> None:
        """The reward model's tokenizer, and the policy's when responses must be re-tokenised: only
        when `model.input_tokenizer` is set and differs from the reward model's (vocabulary or chat
        template); with the same tokenizer the policy's token ids are already the model's input."""
        from verl.utils.tokenizer import hf_tokenizer

        model_cfg = self.config.model
        self.rm_tokenizer = hf_tokenizer(model_cfg.path)
        input_tok = model_cfg.input_tokenizer
        self.input_tokenizer = hf_tokenizer(input_tok) if input_tok else None
        if self.input_tokenizer is not None and _same_tokenizer(self.input_tokenizer, self.rm_tokenizer):
            self.input_tokenizer = None

    def _rm_inputs(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids for the reward model (the policy's ids as they are, or re-tokenised chat text),
        each row cut to its last `reward_model.max_length` tokens when it is longer."""
        input_ids, attention_mask = self._rm_tokens(data)
        max_length = self.config.max_length
        if max_length and int(attention_mask.sum(-1).max()) > int(max_length):
            input_ids, attention_mask = _keep_last_tokens(input_ids, attention_mask, int(max_length), self._pad_id())
        return input_ids, attention_mask

    def _pad_id(self) -> int:
        pad = self.rm_tokenizer.pad_token_id
        return pad if pad is not None else (self.rm_tokenizer.eos_token_id or 0)

    def _rm_tokens(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_tokenizer is None:
            return data.batch["input_ids"], data.batch["attention_mask"]
        if "raw_prompt" not in data.non_tensor_batch:
            raise ValueError(
                "the reward model's tokenizer differs from the policy's (reward_model.model.input_tokenizer), so "
                "its inputs are re-rendered from the prompt messages, but the batch has no 'raw_prompt'; set "
                "data.return_raw_chat=true (main_ppo does when a reward model is enabled)"
            )
        texts = []
        responses = data.batch["responses"]
        response_mask = data.batch["response_mask"]
        for i in range(len(data)):
            response = self.input_tokenizer.decode(responses[i][response_mask[i].bool()], skip_special_tokens=True)
            chat = list(data.non_tensor_batch["raw_prompt"][i]) + [{"role": "assistant", "content": response}]
            texts.append(self.rm_tokenizer.apply_chat_template(chat, tokenize=False))
        enc = self.rm_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc["input_ids"], enc["attention_mask"]

    def _sequence_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One score per row [B] (float32, CPU) from the reward model (the backend's part)."""
        raise NotImplementedError(f"{type(self).__name__} has no reward model forward")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("compute_rm_score")
    def compute_rm_score(self, data: DataProto) -> DataProto:
        data = self.ulysses.gather(data)
        seq_scores = self._sequence_scores(*self._rm_inputs(data))
        # The score sits on the last valid response token, like a rule reward.
        response_mask = data.batch["response_mask"]
        last = (response_mask.sum(-1) - 1).clamp(min=0)
        rm_scores = torch.zeros_like(response_mask, dtype=torch.float32)
        rm_scores[torch.arange(len(data)), last] = seq_scores
        return self.ulysses.own(DataProto.from_dict(tensors={"rm_scores": rm_scores}))
