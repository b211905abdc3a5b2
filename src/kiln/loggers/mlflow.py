"""MLflowLogger: metrics and parameters to an MLflow run (a local file store by default)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kiln.loggers.destination import LoggerDestination, _flatten_params

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["MLflowLogger"]


class MLflowLogger(LoggerDestination):
    """Logs metrics, hyperparameters and images (``log_image``, by key and step) to an MLflow run
    through ``MlflowClient``.

    The tracking URI is ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else the file store
    ``./mlruns`` (made absolute when the logger is built, so a later ``chdir`` does not move it).
    MLflow 3 refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE`` is true; kiln sets it (only if
    unset) when the URI is a file store, because the database stores need SQLAlchemy, which the
    light ``mlflow-skinny`` package lacks.

    The client API is used instead of ``mlflow.log_metric`` so that kiln neither starts nor ends
    the user's active fluent run. The run starts on the first write (so only writing ranks create
    one); its id is kept in ``state_dict`` so a resumed run logs into the same MLflow run.
    Nested hyperparameters become dotted parameter names; MLflow parameters cannot change once
    logged. A call without a step uses the number of earlier ``log_metrics`` calls.

    Args:
        experiment_name: Experiment to log under (created if missing); ``None`` is ``"Default"``.
        run_name: Display name of the run.
        tracking_uri: Where runs are stored (``file:...``, ``http://...``, ``databricks``, ...).
        rank_zero_only: Log on rank 0 only (the default).

    Raises:
        ImportError: When the ``mlflow`` (or ``mlflow-skinny``) package is not installed.

    Example::

        trainer = kiln.Trainer(model, loggers=[MLflowLogger(experiment_name="cifar")], ...)
        # then: mlflow ui --backend-store-uri ./mlruns
    """

    def __init__(
        self,
        experiment_name: str | None = None,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        *,
        rank_zero_only: bool = True,
    ) -> None:
        super().__init__(rank_zero_only=rank_zero_only)
        try:
            # Imported here: mlflow is optional and slow to import.
            import mlflow.tracking
        except ImportError as error:
            raise ImportError("MLflowLogger needs the mlflow package: pip install mlflow-skinny (or mlflow)") from error
        self._mlflow = mlflow
        if tracking_uri is None:
            default = Path("mlruns").resolve().as_uri()
            tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or default
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name or "Default"
        self.run_name = run_name
        self.run_id: str | None = None
        self._client: Any = None
        self._num_calls = 0

    @property
    def client(self) -> Any:
        """The ``MlflowClient``, with the experiment and run created on first use."""
        if self._client is None:
            if urlsplit(self.tracking_uri).scheme in ("", "file"):
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            client = self._mlflow.tracking.MlflowClient(tracking_uri=self.tracking_uri)
            if self.run_id is None:
                experiment = client.get_experiment_by_name(self.experiment_name)
                experiment_id = (
                    experiment.experiment_id
                    if experiment is not None
                    else client.create_experiment(self.experiment_name)
                )
                self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
            else:
                client.update_run(self.run_id, status="RUNNING")  # resumed from a checkpoint
            self._client = client
        return self._client

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        client = self.client
        timestamp_ms = int(time.time() * 1000)
        step = self._num_calls if step is None else step
        batch = [Metric(key, float(value), timestamp_ms, step) for key, value in metrics.items()]
        client.log_batch(self.run_id, metrics=batch)
        self._num_calls += 1

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        client = self.client
        batch = [Param(key, str(value)) for key, value in _flatten_params(params).items()]
        client.log_batch(self.run_id, params=batch)

    def log_images(self, images: Any, name: str, step: int | None = None) -> None:
        # MLflow's image keys (shown per step in its UI): one per image when there are several.
        client = self.client
        step = self._num_calls if step is None else step
        for index, image in enumerate(images):
            key = name if len(images) == 1 else f"{name}/{index}"
            client.log_image(self.run_id, image[..., 0] if image.shape[-1] == 1 else image, key=key, step=step)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.run_id is None else {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("run_id") and self._client is None:
            self.run_id = state["run_id"]

    def close(self, state: State | None = None, logger: Any = None) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id)
            self._client = None
