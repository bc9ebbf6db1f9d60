"""Experiment tracking: one `Tracking` object fans each step's metrics out to the chosen backends.

Upstream-compatible surface: `Tracking(project_name, experiment_name, default_backend, config)`,
`.log(data, step)`, `.finish()`, and the backend names of `trainer.logger`.

Backends (each imported only when chosen, so `import verl` stays light):
- console: one compact line per step, keys sorted, floats to 4 significant digits; printed with
  `tqdm.write` so it does not tear a progress bar.
- file: JSONL, one `{"step": N, "data": {...}}` object per `log` call (upstream's format) at
  `$VERL_FILE_LOGGER_PATH`, else `<run_dir>/metrics.jsonl`; appended to, so a resumed run
  continues the same file.
- mlflow (the optional extra `verl[mlflow]`, not installed by default): `$MLFLOW_TRACKING_URI`, else a local file store `./mlruns` (MLflow 3 refuses file stores
  unless `MLFLOW_ALLOW_FILE_STORE=true`, which is set for that default only). Experiment =
  project, run = experiment name, the flattened config as params. MLflow forbids some characters
  in metric names; as upstream (so dashboards match) `@` becomes `_at_`, runs of slashes one slash,
  any other forbidden character `_` (`train/lr(1e-3)` is `train/lr_1e-3_`), warned once per key.
- tensorboard: `trainer.tensorboard_dir`, else `$TENSORBOARD_DIR`, else `<run_dir>/tensorboard`.
- wandb: `$WANDB_DIR`, else `<run_dir>`. Without credentials (no `WANDB_API_KEY`, no netrc
  entry) and no explicit `WANDB_MODE`, the run is written offline (`wandb sync` uploads it later)
  instead of failing on a machine without network.
- swanlab (the optional extra `verl[swanlab]`): upstream's environment variables. `SWANLAB_API_KEY`
  logs in first; `SWANLAB_LOG_DIR` is where the run's files go, else `<run_dir>/swanlog` (upstream:
  `./swanlog`; here, like wandb's, it follows the run directory so runs do not mix in the working
  directory); `SWANLAB_MODE` (cloud, local, offline, disabled) is the mode, else `cloud` with an API
  key and `offline` without one (upstream defaults to cloud, which asks for a login on a terminal
  or fails without network; `swanlab sync <dir>` uploads an offline run later). The config is sent
  with `FRAMEWORK: verl` added, as upstream does.

- clearml (the optional extra `verl[clearml]`): upstream's task (`Task.init(project, experiment,
  continue_last_task=True, output_uri=False)`, the config as the `Hyperparameters` configuration), each
  metric `a/b/c` as series `b/c` of graph `a` (upstream splits at the first `/` too; a name without one,
  which upstream's split fails on, is its own graph and series). Offline when ClearML has no server
  configured (no `CLEARML_API_ACCESS_KEY`/`CLEARML_API_HOST` and no `clearml.conf`) and
  `CLEARML_OFFLINE_MODE` is not set: the session is kept under `$CLEARML_CACHE_DIR/offline/` (default
  `~/.clearml/cache/offline/`) for `Task.import_offline_session` to upload later.
- `tracking` is upstream's older name of wandb. `vemlp_wandb` (the Volcano Engine ML platform) and
  `trackio` are refused with the reason.

Validation samples (`trainer.log_val_generations`): `log_generations(samples, step)` hands each
(input, output, score) to the backends that keep them, in upstream's layouts: file appends
`<run_dir>/val_generations.jsonl`, mlflow logs the artifact `val_step<step>.json`, tensorboard text
under `val/generations`, wandb a `val/generations` table with one row per validation (logged whole each
time), swanlab an echarts table, clearml a `Validation` table; the console shows none. `select_val_generations` picks upstream's
samples and `ValidationGenerationsLogger` is upstream's entry point (it writes into the running `Tracking`).

`finish()` also draws reward, validation accuracy and response length against step into
`<run_dir>/training_curves.png` (when any of those metrics was logged) and attaches the PNG to the
mlflow and wandb runs. Only scalar values reach mlflow/swanlab/tensorboard/wandb; console and file keep
everything.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import numbers
import os
import re
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from verl.utils.plotting import is_plotted_metric

BACKENDS = ("clearml", "console", "file", "mlflow", "swanlab", "tensorboard", "tracking", "wandb")
_ALIASES = {"tracking": "wandb"}  # upstream's older name of the wandb backend
# upstream's backends not in this build -> what they are (trainer.logger refuses them by name, with this)
BACKENDS_NOT_IN_THIS_BUILD = {
    "vemlp_wandb": "the Volcano Engine ML platform's wandb (volcengine_ml_platform)",
    "trackio": "trackio (its releases need pillow<13, this build's lock holds pillow 13)",
}
_NOT_HERE = {
    b: f"{why} is not in this build; use another tracker (wandb, mlflow, tensorboard, ...)"
    for b, why in BACKENDS_NOT_IN_THIS_BUILD.items()
}
# backend -> (module that must import, install command)
_BACKEND_PACKAGES = {
    "clearml": ("clearml", "pip install clearml"),
    # an optional extra (`verl[mlflow]`): mlflow pulls in a web server, SQLAlchemy, ... that no other path needs
    "mlflow": ("mlflow", "pip install mlflow"),
    "swanlab": ("swanlab", "pip install swanlab"),
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
}
CURVES_PNG = "training_curves.png"
GENERATIONS_KEY = "val/generations"  # upstream's key of the validation samples in every tracker
_LIVE: list[weakref.ref] = []  # the Tracking objects not finished yet, oldest first


def missing_backend_packages(backends: Iterable[str]) -> list[tuple[str, str]]:
    """(backend, install command) for each chosen backend whose package is not importable."""
    missing = []
    for b in dict.fromkeys(_ALIASES.get(b, b) for b in backends):
        if b in _BACKEND_PACKAGES and importlib.util.find_spec(_BACKEND_PACKAGES[b][0]) is None:
            missing.append((b, _BACKEND_PACKAGES[b][1]))
    return missing


def _scalar(v: Any) -> float | None:
    """A float for number-like values (python and numpy numbers, one-element arrays/tensors), else None."""
    if isinstance(v, numbers.Number) and not isinstance(v, complex):
        return float(v)
    item, size = getattr(v, "item", None), getattr(v, "size", None)
    if callable(size):  # torch.Tensor.size is a method; numel is the element count
        size = v.numel() if hasattr(v, "numel") else None
    if item is not None and size == 1:
        try:
            return float(item())
        except (TypeError, ValueError):
            return None
    return None


def _jsonable(v: Any) -> Any:
    s = _scalar(v)
    if s is not None:
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else s
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, str):
        return v
    return str(v)


def _fmt(v: Any) -> str:
    s = _scalar(v)
    if s is None:
        return str(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return f"{s:.4g}"


# ------------------------------------------------------------------------------------ mlflow keys

_MLFLOW_FORBIDDEN = re.compile(r"[^/\w.\- :]")
_warned_mlflow_keys: set[str] = set()


def sanitize_mlflow_key(name: str, *, logger: logging.Logger | None = None, warned: set[str] | None = None) -> str:
    """An MLflow-legal metric name, upstream's mapping (so dashboards match): `@` -> `_at_`, runs of
    slashes -> one slash, any other character MLflow forbids -> `_`. Each renamed key is warned about
    once: on `logger` (default: this module's) and once per `warned` set (default: per process)."""
    safe = _MLFLOW_FORBIDDEN.sub("_", re.sub(r"/+", "/", name.replace("@", "_at_")))
    warned = _warned_mlflow_keys if warned is None else warned
    if safe != name and name not in warned:
        warned.add(name)
        (logger or logging.getLogger(__name__)).warning(
            "[MLflow] metric key %r logged as %r (MLflow forbids some characters)", name, safe
        )
    return safe


def flatten_config(config: Any, sep: str = ".") -> dict[str, str]:
    """Nested config -> {dotted key: string value} (lists kept as one value)."""
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(config, DictConfig | ListConfig):
            config = OmegaConf.to_container(config, resolve=True, throw_on_missing=False)
    except ImportError:  # omegaconf is a dependency; plain dicts work without it
        pass
    flat: dict[str, str] = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{sep}{k}" if prefix else str(k))
        else:
            flat[prefix] = json.dumps(node) if isinstance(node, list | dict) else str(node)

    walk(config, "")
    return flat


# ----------------------------------------------------------------------------------- backends


class ConsoleLogger:
    """One line per step: `step 12 | a/x=0.5 b/y=3`."""

    def log(self, data: dict, step: int) -> None:
        line = f"step {step} | " + " ".join(f"{k}={_fmt(data[k])}" for k in sorted(data))
        try:
            from tqdm import tqdm

            tqdm.write(line)
        except ImportError:  # tqdm is a dependency; stay usable without it
            print(line, flush=True)

    def finish(self) -> None:
        pass


class FileLogger:
    """JSONL metrics, one object per `log` call."""

    def __init__(self, run_dir: Path):
        self.path = Path(os.environ.get("VERL_FILE_LOGGER_PATH") or run_dir / "metrics.jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.generations_path = run_dir / "val_generations.jsonl"
        self._fp = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run

    def log(self, data: dict, step: int) -> None:
        self._fp.write(json.dumps({"step": step, "data": _jsonable(data)}) + "\n")
        self._fp.flush()

    def log_generations(self, samples: list[tuple], step: int) -> None:
        self.generations_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.generations_path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **_generation_record(s)}) + "\n" for s in samples)

    def finish(self) -> None:
        if not self._fp.closed:
            self._fp.close()


