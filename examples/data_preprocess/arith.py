"""Write the arithmetic task as train/test parquet files in upstream verl's RL schema.

    python examples/data_preprocess/arith.py --local_dir ~/data/arith
    python examples/data_preprocess/arith.py --local_dir ~/data/arith3 --digits 3 --ops +- --steps 2 --style word

The defaults (2-digit addition, 5000 train and 500 test problems, seed 0) are the task the bundled
`arith-tiny` model was trained on; `verl.utils.dataset.arith.ensure_arith_data()` writes the same
files into the cache on first use.
"""

import argparse
import os

from verl.utils.dataset.arith import DEFAULT_NUM_TEST, DEFAULT_NUM_TRAIN, STYLES, write_arith_parquet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dir", default="~/data/arith", help="output directory")
    parser.add_argument("--digits", type=int, default=2, help="digits per operand")
    parser.add_argument("--ops", default="+", help="operations to draw from, e.g. '+', '+-' or '+-*'")
    parser.add_argument("--steps", type=int, default=1, help="operations per problem")
    parser.add_argument("--style", default="plain", choices=STYLES, help="plain 'What is a+b?' or word problems")
    parser.add_argument("--num_train", type=int, default=DEFAULT_NUM_TRAIN)
    parser.add_argument("--num_test", type=int, default=DEFAULT_NUM_TEST)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    train_path, test_path = write_arith_parquet(
        os.path.expanduser(args.local_dir),
        num_train=args.num_train,
        num_test=args.num_test,
        digits=args.digits,
        ops=args.ops,
        steps=args.steps,
        style=args.style,
        seed=args.seed,
    )
    print(f"wrote {args.num_train} train problems to {train_path} and {args.num_test} test problems to {test_path}")


if __name__ == "__main__":
    main()
