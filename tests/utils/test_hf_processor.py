"""verl.utils.hf_processor: None for a text-only model (its AutoProcessor is just the tokenizer)."""

from verl.utils import hf_processor, hf_tokenizer


def test_hf_processor_is_none_for_a_text_only_model():
    assert hf_processor("verl/assets/arith-tiny") is None
    assert hf_tokenizer("verl/assets/arith-tiny").pad_token is not None