class MlflowLogger:
    """An MLflow run driven through `MlflowClient` (no global active-run state)."""

    _BATCH = 100  # MLflow accepts at most 100 params (1000 metrics) per batch call

    def __init__(self, project_name: str, experiment_name: str, config: Any):
        import mlflow
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = "file:" + str(Path("mlruns").resolve())
            if not os.environ.get("MLFLOW_ALLOW_FILE_STORE"):
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.tracking_uri = uri
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project_name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project_name)
        self.run_id = self.client.create_run(exp_id, run_name=experiment_name).info.run_id
        params = [Param(sanitize_mlflow_key(k)[:250], v[:6000]) for k, v in flatten_config(config).items()]
        for i in range(0, len(params), self._BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + self._BATCH], synchronous=True)
        self._finished = False

    def log(self, data: dict, step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for k, v in data.items():
            s = _scalar(v)
            if s is not None and math.isfinite(s):
                metrics.append(Metric(sanitize_mlflow_key(k), s, now, step))
        # synchronous: a process-wide `mlflow.config.enable_async_logging()` (rollout tracing turns it on,
        # as upstream's does) would otherwise queue the batch, and a step could be lost or read back late
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000], synchronous=True)

    def log_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_generations(self, samples: list[tuple], step: int) -> None:
        # upstream's artifact: val_step<step>.json at the run's artifact root, a list of {input, output, score}
        self.log_text(json.dumps([_generation_record(s) for s in samples]), f"val_step{step}.json")

    @classmethod
    def attach(cls, run_id: str, tracking_uri: str | None = None) -> MlflowLogger:
        """A logger writing to an MLflow run someone else started (`mlflow.start_run`)."""
        import mlflow

        self = cls.__new__(cls)
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id = run_id
        self._finished = True  # not ours to terminate
        return self

    def finish(self) -> None:
        if not self._finished:
            self.client.set_terminated(self.run_id)
            self._finished = True


