"""Speed paths: the optional fast code paths a run may take, whether each is on, and why not.

A speed path changes how fast a run goes, never what it computes, so when one that the config
asks for cannot be used the run goes on without it. It must never do so silently (a transformers
release once turned the shared-prompt forward off without a word and made every GRPO step 1.5x
slower). Each path therefore reports a `SpeedPath`, decided by the code that takes the path:

    name                   decided by                               asked for by
    shared_prompt_forward  the actor (verl.utils.shared_prompt)     actor.share_prompt_forward
    remove_padding         the actor and critic workers             model.use_remove_padding
    fused_kernels          the FSDP actor (verl.utils.experimental) actor.use_fused_kernels, model.use_fused_kernels
    cuda_graphs            the built-in rollout engine              a CUDA device (engine_kwargs.hf.enforce_eager)
    shm_transport          the driver's worker groups               VERL_SHM_TRANSPORT (on unless set to 0)

and the trainer makes it visible three ways: one log line per path at start (a warning for a path
asked for but off, with the reason), a metric `perf/<name>` (1.0 on, 0.0 off) in every step's
metrics, and `speed_paths.yaml` in the run directory beside the saved config. A path that is not
asked for is reported too (off, "not requested"), so a user comparing two runs sees the difference.

Several processes decide the same path (every actor rank, the actor and the reference): `merge`
keeps one entry per name, on only where it is on everywhere it was asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["SPEED_PATHS_FILE", "SpeedPath", "merge", "metrics", "report", "save"]

logger = logging.getLogger(__name__)

SPEED_PATHS_FILE = "speed_paths.yaml"


@dataclass(frozen=True)
class SpeedPath:
    """One speed path's state in this run."""

    name: str
    """Short name, also the metric's suffix (`perf/<name>`)."""
    requested: bool
    """Whether the config (or environment) asks for it."""
    active: bool
    """Whether the run takes it."""
    reason: str = ""
    """Why it is off although requested (empty otherwise), or what it is partly limited by."""

    @property
    def metric(self) -> str:
        return f"perf/{self.name}"

    def describe(self) -> str:
        """One line for the log: `name: on`, `name: off (not requested)` or `name: OFF although requested: why`."""
        if self.active:
            return f"{self.name}: on" + (f" ({self.reason})" if self.reason else "")
        if not self.requested:
            return f"{self.name}: off (not requested" + (f": {self.reason})" if self.reason else ")")
        return f"{self.name}: OFF although requested: {self.reason}"

    @property
    def degraded(self) -> bool:
        """Asked for, but off (the case that must never be silent)."""
        return self.requested and not self.active

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SpeedPath:
        return cls(**d)


def merge(paths: Iterable[SpeedPath]) -> list[SpeedPath]:
    """One entry per name, in first-seen order: requested where any was, on only where every
    requesting one is on; the distinct reasons are joined."""
    by_name: dict[str, list[SpeedPath]] = {}
    for path in paths:
        by_name.setdefault(path.name, []).append(path)
    merged = []
    for name, group in by_name.items():
        requested = [p for p in group if p.requested]
        active = all(p.active for p in requested) if requested else any(p.active for p in group)
        reasons = list(dict.fromkeys(p.reason for p in group if p.reason))
        merged.append(SpeedPath(name, bool(requested), active, "; ".join(reasons)))
    return merged


_reported: set[tuple] = set()


def report(paths: Iterable[SpeedPath], log: logging.Logger = logger) -> None:
    """Log each path once per process (a path that changes state is logged again): a warning for
    one asked for but off, info otherwise."""
    for path in paths:
        key = (path.name, path.requested, path.active, path.reason)
        if key in _reported:
            continue
        _reported.add(key)
        log.log(logging.WARNING if path.degraded else logging.INFO, "speed path %s", path.describe())


def metrics(paths: Iterable[SpeedPath]) -> dict[str, float]:
    """`perf/<name>`: 1.0 when on, 0.0 when off."""
    return {path.metric: float(path.active) for path in paths}


def save(paths: Iterable[SpeedPath], run_dir: str | Path) -> Path:
    """Write `<run_dir>/speed_paths.yaml` (name -> requested, active, reason) and return its path."""
    import yaml

    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / SPEED_PATHS_FILE
    body = {p.name: {"requested": p.requested, "active": p.active, "reason": p.reason} for p in paths}
    target.write_text(yaml.safe_dump(body, sort_keys=False))
    return target


def model_speed_paths(trainer, remove_padding: bool, fused: bool) -> list[SpeedPath]:
    """Remove padding and fused kernels of an actor, reference, critic or reward model (`trainer`), as its
    sections ask for them (see `verl.utils.speed_paths`): `remove_padding` the model's
    `use_remove_padding`, `fused` its `use_fused_kernels` or `use_liger` (or the actor's
    `use_fused_kernels`, which upstream's YAML takes from the model's). Fused kernels are on where the
    trainer takes them (its `use_fused_kernels`: the FSDP actor and reference, see
    `verl.utils.experimental.torch_functional`); `use_liger` alone is reported off."""
    packs = remove_padding and bool(getattr(trainer, "use_remove_padding", False))
    fuses = fused and bool(getattr(trainer, "use_fused_kernels", False))
    if fuses:
        fused_reason = getattr(trainer, "fused_kernels_note", "")
    elif not fused:
        fused_reason = ""
    elif hasattr(trainer, "use_fused_kernels"):
        fused_reason = "use_liger is not implemented; set use_fused_kernels=true for the fused log-prob and entropy"
    else:
        fused_reason = f"{type(trainer).__name__} does not implement it: it computes full logits"
    return [
        SpeedPath(
            "remove_padding",
            remove_padding,
            packs,
            ""
            if packs or not remove_padding
            else f"{type(trainer).__name__} does not implement it: it runs padded rows",
        ),
        SpeedPath("fused_kernels", fused, fuses, fused_reason),
    ]
