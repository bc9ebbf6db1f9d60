"""`main_generation` with more than one engine: a Ray worker group of CPU workers (kept apart from
test_main_generation.py because starting Ray costs ~10 s)."""

import pyarrow.parquet as pq
import pytest

from tests.distributed_helpers import one_thread
from tests.trainer.test_main_generation import hf_greedy_responses, make_model_and_data, overrides
from verl.trainer.main_generation import main

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_model_and_data(tmp_path_factory.mktemp("gen"))


def test_two_engines_in_a_ray_worker_group_split_the_prompts_and_match_one_engine(setup, tmp_path, ray_session):
    _, model_dir, test_path = setup
    out = tmp_path / "ray.parquet"
    # 5 prompts in batches of 2 and 1: the worker group pads the odd batch and drops the padding again
    main(overrides(setup, out, "rollout.do_sample=false", "data.n_samples=1", "trainer.n_gpus_per_node=2"))
    responses = pq.read_table(out).column("responses").to_pylist()
    assert responses == [[text] for text in hf_greedy_responses(model_dir, test_path)]
