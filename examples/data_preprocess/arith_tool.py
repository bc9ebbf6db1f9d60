"""Write the calculator task (two-operation arithmetic, answered with a tool) as train/test parquet.

    python examples/data_preprocess/arith_tool.py --local_dir ~/data/arith_tool

Each row has upstream verl's RL columns (`data_source="arith_tool"`, `agent_name="tool_agent"`,
`prompt`, `reward_model`, `extra_info`) and, for an SFT warm-start, `messages`: the transcript of a
perfect calculator user. See docs/multi_turn.md.
"""

import argparse
import os

from verl.utils.dataset.arith_tool import DEFAULT_NUM_TEST, DEFAULT_NUM_TRAIN, write_arith_tool_parquet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dir", default="~/data/arith_tool", help="output directory")
    parser.add_argument("--num_train", type=int, default=DEFAULT_NUM_TRAIN)
    parser.add_argument("--num_test", type=int, default=DEFAULT_NUM_TEST)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train_path, test_path = write_arith_tool_parquet(
        os.path.expanduser(args.local_dir), num_train=args.num_train, num_test=args.num_test, seed=args.seed
    )
    print(f"wrote {args.num_train} train problems to {train_path} and {args.num_test} test problems to {test_path}")


if __name__ == "__main__":
    main()
