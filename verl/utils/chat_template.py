"""What a chat template adds around messages (upstream's `verl.utils.chat_template` names).

A template may put a default system prompt in front of every conversation. Agent loops that render
each new turn on its own (to append it to a running token list) must cut that prefix, or every turn
would repeat it; these helpers find it by rendering one and two empty user messages: whatever the
two renderings share before the first message's own tokens is the template's prefix.
"""

from __future__ import annotations


def _ids(rendered) -> list[int]:
    """Token ids from `apply_chat_template(..., tokenize=True)` (a list, or a mapping in newer transformers)."""
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def initialize_system_prompt(tokenizer, **apply_chat_template_kwargs) -> list[int]:
    """The token ids the template puts before the first message (its default system prompt; [] if none)."""
    system, _ = extract_system_prompt_and_generation(tokenizer, **apply_chat_template_kwargs)
    return system


def extract_system_prompt_and_generation(tokenizer, **apply_chat_template_kwargs) -> tuple[list[int], list[int]]:
    """(the template's prefix before the first message, the tokens its generation prompt appends)."""
    user = {"role": "user", "content": ""}

    def render(messages, generation: bool) -> list[int]:
        return _ids(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation, tokenize=True, **apply_chat_template_kwargs
            )
        )

    one, two = render([user], False), render([user, user], False)
    per_message = len(two) - len(one)  # what one more empty user message adds
    system = one[: len(one) - per_message] if per_message > 0 else []
    with_generation = render([user], True)
    return system, with_generation[len(one) :]


__all__ = ["extract_system_prompt_and_generation", "initialize_system_prompt"]
