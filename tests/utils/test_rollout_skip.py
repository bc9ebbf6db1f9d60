"""verl.utils.rollout_skip.RolloutSkip: upstream's patch of a worker group's generate_sequences that
generates once, dumps, and replays the dump in this run and the next."""

import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.utils.rollout_skip import RolloutSkip


class CountingWorkerGroup:
    """generate_sequences returns a new batch per call (its call number in every cell)."""

    def __init__(self):
        self.calls = 0

    def generate_sequences(self, batch, **kwargs):
        self.calls += 1
        return DataProto.from_dict(
            tensors={"responses": torch.full((4, 3), self.calls)}, meta_info={"kwargs": sorted(kwargs)}
        )


def config(tmp_path, **data):
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": 2, "skip_dump_dir": str(tmp_path)}}, "data": data})


def test_first_call_generates_and_dumps_later_calls_and_runs_replay_it(tmp_path, capsys):
    wg = CountingWorkerGroup()
    skip = RolloutSkip(config(tmp_path, gen_batch_size=2, train_batch_size=8), wg)
    assert skip.curr_path_dump == (tmp_path / "__GBS2__N2").absolute()
    skip.wrap_generate_sequences()
    first = wg.generate_sequences(None, timing=True)
    assert wg.calls == 1 and skip.curr_path_dump.exists()
    assert "Successfully dump data in" in capsys.readouterr().out
    for _ in range(3):
        again = wg.generate_sequences(None)
        assert torch.equal(again.batch["responses"], first.batch["responses"])
        assert again.meta_info == {"kwargs": ["timing"]}  # the dump keeps the first output's meta_info
    assert wg.calls == 1
    assert "Successfully load pre-generated data from" in capsys.readouterr().out

    next_run = CountingWorkerGroup()  # a new run with the same batch size and n replays the same file
    RolloutSkip(config(tmp_path, gen_batch_size=2), next_run).wrap_generate_sequences()
    assert torch.equal(next_run.generate_sequences(None).batch["responses"], first.batch["responses"])
    assert next_run.calls == 0


def test_file_name_falls_back_to_train_batch_size_and_names_experiment_and_project(tmp_path):
    skip = RolloutSkip(config(tmp_path, train_batch_size=8, experiment_name="e", project_name="p"), None)
    assert (skip.n, skip.gbs) == (2, 8)
    assert skip.curr_path_dump.name == "e_p_GBS8__N2"


def test_plain_dict_sections_are_read_like_a_config(tmp_path):
    class Config:
        actor_rollout_ref = type("A", (), {"rollout": {"n": 3, "skip_dump_dir": str(tmp_path / "new" / "dir")}})
        data = {"gen_batch_size": 5}

    skip = RolloutSkip(Config, None)
    assert skip.dumped_dir.is_dir() and skip.curr_path_dump.name == "__GBS5__N3"


def test_an_unreadable_dump_is_regenerated_and_overwritten(tmp_path):
    wg = CountingWorkerGroup()
    skip = RolloutSkip(config(tmp_path, gen_batch_size=2), wg)
    skip.curr_path_dump.write_bytes(b"not a torch file")
    skip.wrap_generate_sequences()
    assert wg.generate_sequences(None).batch["responses"].unique().tolist() == [1]
    assert wg.generate_sequences(None).batch["responses"].unique().tolist() == [1] and wg.calls == 1
