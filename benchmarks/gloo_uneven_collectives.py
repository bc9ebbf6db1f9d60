"""What gloo's uneven all-gather costs (verl/utils/megatron/gloo_collectives.py), and the uneven
reduce-scatter gloo has.

megatron's MoE token dispatcher at expert-tensor parallel > 1 gathers the tokens routed to this
rank's experts from the expert-tensor ranks in uneven pieces and reduce-scatters the experts' output
back in the same pieces. gloo refuses the uneven all-gather; ours is one broadcast per rank into
the output (`ours`). This times, on `--world` gloo ranks of this machine, ours against two
alternatives, padding each piece to the largest for gloo's even all-gather (`padded`) and one uneven
`all_to_all_single` of the rows repeated for every rank (`a2a`), and against
the even all-gather of the same number of real rows (`even`: what a native uneven one would at best
cost); and gloo's own uneven reduce-scatter (`reduce_scatter` with a list, which megatron calls;
`rs_*`) against the padded and even forms. `--tokens` rows per rank on average, the pieces
`1 - imbalance` and `1 + imbalance` times that, alternating by rank; hidden size `--hidden`, fp32.

    python benchmarks/gloo_uneven_collectives.py                       # 2 ranks, 4096 x 2048, ~20 s
    python benchmarks/gloo_uneven_collectives.py --imbalance 0.5

Last line: `bench gloo_uneven_collectives: gather_ours_ms=... gather_padded_ms=... gather_a2a_ms=... gather_even_ms=...
rs_gloo_ms=... rs_padded_ms=... rs_even_ms=... ...` (median milliseconds on rank 0 after one warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl.utils.machine import bench_headline


def _sizes(args) -> list[int]:
    low, high = round(args.tokens * (1 - args.imbalance)), round(args.tokens * (1 + args.imbalance))
    return [low if r % 2 == 0 else high for r in range(args.world)]


def _padded_gather(input_, sizes, group):
    largest, world, rank = max(sizes), dist.get_world_size(group), dist.get_rank(group)
    padded = input_.new_zeros((largest, *input_.shape[1:]))
    padded[: sizes[rank]] = input_
    gathered = input_.new_empty((world * largest, *input_.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    return torch.cat([gathered[r * largest : r * largest + n] for r, n in enumerate(sizes)])


def _padded_reduce_scatter(input_, sizes, group):
    largest, world, rank = max(sizes), dist.get_world_size(group), dist.get_rank(group)
    padded = input_.new_zeros((world, largest, *input_.shape[1:]))
    for r, piece in enumerate(torch.split(input_, sizes)):
        padded[r, : sizes[r]] = piece
    mine = input_.new_empty((largest, *input_.shape[1:]))
    dist.reduce_scatter_tensor(mine, padded.reshape(world * largest, *input_.shape[1:]), group=group)
    return mine[: sizes[rank]]


def _all_to_all_gather(input_, sizes, group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    output = input_.new_empty((sum(sizes), *input_.shape[1:]))
    copies = input_.repeat(world, *([1] * (input_.dim() - 1)))
    dist.all_to_all_single(
        output, copies, output_split_sizes=sizes, input_split_sizes=[sizes[rank]] * world, group=group
    )
    return output


def _gloo_reduce_scatter(input_, sizes, group):
    mine = input_.new_empty((sizes[dist.get_rank(group)], *input_.shape[1:]))
    dist.reduce_scatter(mine, list(torch.split(input_, sizes)), group=group)
    return mine


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def _rank(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VERL_DEVICE="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from verl.utils.megatron.gloo_collectives import all_gather_uneven

        sizes = _sizes(args)
        even = sum(sizes) // world
        group = dist.group.WORLD
        mine = torch.randn(sizes[rank], args.hidden)
        full = torch.randn(sum(sizes), args.hidden)
        even_in, even_full = torch.randn(even, args.hidden), torch.randn(even * world, args.hidden)
        even_out, even_all = torch.empty(even, args.hidden), torch.empty(even * world, args.hidden)
        # the two ways must agree before they are timed
        assert torch.equal(all_gather_uneven(mine, sizes, group), _padded_gather(mine, sizes, group))
        assert torch.equal(all_gather_uneven(mine, sizes, group), _all_to_all_gather(mine, sizes, group))
        torch.testing.assert_close(_gloo_reduce_scatter(full, sizes, group), _padded_reduce_scatter(full, sizes, group))
        timings = {
            "gather_ours": _median_ms(lambda: all_gather_uneven(mine, sizes, group), args.repeats),
            "gather_padded": _median_ms(lambda: _padded_gather(mine, sizes, group), args.repeats),
            "gather_a2a": _median_ms(lambda: _all_to_all_gather(mine, sizes, group), args.repeats),
            "gather_even": _median_ms(lambda: dist.all_gather_into_tensor(even_all, even_in), args.repeats),
            "rs_gloo": _median_ms(lambda: _gloo_reduce_scatter(full, sizes, group), args.repeats),
            "rs_padded": _median_ms(lambda: _padded_reduce_scatter(full, sizes, group), args.repeats),
            "rs_even": _median_ms(lambda: dist.reduce_scatter_tensor(even_out, even_full), args.repeats),
        }
        if rank == 0:
            with open(out, "w") as f:
                json.dump({**timings, "sizes": sizes}, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="expert-tensor ranks")
    parser.add_argument("--tokens", type=int, default=4096, help="rows per rank on average")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--imbalance", type=float, default=0.25, help="pieces are (1 -/+ this) x tokens")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(args.world, port, args, out), nprocs=args.world, join=True)
        with open(out) as f:
            r = json.load(f)
    sizes = r["sizes"]
    padding = args.world * max(sizes) / sum(sizes)
    print(
        f"split sizes {sizes} x {args.hidden}: all-gather ours {r['gather_ours']:.1f} ms, padded "
        f"{r['gather_padded']:.1f} ms, a2a {r['gather_a2a']:.1f} ms, even {r['gather_even']:.1f} ms; reduce-scatter gloo's {r['rs_gloo']:.1f} ms, "
        f"padded {r['rs_padded']:.1f} ms, even {r['rs_even']:.1f} ms; padded rows / real rows = {padding:.2f}"
    )
    fields = (
        f"gather_ours_ms={r['gather_ours']:.1f} gather_padded_ms={r['gather_padded']:.1f} gather_a2a_ms={r['gather_a2a']:.1f} "
        f"gather_even_ms={r['gather_even']:.1f} rs_gloo_ms={r['rs_gloo']:.1f} rs_padded_ms={r['rs_padded']:.1f} "
        f"rs_even_ms={r['rs_even']:.1f} padding={padding:.2f} "
        f"world={args.world} tokens={args.tokens} hidden={args.hidden} imbalance={args.imbalance}"
    )
    print(bench_headline("gloo_uneven_collectives", fields))


if __name__ == "__main__":
    main()
