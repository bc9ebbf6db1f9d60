"""Write the synthetic colour-naming task (images in parquet) as train/test files, offline.

    python examples/data_preprocess/vl_colors.py --local_save_dir ~/data/vl_colors
    python examples/data_preprocess/vl_colors.py --local_save_dir ~/data/vl_colors2 --colors red,blue --num_train 256

Each row holds one solid-colour image and the question "Which color: red, green, blue or yellow?";
the answer (data_source "vl_colors", scored by exact match) is only in the pixels. The layout is the
one examples/data_preprocess/geo3k.py writes, so it trains a vision-language model (e.g. the tiny-vl
preset) with the same data keys as Geometry3K. `--answer_style letter` asks for the first letter
(r, g, b, y): with data.max_response_length=1 a randomly initialised model can learn it by RL.
See verl/utils/dataset/vl_colors.py.
"""

import argparse

from verl.utils.dataset.vl_colors import (
    ANSWER_STYLES,
    COLORS,
    DEFAULT_NUM_TEST,
    DEFAULT_NUM_TRAIN,
    write_vl_colors_parquet,
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_save_dir", "--local_dir", dest="local_save_dir", default="~/data/vl_colors")
    parser.add_argument("--num_train", type=int, default=DEFAULT_NUM_TRAIN)
    parser.add_argument("--num_test", type=int, default=DEFAULT_NUM_TEST)
    parser.add_argument("--colors", default=",".join(COLORS), help=f"comma-separated, out of {','.join(COLORS)}")
    parser.add_argument("--image_size", type=int, default=56, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--answer_style", default="word", choices=ANSWER_STYLES, help="answer with the word or its first letter"
    )
    args = parser.parse_args(argv)

    colors = tuple(c.strip() for c in args.colors.split(",") if c.strip())
    train, test = write_vl_colors_parquet(
        args.local_save_dir,
        args.num_train,
        args.num_test,
        args.seed,
        colors,
        args.image_size,
        answer_style=args.answer_style,
    )
    print(f"wrote {args.num_train} train rows to {train} and {args.num_test} test rows to {test}")


if __name__ == "__main__":
    main()
