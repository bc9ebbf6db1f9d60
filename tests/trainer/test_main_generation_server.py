"""`python -m verl.trainer.main_generation_server`: upstream's PPO-config generation entry point, in one
process on the bundled arith-tiny model.

The reference for the generated text is transformers' own greedy `generate()` on each prompt alone
(`hf_greedy_responses`), an implementation independent of the rollout engine.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import verl
from tests.distributed_helpers import one_thread
from tests.trainer.test_main_generation import hf_greedy_responses
from verl.trainer.main_generation_server import main
from verl.utils.dataset.arith import write_arith_parquet

MODEL = str(Path(verl.__file__).parent / "assets" / "arith-tiny")
RESPONSE_LENGTH = 8
pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Two parquet files of arithmetic prompts whose columns differ: (first, second)."""
    root = tmp_path_factory.mktemp("gen_server")
    train_path, test_path = write_arith_parquet(str(root / "data"), num_train=3, num_test=2)
    first = pq.read_table(train_path)
    first = first.append_column("difficulty", pa.array(range(first.num_rows), type=pa.int32()))
    second = pq.read_table(test_path).drop_columns(["ability"])
    second = second.append_column("source_id", pa.array([70, 71], type=pa.int64()))
    paths = (str(root / "first.parquet"), str(root / "second.parquet"))
    pq.write_table(first, paths[0])
    pq.write_table(second, paths[1])
    return paths


def overrides(inputs, out, *extra):
    return [
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        f"actor_rollout_ref.model.path={MODEL}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.prompt_length=64",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        f"data.train_files=['{inputs[0]}','{inputs[1]}']",
        "data.prompt_key=prompt",
        f"+data.output_path={out}",
        *extra,
    ]


def test_two_files_with_different_columns_become_one_table_with_greedy_answers_in_input_order(inputs, tmp_path):
    out = tmp_path / "greedy.parquet"
    main(overrides(inputs, out, "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.n=1"))
    table = pq.read_table(out)
    first, second = (pq.read_table(p) for p in inputs)
    assert table.column_names == [*first.column_names, "source_id", "responses"]
    assert table.num_rows == first.num_rows + second.num_rows == 5
    # each column keeps its type; a file without a column contributes nulls
    assert table.schema.field("difficulty").type == pa.int32()
    assert table.column("difficulty").to_pylist() == [0, 1, 2, None, None]
    assert table.column("source_id").to_pylist() == [None, None, None, 70, 71]
    assert table.column("ability").to_pylist() == first.column("ability").to_pylist() + [None, None]
    assert (
        table.column("prompt").to_pylist() == first.column("prompt").to_pylist() + second.column("prompt").to_pylist()
    )
    expected = hf_greedy_responses(MODEL, inputs[0]) + hf_greedy_responses(MODEL, inputs[1])
    assert len(set(expected)) > 1, "the prompts should not all get the same answer"
    assert table.column("responses").to_pylist() == [[text] for text in expected]


def test_greedy_with_several_responses_is_refused_before_anything_is_loaded(inputs, tmp_path):
    with pytest.raises(ValueError, match=r"rollout.n=3 with temperature=0 .* set actor_rollout_ref.rollout.n=1"):
        main(
            overrides(
                inputs,
                tmp_path / "o.parquet",
                "actor_rollout_ref.rollout.temperature=0",
                "actor_rollout_ref.rollout.n=3",
            )
        )
    no_output = [a for a in overrides(inputs, tmp_path / "o.parquet") if not a.startswith("+data.output_path")]
    with pytest.raises(ValueError, match=r"data.output_path is not set; add \+data.output_path="):
        main(no_output)
    missing = tmp_path / "missing.parquet"
    with pytest.raises(FileNotFoundError, match=r"data.train_files=.*missing.parquet' does not exist"):
        main([*overrides(inputs, tmp_path / "o.parquet"), f"data.train_files={missing}"])
    with pytest.raises(ValueError, match=r"train_files: '.*rows.jsonl' is not a .parquet file"):
        main([*overrides(inputs, tmp_path / "o.parquet"), f"data.train_files={tmp_path / 'rows.jsonl'}"])
    vllm_tp2 = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    with pytest.raises(ValueError, match=r"= 3 devices do not split into engines of .*tensor_model_parallel_size=2"):
        main([*overrides(inputs, tmp_path / "o.parquet"), "trainer.n_gpus_per_node=3", *vllm_tp2])
    assert not (tmp_path / "o.parquet").exists()


def test_misspelled_key_exits_with_main_ppos_suggestion(inputs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*overrides(inputs, tmp_path / "o.parquet"), "actor_rollout_ref.rollout.temprature=1.0"])
    assert exit_info.value.code == 2
    assert "actor_rollout_ref.rollout.temperature" in capsys.readouterr().err


def test_sampled_file_is_what_main_eval_scores(inputs, tmp_path, capsys):
    from verl.trainer.main_eval import main as eval_main
    from verl.utils.reward_score.arith import compute_score

    out = tmp_path / "sampled.parquet"
    main(overrides(inputs, out, "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.rollout.top_k=50"))
    assert "top_k=50 is not applied" in capsys.readouterr().err
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 5 and all(len(r["responses"]) == 3 for r in rows)

    eval_main([f"data.path={out}", f"data.output_path={tmp_path / 'metrics.json'}"])
    arith = json.loads((tmp_path / "metrics.json").read_text())["arith"]
    scores = [compute_score(r, row["reward_model"]["ground_truth"]) for row in rows for r in row["responses"]]
    assert (arith["num_prompts"], arith["n"]) == (5, 3)
    assert arith["mean@3"] == pytest.approx(sum(scores) / len(scores))


def test_a_column_whose_types_cannot_be_unified_is_named(tmp_path):
    from verl.trainer.main_generation import read_input_table

    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    pq.write_table(pa.table({"prompt": ["x"], "level": pa.array([1], type=pa.int32())}), paths[0])
    pq.write_table(pa.table({"prompt": ["y"], "level": pa.array([2], type=pa.int64())}), paths[1])
    assert read_input_table(paths).schema.field("level").type == pa.int64()  # widened, values kept
    assert read_input_table(paths).column("level").to_pylist() == [1, 2]
    pq.write_table(pa.table({"prompt": ["y"], "level": ["hard"]}), paths[1])
    with pytest.raises(ValueError, match=r"data.train_files cannot be concatenated .*'level'"):
        read_input_table(paths, "data.train_files")
