"""The driver's own work per step in the prompt phase: drawing the next batch of training prompts.

While the driver draws a batch (dataset rows -> chat template -> token ids -> padded tensors ->
DataProto), both worker groups sit idle, so every millisecond here is a millisecond of the step.
This times exactly that phase, in one process, on the default run's data (`arith_demo`: the 32
prompts of `data.train_batch_size`, `PromptStream` over the composed config's training loader) and
leaves the workers out: they do not take part in it.

    python benchmarks/prompt_stream.py [--steps 200] [--repeats 5]

Prints the median over `--repeats` of the mean per-step milliseconds, wall clock and this
process's CPU time (the latter moves less with the machine's load), over `--steps` draws; every
repeat starts a new loader over the same dataset, so the first draws of each row are included
once. The last line is `bench prompt_stream: step_ms=... cpu_ms=... startup_s=... cpu=... load1=...`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from omegaconf import OmegaConf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="batches drawn per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; the median is reported")
    args = parser.parse_args()

    from verl.trainer.config import compose_config
    from verl.trainer.ppo.dataloaders import create_dataloaders
    from verl.trainer.ppo.rollout_source import PromptStream
    from verl.utils.dataset.rl_dataset import create_rl_dataset
    from verl.utils.machine import bench_headline
    from verl.utils.tokenizer import hf_tokenizer

    cfg = compose_config(config_name="arith_demo")
    OmegaConf.resolve(cfg)
    tokenizer = hf_tokenizer(cfg.actor_rollout_ref.model.path)
    start = time.perf_counter()
    dataset = create_rl_dataset(cfg.data.train_files, cfg.data, tokenizer)
    startup_s = time.perf_counter() - start

    per_step_ms, cpu_ms = [], []
    for _ in range(args.repeats):
        loader, _ = create_dataloaders(cfg.data, dataset)
        stream = PromptStream(loader, current_step=lambda: 1)
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            stream()
        per_step_ms.append(1000 * (time.perf_counter() - start) / args.steps)
        cpu_ms.append(1000 * (time.process_time() - cpu_start) / args.steps)
        print(f"repeat: {per_step_ms[-1]:.3f} ms/step wall, {cpu_ms[-1]:.3f} ms/step CPU over {args.steps} steps")
    fields = (
        f"step_ms={statistics.median(per_step_ms):.3f} cpu_ms={statistics.median(cpu_ms):.3f} "
        f"startup_s={startup_s:.3f} rows={len(dataset)}"
    )
    print(bench_headline("prompt_stream", fields))


if __name__ == "__main__":
    main()
