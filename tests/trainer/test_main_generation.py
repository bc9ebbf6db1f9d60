"""`python -m verl.trainer.main_generation` in one process, on a tiny random model and arithmetic prompts.

The reference for what is generated is transformers' own `generate()` on each prompt alone (greedy),
decoded the way the reward managers decode: an independent implementation of the same decoding.
"""

import json

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.distributed_helpers import one_thread
from verl.models.factory import build_model, save_model
from verl.trainer.main_generation import main
from verl.trainer.tool_config import load_tool_config
from verl.utils.dataset.arith import write_arith_parquet
from verl.utils.tokenizer import hf_tokenizer

NUM_PROMPTS, RESPONSE_LENGTH = 5, 6
pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def make_model_and_data(root):
    """(root, model_dir, test_parquet): a tiny random model and NUM_PROMPTS arithmetic prompts."""
    # transformers' default init (std 0.02) makes a random model repeat one token whatever the prompt;
    # larger weights give prompt-dependent greedy answers (and near-uniform sampling at temperature 1)
    model, tokenizer = build_model("tiny", seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.1)
    model_dir = save_model(model, tokenizer, str(root / "model"))
    _, test_path = write_arith_parquet(str(root / "data"), num_train=4, num_test=NUM_PROMPTS)
    return root, model_dir, test_path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_model_and_data(tmp_path_factory.mktemp("gen"))


def overrides(setup, out, *extra):
    root, model_dir, test_path = setup
    return [
        f"data.path={test_path}",
        f"data.output_path={out}",
        f"model.path={model_dir}",
        "data.batch_size=2",  # 5 prompts: batches of 2, 2 and 1
        "rollout.prompt_length=32",
        f"rollout.response_length={RESPONSE_LENGTH}",
        "trainer.device=cpu",
        *extra,
    ]


@torch.no_grad()
def hf_greedy_responses(model_dir, test_path) -> list[str]:
    tokenizer = hf_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    texts = []
    for row in pq.read_table(test_path).to_pylist():
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=RESPONSE_LENGTH,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def test_greedy_and_top_k_1_sampling_match_hf_generate_and_keep_every_input_column(setup, tmp_path):
    _, model_dir, test_path = setup
    expected = hf_greedy_responses(model_dir, test_path)
    assert len(set(expected)) > 1, "the prompts should not all get the same answer"

    main(overrides(setup, tmp_path / "greedy.parquet", "rollout.do_sample=false", "data.n_samples=1"))
    greedy = pq.read_table(tmp_path / "greedy.parquet")
    source = pq.read_table(test_path)
    assert greedy.column_names == [*source.column_names, "responses"]
    assert greedy.drop_columns(["responses"]).equals(source), "input columns are copied unchanged"
    assert greedy.column("responses").to_pylist() == [[text] for text in expected]

    # sampling restricted to the single most likely token is greedy decoding, once per sample
    main(overrides(setup, tmp_path / "top1.parquet", "rollout.top_k=1", "data.n_samples=3"))
    assert pq.read_table(tmp_path / "top1.parquet").column("responses").to_pylist() == [[t] * 3 for t in expected]


def test_sampled_responses_are_n_independent_draws_per_prompt(setup, tmp_path):
    out = tmp_path / "sampled.parquet"
    main(overrides(setup, out, "data.n_samples=4", "rollout.temperature=1.0", "rollout.top_k=-1", "rollout.top_p=1.0"))
    responses = pq.read_table(out).column("responses").to_pylist()
    assert len(responses) == NUM_PROMPTS and all(len(r) == 4 and all(isinstance(t, str) for t in r) for r in responses)
    # a random 263-token model sampled at temperature 1: repeated 6-token strings are vanishingly rare
    assert all(len(set(r)) == 4 for r in responses)

    # running on its own output replaces the responses column instead of adding a second one
    main(overrides(setup, tmp_path / "again.parquet", f"data.path={out}", "data.n_samples=2"))
    again = pq.read_table(tmp_path / "again.parquet")
    assert again.column_names.count("responses") == 1
    assert all(len(r) == 2 for r in again.column("responses").to_pylist())


def test_greedy_with_several_samples_is_refused_with_the_keys_to_change(setup, tmp_path):
    with pytest.raises(ValueError, match=r"data.n_samples=3 with greedy decoding .* set data.n_samples=1"):
        main(overrides(setup, tmp_path / "o.parquet", "rollout.do_sample=false", "data.n_samples=3"))
    with pytest.raises(ValueError, match="data.batch_size=0 must be a positive integer"):
        main(overrides(setup, tmp_path / "o.parquet", "data.batch_size=0"))


