"""The loop: the Trainer, its evaluation, and the Colossal-AI / nnScaler hook adapters."""

from kiln.trainer.evaluator import Evaluator
from kiln.trainer.fault_tolerance import FaultTolerance
from kiln.trainer.trainer import Trainer

__all__ = ["Trainer", "Evaluator", "FaultTolerance"]
