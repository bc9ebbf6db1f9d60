import os

import pytest
from omegaconf import OmegaConf

from verl.trainer.ppo.reward import get_custom_reward_fn

REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return scale * float(solution_str.strip() == str(ground_truth))

def length_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": len(solution_str) / 10, "length": len(solution_str)}

THRESHOLD = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return str(path)


def _config(path=None, name=None, reward_kwargs=None, manager="naive", manager_kwargs=None):
    return OmegaConf.create(
        {
            "data": {"reward_fn_key": "data_source"},
            "reward_model": {"reward_manager": manager, "reward_kwargs": manager_kwargs or {}},
            # name left out: the YAML's compute_score
            "custom_reward_function": {
                "path": path,
                "reward_kwargs": reward_kwargs or {},
                **({"name": name} if name else {}),
            },
        }
    )


def test_no_path_means_no_custom_function():
    assert get_custom_reward_fn(_config()) is None
    assert get_custom_reward_fn(OmegaConf.create({})) is None


def test_loads_the_named_function_with_bound_kwargs(reward_file):
    fn = get_custom_reward_fn(_config(reward_file, "compute_score", {"scale": 2.0}))
    assert fn("x", "7", "7") == 2.0
    assert fn(data_source="x", solution_str="6", ground_truth="7", extra_info=None) == 0.0
    assert get_custom_reward_fn(_config(reward_file))("x", " 7", "7") == 1.0  # name defaults to compute_score


def test_missing_file_names_path_cwd_and_setting(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        get_custom_reward_fn(_config(str(tmp_path / "nope.py"), "compute_score"))
    message = str(info.value)
    assert "nope.py" in message and os.getcwd() in message and "custom_reward_function.path" in message


def test_missing_function_lists_the_callables_of_the_file(reward_file):
    with pytest.raises(AttributeError) as info:
        get_custom_reward_fn(_config(reward_file, "score_fn"))
    message = str(info.value)
    assert "'score_fn'" in message and "['compute_score', 'length_score']" in message
    assert "custom_reward_function.name" in message


def test_a_file_that_raises_on_import_shows_the_exception(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(RuntimeError, match="ModuleNotFoundError.*not_a_real_module_xyz") as info:
        get_custom_reward_fn(_config(str(path), "compute_score"))
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_a_non_callable_name_is_rejected(reward_file):
    with pytest.raises(TypeError, match="THRESHOLD.*not a function"):
        get_custom_reward_fn(_config(reward_file, "THRESHOLD"))