def test_misspelled_key_exits_with_a_suggestion(setup, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(overrides(setup, tmp_path / "o.parquet", "data.n_sample=2"))
    assert exit_info.value.code == 2
    assert "data.n_samples" in capsys.readouterr().err


def test_an_overlong_prompt_names_its_row_unless_truncation_is_chosen(setup, tmp_path):
    with pytest.raises(ValueError, match="row 0"):
        main(overrides(setup, tmp_path / "o.parquet", "rollout.prompt_length=4", "data.n_samples=1"))
    main(overrides(setup, tmp_path / "left.parquet", "rollout.prompt_length=4", "data.truncation=left"))
    assert pq.read_table(tmp_path / "left.parquet").num_rows == NUM_PROMPTS


def eval_main_metrics(eval_main, path, tmp_path) -> dict:
    eval_main([f"data.path={path}", f"data.output_path={tmp_path / 'metrics.json'}"])
    return json.loads((tmp_path / "metrics.json").read_text())


def test_generated_file_is_what_main_eval_scores(setup, tmp_path):
    from verl.trainer.main_eval import main as eval_main
    from verl.utils.reward_score.arith import compute_score

    out = tmp_path / "gen.parquet"
    main(overrides(setup, out, "data.n_samples=2"))
    metrics = eval_main_metrics(eval_main, out, tmp_path)
    rows = pq.read_table(out).to_pylist()
    scores = [compute_score(r, row["reward_model"]["ground_truth"]) for row in rows for r in row["responses"]]
    assert list(metrics) == ["arith"]
    arith = metrics["arith"]
    assert set(arith) == {"num_prompts", "n", "mean@2", "pass@1", "pass@2"}
    assert (arith["num_prompts"], arith["n"]) == (NUM_PROMPTS, 2)
    assert arith["mean@2"] == pytest.approx(sum(scores) / len(scores)) and arith["pass@1"] == arith["mean@2"]


def test_defaults_chain_the_bundled_model_generation_and_evaluation():
    generation = load_tool_config("generation", [])
    evaluation = load_tool_config("evaluation", [])
    assert generation.model.path.endswith("arith-tiny") and generation.data.path.endswith("arith/test.parquet")
    assert evaluation.data.path == generation.data.output_path


def test_bundled_model_scores_the_same_through_generation_and_eval_as_through_hf_generate(tmp_path):
    from verl.models import bundled_model_path
    from verl.trainer.main_eval import main as eval_main
    from verl.utils.dataset.arith import evaluate_greedy_accuracy, load_rows

    model_dir = bundled_model_path("arith-tiny")
    _, test_path = write_arith_parquet(str(tmp_path / "data"), num_train=4, num_test=100, seed=1)
    out = tmp_path / "gen.parquet"
    main(
        [
            f"data.path={test_path}",
            f"data.output_path={out}",
            f"model.path={model_dir}",
            "rollout.do_sample=false",
            "data.n_samples=1",
            "rollout.prompt_length=64",
            "rollout.response_length=8",
            "trainer.device=cpu",
        ]
    )
    metrics = eval_main_metrics(eval_main, out, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = evaluate_greedy_accuracy(model, hf_tokenizer(model_dir), load_rows(test_path))
    assert 0.1 < expected < 0.5, "the bundled model answers some problems, not all"
    assert metrics["arith"]["pass@1"] == pytest.approx(expected, abs=1e-12)


def test_a_file_with_images_is_refused_not_generated_without_them(setup, tmp_path):
    import io

    from PIL import Image

    from verl.utils.dataset.files import read_rows, write_parquet

    buffer = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 0, 0)).save(buffer, format="PNG")
    rows = read_rows(setup[2])
    for row in rows:
        row["images"] = [{"bytes": buffer.getvalue(), "path": None}]
    with_images = tmp_path / "with_images.parquet"
    write_parquet(rows, str(with_images))
    args = [a for a in overrides(setup, tmp_path / "out.parquet") if not a.startswith("data.path=")]
    with pytest.raises(ValueError, match=r"holds images \(column 'images'\): main_generation generates from text"):
        main([*args, f"data.path={with_images}", "data.n_samples=1"])
    assert not (tmp_path / "out.parquet").exists()
