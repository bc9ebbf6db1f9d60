"""`python -m verl.models.make_tiny --preset tiny --out DIR`: write a randomly initialised preset
model and its tokenizer as an HF directory. `--list` prints the presets."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    from verl.models.factory import PRESETS, make_tiny, preset_table

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size (see --list)")
    parser.add_argument("--out", help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="saved weight dtype")
    parser.add_argument("--list", action="store_true", help="print the presets and exit")
    args = parser.parse_args(argv)
    if args.list:
        print(preset_table())
        return
    if not args.out:
        parser.error("--out DIR is required (where to write the model)")
    out = make_tiny(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote preset {args.preset!r} (seed {args.seed}, {args.dtype}) to {out}")


if __name__ == "__main__":
    main()
