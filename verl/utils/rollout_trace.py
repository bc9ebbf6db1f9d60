"""Tracing of agent-loop rollouts to Weave or MLflow (upstream's `verl.utils.rollout_trace`).

`RolloutTraceConfig.init(project_name, experiment_name, backend, token2text=False, ...)` chooses a
backend once per process: "weave", "mlflow", or None / "dummy" (tracing off). Then

- `rollout_trace_op` decorates a method (sync or async) of a rollout component; each call becomes
  a span with the call's arguments as inputs and its return value as output. With `token2text`,
  an output's `prompt_ids` / `response_ids` / `token_ids` are also decoded with the instance's
  `tokenizer` (as `prompt_text` / `response_text` / `text`).
- `with rollout_trace_attr(sample_index=..., step=..., rollout_n=..., validate=...)` tags the spans
  opened inside it (Weave attributes, or an MLflow parent span with those trace tags);
  `trace=False` turns tracing off inside the block (a context variable, so concurrent coroutines
  are unaffected).

Without a backend both are pass-throughs that cost one context-variable read, so they can stay on
hot paths. The backends are imported only when chosen (weave and mlflow are optional). Another
backend name is accepted as upstream accepts it and records nothing, with a warning naming the
recording backends, since a misspelt name would otherwise go unnoticed. `max_samples_per_step_per_worker`
is recorded for callers that sample which rollouts to trace (upstream's agent loop reads it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import tempfile
from contextvars import ContextVar

__all__ = ["RolloutTraceConfig", "rollout_trace_attr", "rollout_trace_op"]

BACKENDS = ("weave", "mlflow")  # the backends that record spans
NO_OP_BACKEND = "dummy"  # upstream's name for a configured backend that records nothing
logger = logging.getLogger(__name__)
_trace_enabled: ContextVar[bool] = ContextVar("_trace_enabled", default=True)


class RolloutTraceConfig:
    """The process-wide tracing settings (a singleton; `reset()` forgets them)."""

    _instance: RolloutTraceConfig | None = None

    def __init__(self):
        self.backend: str | None = None
        self.client = None
        self.token2text = False
        self.project_name: str | None = None
        self.experiment_name: str | None = None
        self.max_samples_per_step_per_worker: int | None = None
        self._initialized = False

    @classmethod
    def get_instance(cls) -> RolloutTraceConfig:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @classmethod
    def init(
        cls,
        project_name: str,
        experiment_name: str,
        backend: str | None,
        token2text: bool = False,
        max_samples_per_step_per_worker: int | None = None,
    ) -> None:
        """Choose the backend (once: later calls keep the first choice, as every component of a worker
        calls this with the same trainer config)."""
        config = cls.get_instance()
        if config._initialized:
            return
        if backend is not None and backend not in BACKENDS and backend != NO_OP_BACKEND:
            logger.warning(
                "rollout trace backend %r records nothing: the recording backends are %s (None or %r turns "
                "tracing off)",
                backend,
                list(BACKENDS),
                NO_OP_BACKEND,
            )
        if backend == "weave":
            import weave

            config.client = weave.init(project_name)
        elif backend == "mlflow":
            import mlflow
            from filelock import FileLock

            mlflow.config.enable_async_logging()
            mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", "sqlite:////tmp/mlruns.db"))
            # Every rollout worker of a node opens the same store at start-up: two processes creating a
            # fresh sqlite store (its schema migrations) or the same experiment at once make one fail,
            # so they take turns.
            with FileLock(os.path.join(tempfile.gettempdir(), "verl_rollout_trace_mlflow.lock")):
                mlflow.set_experiment(project_name)
            config.client = mlflow
        config.backend = backend
        config.token2text = bool(token2text)
        config.project_name = project_name
        config.experiment_name = experiment_name
        config.max_samples_per_step_per_worker = max_samples_per_step_per_worker
        config._initialized = True

    @classmethod
    def get_backend(cls) -> str | None:
        return cls.get_instance().backend

    @classmethod
    def recording_backend(cls) -> str | None:
        """The backend spans go to: "weave", "mlflow", or None when tracing records nothing."""
        backend = cls.get_instance().backend
        return backend if backend in BACKENDS else None

    @classmethod
    def get_client(cls):
        return cls.get_instance().client

    @classmethod
    def enable_token2text(cls) -> bool:
        return cls.get_instance().token2text

    @classmethod
    def reset(cls) -> None:
        cls._instance = None


@contextlib.contextmanager
def rollout_trace_attr(sample_index=None, step=None, rollout_n=None, name="rollout_trace", validate=False, trace=True):
    """Tag the spans opened inside the block (see the module docstring)."""
    backend = RolloutTraceConfig.recording_backend()
    if backend is None:
        yield
        return
    if not trace:
        token = _trace_enabled.set(False)
        try:
            yield
        finally:
            _trace_enabled.reset(token)
        return
    attributes = {
        key: value
        for key, value in (("sample_index", sample_index), ("step", step), ("rollout_n", rollout_n))
        if value is not None
    }
    attributes["validate"] = validate
    attributes["experiment_name"] = RolloutTraceConfig.get_instance().experiment_name
    if backend == "weave":
        import weave

        with weave.attributes(attributes):
            yield
    else:
        import mlflow

        with mlflow.start_span(name=name) as span:
            for key, value in attributes.items():
                mlflow.set_trace_tag(span.trace_id, str(key), str(value))
            yield


def _call_inputs(func, self, args, kwargs) -> dict:
    bound = inspect.signature(func).bind(self, *args, **kwargs)
    bound.apply_defaults()
    inputs = dict(bound.arguments)
    inputs.pop(next(iter(inputs)))  # self
    return inputs


# token-id fields of a traced output and the key their decoded text is recorded under (token2text)
_TEXT_FIELDS = (("prompt_ids", "prompt_text"), ("response_ids", "response_text"), ("token_ids", "text"))


async def _with_text(owner, result):
    """The result as a dict plus its token-id fields decoded by `owner.tokenizer` (`_TEXT_FIELDS`)."""
    tokenizer = getattr(owner, "tokenizer", None)
    fields = [(ids, text) for ids, text in _TEXT_FIELDS if hasattr(result, ids)]
    if not fields or not hasattr(tokenizer, "decode"):
        return result
    from verl.utils.ray_utils import get_event_loop

    dump = getattr(result, "model_dump", None)
    output = dump() if callable(dump) else dict(vars(result))
    loop = get_event_loop()
    for ids, text in fields:
        output[text] = await loop.run_in_executor(None, tokenizer.decode, getattr(result, ids))
    return output


def rollout_trace_op(func):
    """Record each call of the decorated method as a span of the configured backend."""

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(self, *args, **kwargs):
            backend = RolloutTraceConfig.recording_backend()
            if backend is None or not _trace_enabled.get():
                return await func(self, *args, **kwargs)
            inputs = _call_inputs(func, self, args, kwargs)
            token2text = RolloutTraceConfig.enable_token2text()
            if backend == "weave":
                from weave.trace.context import call_context

                tracer = RolloutTraceConfig.get_client()
                call = tracer.create_call(
                    op=func.__qualname__, inputs=inputs, attributes={**call_context.call_attributes.get()}
                )
                try:
                    result = await func(self, *args, **kwargs)
                except Exception as e:
                    tracer.finish_call(call, exception=e)
                    raise
                tracer.finish_call(call, output=await _with_text(self, result) if token2text else result)
                return result
            import mlflow

            with mlflow.start_span(name=func.__qualname__) as span:
                span.set_inputs(inputs)
                result = await func(self, *args, **kwargs)
                span.set_outputs(await _with_text(self, result) if token2text else result)
            return result

        return async_wrapper

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        backend = RolloutTraceConfig.recording_backend()
        if backend is None or not _trace_enabled.get():
            return func(self, *args, **kwargs)
        inputs = _call_inputs(func, self, args, kwargs)
        if backend == "weave":
            from weave.trace.context import call_context

            tracer = RolloutTraceConfig.get_client()
            call = tracer.create_call(
                op=func.__qualname__, inputs=inputs, attributes={**call_context.call_attributes.get()}
            )
            try:
                result = func(self, *args, **kwargs)
            except Exception as e:
                tracer.finish_call(call, exception=e)
                raise
            tracer.finish_call(call, output=result)
            return result
        import mlflow

        with mlflow.start_span(name=func.__qualname__) as span:
            span.set_inputs(inputs)
            result = func(self, *args, **kwargs)
            span.set_outputs(result)
        return result

    return wrapper
