"""Write a tiny multi-turn chat dataset for trying multi-turn SFT (``data.multiturn.enable=true``).

    python examples/data_preprocess/multiturn.py --local_dir ~/data/multiturn

No download: three hand-written conversations (system, user, assistant, user, assistant) in upstream's
schema, one column ``messages``; the first two go to ``train.parquet``, the last to ``test.parquet``.
"""

from __future__ import annotations

import argparse

from verl.utils.dataset import preprocess

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}

CONVERSATIONS = [
    [
        SYSTEM,
        {"role": "user", "content": "Which planet is closest to the Sun?"},
        {"role": "assistant", "content": "Mercury is the planet closest to the Sun."},
        {"role": "user", "content": "And the largest one?"},
        {"role": "assistant", "content": "Jupiter is the largest planet of the solar system."},
    ],
    [
        SYSTEM,
        {"role": "user", "content": "What does a compiler do?"},
        {
            "role": "assistant",
            "content": "A compiler translates a program written in a high-level language into machine code "
            "(or another lower-level form) before the program runs.",
        },
        {"role": "user", "content": "How does an interpreter differ?"},
        {
            "role": "assistant",
            "content": "An interpreter executes the program directly, statement by statement, instead of "
            "producing a separate translated program first.",
        },
    ],
    [
        SYSTEM,
        {"role": "user", "content": "Write a Python function that sums a list of numbers."},
        {
            "role": "assistant",
            "content": "```python\ndef total(numbers):\n    result = 0\n    for x in numbers:\n        result += x\n"
            "    return result\n```\n\nIt adds the numbers one at a time.",
        },
        {"role": "user", "content": "Can you make it shorter?"},
        {
            "role": "assistant",
            "content": "```python\ndef total(numbers):\n    return sum(numbers)\n```\n\n"
            "The built-in sum does the same loop.",
        },
    ],
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    preprocess.add_io_args(parser, default_save_dir="~/data/multiturn", local_dataset=False, local_dir_deprecated=False)
    args = parser.parse_args(argv)
    rows = [{"messages": messages} for messages in CONVERSATIONS]
    preprocess.write_splits({"train": rows[:2], "test": rows[2:]}, preprocess.save_dir(args), args.hdfs_dir)


if __name__ == "__main__":
    main()
