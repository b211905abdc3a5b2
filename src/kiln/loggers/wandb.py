"""WandBLogger: metrics and config to a Weights & Biases run (offline when not logged in)."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kiln.loggers import flushing
from kiln.loggers.destination import LoggerDestination

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["WandBLogger"]


class WandBLogger(LoggerDestination):
    """Logs metrics with ``run.log``, images as ``wandb.Image`` lists and hyperparameters into
    ``run.config`` of a W&B run.

    The run starts on the first write (so only writing ranks create one). Without credentials
    (no ``WANDB_API_KEY``, no ``WANDB_IDENTITY_TOKEN_FILE``, no ``wandb login`` entry in
    ``~/.netrc``) and without ``mode`` or ``WANDB_MODE``, the run is offline: files are written
    under ``dir`` (or ``WANDB_DIR``) and can be uploaded later with ``wandb sync``, instead of
    the run stopping at a login prompt. The run id is kept in ``state_dict``, so a run resumed
    from a checkpoint continues the same W&B run.

    W&B holds the newest step's row until a later step or the run's end: a process that ends by
    SIGTERM finishes its run first (so that row is kept; see :mod:`kiln.loggers.flushing`), and
    one that ends by an exception finishes it through W&B's own exit handler.

    Args:
        project: W&B project name.
        entity: W&B user or team.
        name: Display name of the run.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; ``None`` chooses as described above.
        rank_zero_only: Log on rank 0 only (the default).
        **init_kwargs: Passed on to ``wandb.init`` (``dir``, ``tags``, ``group``, ...).

    Raises:
        ImportError: When the ``wandb`` package is not installed.

    Example::

        wandb_logger = WandBLogger(project="cifar", name="resnet-bs128", tags=["baseline"])
        trainer = kiln.Trainer(model, loggers=[wandb_logger], ...)
    """

    def __init__(
        self,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        mode: str | None = None,
        *,
        rank_zero_only: bool = True,
        **init_kwargs: Any,
    ) -> None:
        super().__init__(rank_zero_only=rank_zero_only)
        try:
            # Imported here: wandb takes about a second to import and is optional.
            import wandb
        except ImportError as error:
            raise ImportError("WandBLogger needs the wandb package: pip install wandb") from error
        self._wandb = wandb
        if mode is None and not os.environ.get("WANDB_MODE") and not _has_wandb_credentials():
            mode = "offline"
        self.init_kwargs: dict[str, Any] = {
            "project": project,
            "entity": entity,
            "name": name,
            "mode": mode,
            **init_kwargs,
        }
        self._run: Any = None

    @property
    def run(self) -> Any:
        """The ``wandb`` run, started on first use."""
        if self._run is None:
            self._run = self._wandb.init(**self.init_kwargs)
            flushing.watch(self)  # a SIGTERM finishes the run (its last row) before the process ends
        return self._run

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        # Logged through the run object, not wandb.log, so two loggers never share a global run.
        self.run.log(metrics, step=step)

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_images(self, images: Any, name: str, step: int | None = None) -> None:
        # One list under one key: W&B shows them as a gallery for the step. Grey images lose their channel axis.
        pictures = [self._wandb.Image(image[..., 0] if image.shape[-1] == 1 else image) for image in images]
        self.run.log({name: pictures}, step=step)

    def state_dict(self) -> dict[str, Any]:
        return {} if self._run is None else {"run_id": self._run.id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("run_id") and self._run is None:
            self.init_kwargs.update(id=state["run_id"], resume="allow")

    def close(self, state: State | None = None, logger: Any = None) -> None:
        flushing.unwatch(self)
        if self._run is not None:
            self._run.finish()
            self._run = None


def _has_wandb_credentials() -> bool:
    """Whether wandb would find credentials: its environment variables or a ``.netrc`` entry."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    # The same files wandb reads, in its order: $NETRC, ~/.netrc, ~/_netrc.
    candidates = [os.environ.get("NETRC"), "~/.netrc", "~/_netrc"]
    for candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        if not path.is_file():
            continue
        try:
            return bool(host) and netrc.netrc(path).authenticators(host) is not None
        except (netrc.NetrcParseError, OSError):
            return False
    return False