class _MlflowLoggingAdapter:
    """Upstream's mlflow backend object (its tests import it): `log(data, step)` sends the metrics to the
    ACTIVE MLflow run (`mlflow.log_metrics`, which starts one when none is), keys mapped by
    `sanitize_mlflow_key` and each renamed key warned about once per adapter on `self.logger`.
    `Tracking` uses `MlflowLogger` (its own run through `MlflowClient`, config as params); this one is
    for code that drives the run itself with `mlflow.start_run`. Values that are not numbers are left
    out (upstream hands them to MLflow, which refuses them)."""

    def __init__(self):
        self.logger = logging.getLogger(__name__)
        self._warned: set[str] = set()

    def log(self, data: dict, step: int) -> None:
        import mlflow

        metrics = {}
        for k, v in data.items():
            s = _scalar(v)
            if s is not None:
                metrics[sanitize_mlflow_key(k, logger=self.logger, warned=self._warned)] = s
        mlflow.log_metrics(metrics=metrics, step=step)


class TensorboardLogger:
    """Scalars through torch's SummaryWriter."""

    def __init__(self, run_dir: Path, log_dir: str | os.PathLike | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir or os.environ.get("TENSORBOARD_DIR") or run_dir / "tensorboard")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, data: dict, step: int) -> None:
        for k, v in data.items():
            s = _scalar(v)
            if s is not None:
                self.writer.add_scalar(k, s, step)
        self.writer.flush()

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def log_generations(self, samples: list[tuple], step: int) -> None:
        parts = [f"**Validation generations, step {step}**"]
        for i, sample in enumerate(samples, 1):
            r = _generation_record(sample)
            parts.append(
                f"### Sample {i}\n**Input:** {r['input']}\n\n**Output:** {r['output']}\n\n**Score:** {r['score']}"
            )
        self.log_text(GENERATIONS_KEY, "\n\n---\n\n".join(parts), step)

    def finish(self) -> None:
        self.writer.close()


