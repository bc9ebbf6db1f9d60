"""WeatherInteraction (upstream's demo): 1.0 and thanks when a tool answered, else 0.0 and a reminder; always ends."""

import asyncio

from verl.interactions.utils.interaction_registry import initialize_interactions_from_config
from verl.interactions.weather_interaction import THANKS, USE_THE_TOOL, WeatherInteraction


def test_weather_interaction_rewards_a_conversation_in_which_a_tool_answered():
    async def run():
        interaction = WeatherInteraction({"name": "weather"})
        iid = await interaction.start_interaction(ground_truth="sunny")
        no_tool = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."}]
        without = await interaction.generate_response(iid, no_tool)
        with_tool = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather"}}]},
            {"role": "tool", "content": "old"},
            {"role": "tool", "content": '{"temperature": 21}'},
            {"role": "assistant", "content": "It is 21 degrees."},
        ]
        with_ = await interaction.generate_response(iid, with_tool)
        recorded = dict(interaction._instance_dict[iid])
        await interaction.finalize_interaction(iid)
        return without, with_, recorded, interaction._instance_dict

    without, with_, recorded, left = asyncio.run(run())
    assert without == (True, USE_THE_TOOL, 0.0, {})
    assert with_ == (True, THANKS, 1.0, {})
    assert recorded == {
        "response": '{"temperature": 21}',
        "ground_truth": "sunny",
        "reward": 0.0,
    }  # the last tool message
    assert left == {}


def test_weather_interaction_loads_from_an_interaction_config(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(
        "interaction:\n  - name: weather\n"
        "    class_name: verl.interactions.weather_interaction.WeatherInteraction\n    config: {}\n"
    )
    interactions = initialize_interactions_from_config(str(path))
    assert list(interactions) == ["weather"]
    assert isinstance(interactions["weather"], WeatherInteraction) and interactions["weather"].name == "weather"
