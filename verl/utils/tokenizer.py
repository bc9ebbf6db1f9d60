"""Loading tokenizers the way every worker needs them: offline-friendly, with a pad token."""

from __future__ import annotations

import os

from verl.utils.logging_utils import get_logger

logger = get_logger(__name__)


def hf_tokenizer(
    name_or_path: str,
    trust_remote_code: bool = False,
    correct_pad_token: bool = True,
    chat_template: str | None = None,
    **kwargs,
):
    """`AutoTokenizer.from_pretrained` with a pad token guaranteed; `chat_template` (a Jinja template,
    `model.custom_chat_template`) replaces the tokenizer's own when given.

    A tokenizer without a pad token is handled, not an error: eos is used for padding (batches are
    masked, so the pad id never reaches a loss). A path that looks local but does not exist fails
    with a message naming it, instead of an attempt to reach the hub.
    """
    from transformers import AutoTokenizer

    path = os.path.expanduser(str(name_or_path))
    looks_local = str(name_or_path).startswith(("/", "./", "../", "~"))
    if looks_local and not os.path.exists(path):
        raise FileNotFoundError(
            f"tokenizer path {name_or_path!r} does not exist (cwd: {os.getcwd()}); set "
            "actor_rollout_ref.model.path (or model.tokenizer_path) to a Hugging Face model directory"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        raise OSError(
            f"could not load a tokenizer from {name_or_path!r}: {e}. Point the model path at a directory "
            "with tokenizer files (tokenizer.json or tokenizer.model + tokenizer_config.json)"
        ) from e
    if correct_pad_token:
        vocab_size = _model_vocab_size(path)
        invented = (
            vocab_size is not None and tokenizer.pad_token_id is not None and tokenizer.pad_token_id >= vocab_size
        )
        if tokenizer.pad_token_id is None or invented:
            if tokenizer.eos_token_id is None:
                raise ValueError(
                    f"the tokenizer at {name_or_path!r} has neither a pad nor an eos token; add one of them"
                )
            if invented:
                # Some tokenizer classes (Qwen2Tokenizer) add a default pad token at load time when the files
                # define none; its id lies past the model's embedding table, and padding with it would crash.
                logger.warning(
                    f"tokenizer at {name_or_path} has no pad token of the model's vocabulary (its class added "
                    f"{tokenizer.pad_token!r} with id {tokenizer.pad_token_id} >= vocab_size {vocab_size})"
                )
            tokenizer.pad_token = tokenizer.eos_token
            logger.warning(
                f"tokenizer at {name_or_path} has no pad token; using eos ({tokenizer.eos_token!r}) for padding"
            )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return with_list_chat_ids(tokenizer)


# ------------------------------------------------------------------------------------------------------------
# `apply_chat_template(..., tokenize=True)`: transformers 4 returned the list of ids unless `return_dict=True`;
# transformers 5 returns a `BatchEncoding` unless `return_dict=False`. Upstream verl's code, its recipes and
# its users' reward functions, datasets and agent loops were written for the list (`ids[-1]`, `len(ids)`,
# `json={"input_ids": ids}`), so the tokenizers this module loads keep transformers 4's default; a caller that
# passes `return_dict` gets what it asks for. verl's own code accepts either (`verl.utils.chat_template`).
_LIST_IDS_PREFIX = "ListChatIds_"


def _apply_chat_template_list_ids(self, *args, **kwargs):
    kwargs.setdefault("return_dict", False)
    return super(type(self), self).apply_chat_template(*args, **kwargs)


def _list_ids_class(cls: type) -> type:
    """`cls` with transformers 4's `apply_chat_template` default, made once per class and reachable as this
    module's attribute `ListChatIds_<name>` (so pickled tokenizers load in another process)."""
    name = _LIST_IDS_PREFIX + cls.__name__
    sub = globals().get(name)
    if sub is None or sub.__mro__[1] is not cls:
        attrs = {
            "apply_chat_template": _apply_chat_template_list_ids,
            "__module__": __name__,
            "_verl_list_chat_ids": True,
        }
        # __name__ stays the base class's (save_pretrained writes it as tokenizer_class); pickle finds the
        # class by its __qualname__, this module's attribute
        sub = type(cls.__name__, (cls,), attrs)
        sub.__qualname__ = name
        globals()[name] = sub
    return sub


def with_list_chat_ids(tokenizer):
    """The same tokenizer object, its `apply_chat_template(tokenize=True)` returning a list by default (above).
    A tokenizer class transformers does not export by name (remote code) is left as it is."""
    import inspect

    import transformers

    cls = type(tokenizer)
    if getattr(cls, "_verl_list_chat_ids", False) or not hasattr(cls, "apply_chat_template"):
        return tokenizer
    if getattr(transformers, cls.__name__, None) is not cls:
        return tokenizer
    default = inspect.signature(cls.apply_chat_template).parameters.get("return_dict")
    if default is None or default.default is not True:  # transformers 4: already a list
        return tokenizer
    tokenizer.__class__ = _list_ids_class(cls)
    return tokenizer


def __getattr__(name: str):
    """`ListChatIds_<transformers tokenizer class>` on first use in a process that unpickles one."""
    if name.startswith(_LIST_IDS_PREFIX):
        import transformers

        base = getattr(transformers, name[len(_LIST_IDS_PREFIX) :], None)
        if isinstance(base, type):
            return _list_ids_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _model_vocab_size(path: str) -> int | None:
    """`vocab_size` from the model's config.json when `path` is a model directory, else None."""
    import json

    config_file = os.path.join(path, "config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return vocab_size if isinstance(vocab_size, int) else None


def hf_processor(name_or_path: str, **kwargs):
    """The multimodal processor (`transformers.AutoProcessor`) of a model, or None for a text-only model.

    A text-only checkpoint has no processor: `AutoProcessor` then falls back to the tokenizer, which
    is not a processor, so None is returned (what callers test for to choose the text-only path).
    A checkpoint whose processor files exist but cannot be loaded raises. A Qwen2-VL family processor
    whose video processor cannot be built for want of torchvision is loaded without it
    (`verl.utils.vision.ImageOnlyQwen2_5_VLProcessor` / `ImageOnlyQwen3VLProcessor`: images work, videos
    are refused).
    """
    from transformers import AutoProcessor

    path = os.path.expanduser(str(name_or_path))
    try:
        processor = AutoProcessor.from_pretrained(path, **kwargs)
    except (ImportError, AttributeError) as e:
        processor_class = _qwen_vl_processor_class(path)
        if processor_class is None:
            raise
        from verl.utils.vision import load_image_only_processor

        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        logger.warning("processor of %s loaded without its video processor (%s): images only", name_or_path, reason)
        return load_image_only_processor(path, processor_class, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        if os.path.exists(os.path.join(path, "preprocessor_config.json")) or os.path.exists(
            os.path.join(path, "processor_config.json")
        ):
            raise OSError(f"could not load the processor of {name_or_path!r}: {e}") from e
        return None
    if "Processor" not in type(processor).__name__:
        return None
    return processor


def _qwen_vl_processor_class(path: str) -> str | None:
    """The Qwen-VL processor class (`Qwen2_5_VLProcessor`, `Qwen3VLProcessor`) that `path`'s
    processor_config.json or preprocessor_config.json names, when it has an image-only variant here
    (a Qwen2-VL directory loads as Qwen2.5-VL's, whose image path is the same); None otherwise."""
    import json

    from verl.utils.vision import IMAGE_ONLY_PROCESSORS

    for name in ("processor_config.json", "preprocessor_config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            continue
        named = str(config.get("processor_class", ""))
        if named in IMAGE_ONLY_PROCESSORS:
            return named
        if "Qwen2" in named and "VL" in named:
            return "Qwen2_5_VLProcessor"
    return None


__all__ = ["hf_processor", "hf_tokenizer"]