def _wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger:
    """A wandb run; offline when there are no credentials and WANDB_MODE is not set."""

    def __init__(self, project_name: str, experiment_name: str, config: Any, run_dir: Path):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_has_credentials() else "offline")
        directory = Path(os.environ.get("WANDB_DIR") or run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = None
        if config is not None:
            from omegaconf import DictConfig, OmegaConf

            cfg = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config
        self.mode = mode
        self.run = wandb.init(project=project_name, name=experiment_name, config=cfg, dir=str(directory), mode=mode)
        self._generation_rows: list[list] = []

    @classmethod
    def attach(cls, run) -> WandbLogger:
        """A logger writing to a wandb run someone else started (`wandb.init`)."""
        self = cls.__new__(cls)
        self.mode, self.run, self._generation_rows = getattr(run, "mode", None), run, []
        return self

    def log(self, data: dict, step: int) -> None:
        scalars = {k: s for k, v in data.items() if (s := _scalar(v)) is not None}
        self.run.log(scalars, step=step)

    def log_generations(self, samples: list[tuple], step: int) -> None:
        """One table row per validation (upstream's layout: step, then input_i, output_i, score_i per
        sample), logged whole each time since a wandb table cannot grow after it is logged."""
        import wandb

        row = [step]
        for sample in samples:
            r = _generation_record(sample)
            row += [r["input"], r["output"], r["score"]]
        self._generation_rows.append(row)
        width = max(len(r) for r in self._generation_rows)  # a smaller validation set leaves cells empty
        columns = ["step"] + [f"{k}_{i}" for i in range(1, (width - 1) // 3 + 1) for k in ("input", "output", "score")]
        rows = [r + [None] * (width - len(r)) for r in self._generation_rows]
        self.run.log({GENERATIONS_KEY: wandb.Table(columns=columns, data=rows)}, step=step)

    def log_artifact(self, path: str | Path) -> None:
        import wandb

        self.run.log({Path(path).stem: wandb.Image(str(path))})

    def finish(self) -> None:
        self.run.finish()


class SwanlabLogger:
    """A swanlab run; offline when there is no API key and SWANLAB_MODE is not set."""

    def __init__(self, project_name: str, experiment_name: str, config: Any, run_dir: Path):
        import swanlab

        api_key = os.environ.get("SWANLAB_API_KEY")
        if api_key:
            swanlab.login(api_key)
        self.mode = os.environ.get("SWANLAB_MODE") or ("cloud" if api_key else "offline")
        self.log_dir = Path(os.environ.get("SWANLAB_LOG_DIR") or run_dir / "swanlog")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cfg: dict = {}
        if config is not None:
            from omegaconf import DictConfig, OmegaConf

            cfg = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
        self.run = swanlab.init(
            project=project_name,
            experiment_name=experiment_name,
            config={"FRAMEWORK": "verl", **cfg},
            logdir=str(self.log_dir),
            mode=self.mode,
        )
        self._finished = False

    @classmethod
    def attach(cls, run) -> SwanlabLogger:
        """A logger writing to a swanlab run someone else started (`swanlab.init`)."""
        self = cls.__new__(cls)
        self.run, self.mode, self._finished = run, None, True
        return self

    def log(self, data: dict, step: int) -> None:
        scalars = {k: s for k, v in data.items() if (s := _scalar(v)) is not None}
        self.run.log(scalars, step=step)

    def log_generations(self, samples: list[tuple], step: int) -> None:
        """An echarts table (step, input, output, score), one row per sample (upstream's layout)."""
        import swanlab

        table = swanlab.echarts.Table()
        rows = [[step, *(_generation_record(s)[k] for k in ("input", "output", "score"))] for s in samples]
        table.add(headers=["step", "input", "output", "score"], rows=rows)
        self.run.log({GENERATIONS_KEY: table}, step=step)

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.run.finish()


def _clearml_has_server() -> bool:
    """Whether ClearML is configured for a server: API credentials in the environment, or a config file."""
    if os.environ.get("CLEARML_API_ACCESS_KEY") or os.environ.get("CLEARML_API_HOST"):
        return True
    config_file = os.environ.get("CLEARML_CONFIG_FILE") or os.path.expanduser("~/clearml.conf")
    return os.path.isfile(config_file)


class ClearMLLogger:
    """A ClearML task (upstream's: `Task.init(project, experiment, continue_last_task=True, output_uri=False)`,
    the config as the `Hyperparameters` configuration). Offline (`Task.set_offline`) when ClearML has no server
    configured (no `CLEARML_API_ACCESS_KEY` / `CLEARML_API_HOST`, no `clearml.conf`) and `CLEARML_OFFLINE_MODE`
    is not set: the session is kept under ClearML's cache (`$CLEARML_CACHE_DIR/offline/`, a zip that
    `Task.import_offline_session` uploads later) instead of failing without a server."""

    def __init__(self, project_name: str, experiment_name: str, config: Any):
        from clearml import Task

        explicit = os.environ.get("CLEARML_OFFLINE_MODE")
        self.offline = explicit.lower() in ("1", "true", "yes") if explicit else not _clearml_has_server()
        if self.offline:
            Task.set_offline(True)
        self.task = Task.init(
            project_name=project_name, task_name=experiment_name, continue_last_task=True, output_uri=False
        )
        if config is not None:
            from omegaconf import DictConfig, OmegaConf

            cfg = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
            self.task.connect_configuration(cfg, name="Hyperparameters")
        self.offline_folder = self.task.get_offline_mode_folder() if self.offline else None
        self._finished = False

    def log(self, data: dict, step: int) -> None:
        """Each scalar as series `<rest>` of graph `<first part>` of its name (`critic/score/mean`: graph
        `critic`, series `score/mean`); a name without `/` is its own graph and series."""
        logger = self.task.get_logger()
        for key, value in data.items():
            if (scalar := _scalar(value)) is None:
                continue
            title, _, series = key.partition("/")
            logger.report_scalar(title=title, series=series or title, value=scalar, iteration=step)

    def log_generations(self, samples: list[tuple], step: int) -> None:
        """A table (step, input, output, score), one row per sample (upstream's: graph `Validation`, series
        `Validation generations`)."""
        import pandas as pd

        rows = [{"step": step, **_generation_record(s)} for s in samples]
        table = pd.DataFrame.from_records(rows, columns=["step", "input", "output", "score"])
        self.task.get_logger().report_table(
            title="Validation", series="Validation generations", table_plot=table, iteration=step
        )

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.task.close()


# ------------------------------------------------------------------------------------- facade


def _default_run_dir(project_name: str, experiment_name: str, config: Any) -> Path:
    try:
        run_dir = config["trainer"]["run_dir"]
    except (KeyError, TypeError, IndexError):
        run_dir = None
    return Path(run_dir) if run_dir else Path("outputs") / project_name / experiment_name


def _trainer_key(config: Any, key: str):
    """`config.trainer.<key>` of a run's config (dict or DictConfig), or None."""
    trainer = (config or {}).get("trainer") if hasattr(config or {}, "get") else None
    return trainer.get(key) if hasattr(trainer, "get") else None


class Tracking:
    """Log metrics to several backends at once (see the module docstring for each backend).

    project_name, experiment_name: tracker project and run names.
    default_backend: a backend name or a list of them (`trainer.logger`).
    config: the run's config (logged as params/config by mlflow and wandb; its
        `trainer.run_dir` is the default run directory).
    run_dir: where file/tensorboard/wandb output and the curves PNG go; default
        `config.trainer.run_dir`, else `outputs/<project>/<experiment>`.
    """

    supported_backend = list(BACKENDS)

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | list[str] = "console",
        config: Any = None,
        run_dir: str | os.PathLike | None = None,
    ):
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        not_here = [f"{b!r}: {_NOT_HERE[b]}" for b in backends if b in _NOT_HERE]
        if not_here:
            raise ValueError(f"trainer.logger names backends this verl does not have: {'; '.join(not_here)}")
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(
                f"unknown tracking backend(s) {unknown} in trainer.logger; valid backends: {', '.join(BACKENDS)}"
            )
        missing = missing_backend_packages(backends)
        if missing:
            raise ImportError(
                "; ".join(
                    f"trainer.logger includes {b!r} but its package is not installed: run `{cmd}`" for b, cmd in missing
                )
                + " (or remove it from trainer.logger)"
            )
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.run_dir = Path(run_dir) if run_dir is not None else _default_run_dir(project_name, experiment_name, config)
        self.logger: dict[str, Any] = {}
        for b in dict.fromkeys(_ALIASES.get(b, b) for b in backends):
            if b == "console":
                self.logger[b] = ConsoleLogger()
            elif b == "file":
                self.logger[b] = FileLogger(self.run_dir)
            elif b == "mlflow":
                self.logger[b] = MlflowLogger(project_name, experiment_name, config)
            elif b == "tensorboard":
                self.logger[b] = TensorboardLogger(self.run_dir, _trainer_key(config, "tensorboard_dir"))
            elif b == "wandb":
                self.logger[b] = WandbLogger(project_name, experiment_name, config, self.run_dir)
            elif b == "swanlab":
                self.logger[b] = SwanlabLogger(project_name, experiment_name, config, self.run_dir)
            elif b == "clearml":
                self.logger[b] = ClearMLLogger(project_name, experiment_name, config)
        self._history: list[dict] = []
        self._finished = False
        _LIVE.append(weakref.ref(self))

    def log(self, data: dict, step: int, backend: str | list[str] | None = None) -> None:
        """Send `data` (metric name -> value) for `step` to every backend (or only to `backend`)."""
        for logger in self._loggers(backend):
            logger.log(data=data, step=step)
        kept = {k: s for k, v in data.items() if is_plotted_metric(k) and (s := _scalar(v)) is not None}
        if kept:
            self._history.append({"step": step, "data": kept})

    def log_artifact(self, path: str | os.PathLike) -> None:
        """Attach a file (e.g. a plot) to the mlflow and wandb runs, when those backends are on."""
        for name in ("mlflow", "wandb"):
            if name in self.logger:
                self.logger[name].log_artifact(path)

    def log_generations(self, samples: list[tuple], step: int, backend: str | list[str] | None = None) -> None:
        """Record validation samples, each (input, output, score), for `step` with every backend that keeps
        them (or only with `backend`): file appends `<run_dir>/val_generations.jsonl`; mlflow the artifact
        `val_step<step>.json`; tensorboard text under `val/generations`; wandb a table `val/generations`
        with one row per call; swanlab an echarts table; clearml a table. The console shows none."""
        if not samples:
            return
        for logger in self._loggers(backend):
            if hasattr(logger, "log_generations"):
                logger.log_generations(samples, step)

    def _loggers(self, backend: str | list[str] | None) -> list:
        """The backends' loggers, or only those named by `backend` (a name or a list of names)."""
        if backend is None:
            return list(self.logger.values())
        names = [backend] if isinstance(backend, str) else list(backend)
        return [logger for name, logger in self.logger.items() if name in names]

    def plot_curves(self) -> Path | None:
        """Draw the training curves logged so far into `<run_dir>/training_curves.png`; None if nothing to draw."""
        if not self._history:
            return None
        from verl.utils.plotting import plot_curves_from_records

        return plot_curves_from_records(self._history, self.run_dir / CURVES_PNG)

    def finish(self) -> None:
        """Plot the curves, attach them to mlflow/wandb, and close every backend (idempotent)."""
        if self._finished:
            return
        self._finished = True
        _LIVE[:] = [r for r in _LIVE if r() not in (None, self)]
        png = self.plot_curves()
        if png is not None:
            self.log_artifact(png)
        for logger in self.logger.values():
            logger.finish()

    def __del__(self):
        # Best effort for users who never call finish(); at interpreter exit modules may be gone.
        try:
            if not getattr(self, "_finished", True):
                for logger in self.logger.values():
                    logger.finish()
        except Exception:
            pass


# ----------------------------------------------------------------------- validation samples


def _generation_record(sample) -> dict:
    """{input, output, score} of one (input, output, score) sample, the score made JSON-able."""
    if len(sample) != 3:
        raise ValueError(f"a validation sample is (input, output, score); got {len(sample)} values: {sample!r}")
    text_in, text_out, score = sample
    return {"input": text_in, "output": text_out, "score": _jsonable(score)}


def select_val_generations(inputs, outputs, scores, n: int) -> list[tuple]:
    """The `n` validation samples upstream logs (`trainer.log_val_generations`): the (input, output, score)
    triples sorted by input, shuffled by a numpy RandomState seeded 42, the first `n`. The same validation
    set therefore shows the same prompts at every validation, so their answers can be compared over steps."""
    import numpy as np

    if n <= 0:
        return []
    if not len(inputs) == len(outputs) == len(scores):
        raise ValueError(f"inputs, outputs and scores differ in length: {len(inputs)}, {len(outputs)}, {len(scores)}")
    samples = sorted(zip(inputs, outputs, scores), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:n]


def _active_tracking() -> Tracking | None:
    for ref in reversed(_LIVE):
        t = ref()
        if t is not None and not t._finished:
            return t
    return None


class ValidationGenerationsLogger:
    """Upstream's name: `ValidationGenerationsLogger(project_name, experiment_name).log(loggers, samples, step)`
    records validation samples, each (input, output, score), with the backends named in `loggers`
    (`trainer.logger`), as `Tracking.log_generations` does.

    The samples go to the newest `Tracking` not finished yet (the one a trainer's `fit` made), so they
    land in the same runs as the metrics. Without one, they go where upstream sends them: the current
    `wandb.run`, swanlab run and MLflow active run (a backend without a running run is skipped with a
    warning), and tensorboard to `$TENSORBOARD_DIR`, else `tensorboard_log/<project>/<experiment>`.
    """

    def __init__(self, project_name: str | None = None, experiment_name: str | None = None):
        self.project_name = project_name
        self.experiment_name = experiment_name
        self._fallback: dict[str, Any] = {}

    def log(self, loggers, samples, step: int) -> None:
        if not samples:
            return
        names = [loggers] if isinstance(loggers, str) else list(loggers)
        tracking = _active_tracking()
        if tracking is not None:
            tracking.log_generations(samples, step, backend=names)
            return
        for name in names:
            logger = self._fallback_logger(name)
            if logger is not None:
                logger.log_generations(samples, step)

    def _fallback_logger(self, name: str):
        if name in self._fallback:
            return self._fallback[name]
        import logging

        logger = None
        if name == "tensorboard":
            if self.project_name and self.experiment_name:
                default = Path("tensorboard_log") / self.project_name / self.experiment_name
            else:
                default = Path("tensorboard_log")
            logger = TensorboardLogger(default, log_dir=os.environ.get("TENSORBOARD_DIR") or default)
        elif name == "wandb" and importlib.util.find_spec("wandb") is not None:
            import wandb

            logger = WandbLogger.attach(wandb.run) if wandb.run is not None else None
        elif name == "swanlab" and importlib.util.find_spec("swanlab") is not None:
            import swanlab

            run = swanlab.get_run()
            logger = SwanlabLogger.attach(run) if run is not None else None
        elif name == "mlflow" and importlib.util.find_spec("mlflow") is not None:
            import mlflow

            run = mlflow.active_run()
            logger = MlflowLogger.attach(run.info.run_id) if run is not None else None
        if logger is None and name != "console":
            logging.getLogger(__name__).warning(
                "validation generations are not logged to %r: no verl Tracking is running and no %s run was "
                "started; create a verl.utils.tracking.Tracking first (a trainer's fit() does)",
                name,
                name,
            )
        self._fallback[name] = logger
        return logger
