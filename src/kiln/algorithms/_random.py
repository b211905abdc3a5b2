"""Seeded randomness for algorithms: one ``torch.Generator`` each, saved in its ``state_dict``.

An algorithm that draws from the global RNG would make a resumed run differ from an uninterrupted
one unless every draw elsewhere were replayed too. Each random algorithm therefore owns a CPU
generator whose state travels in checkpoints, so a resume continues the same stream bit for bit.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch

from kiln.core.callback import Algorithm

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["SeededAlgorithm", "sample_beta"]


class SeededAlgorithm(Algorithm):
    """An algorithm with its own generator.

    Args:
        seed: seeds the generator; ``None`` derives one from ``state.seed`` (or torch's initial
            seed) and the class name, so two algorithms in one run draw different streams while a
            run with the same seed draws the same ones. The seed does not depend on the rank, so
            with a run seed (``Trainer(seed=...)``) or this one, decisions that must agree across
            ranks (StochasticDepth skipping a block) do.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._generator: torch.Generator | None = None

    def generator(self, state: State | None = None) -> torch.Generator:
        """The generator, created and seeded on first use."""
        if self._generator is None:
            base = self.seed
            if base is None:
                run_seed = getattr(state, "seed", None)
                run_seed = run_seed if run_seed is not None else torch.initial_seed()
                base = run_seed + zlib.crc32(type(self).__name__.encode())
            self._generator = torch.Generator().manual_seed(base % (2**63))
        return self._generator

    def state_dict(self) -> dict[str, Any]:
        return {} if self._generator is None else {"rng": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "rng" in state:
            # Set the state on the existing object: modules StochasticDepth patched hold a reference to it.
            if self._generator is None:
                self._generator = torch.Generator()
            self._generator.set_state(state["rng"])


def sample_beta(alpha: float, generator: torch.Generator) -> float:
    """One draw from Beta(alpha, alpha) taken from ``generator``, leaving the global RNG untouched.

    torch's gamma sampler (under ``torch.distributions.Beta``) accepts no generator, so the draw is
    made from the global CPU RNG with the generator's state swapped in, and the advanced state is
    copied back to the generator.
    """
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(generator.get_state())
        concentration = torch.tensor(alpha, dtype=torch.float64)
        value = float(torch.distributions.Beta(concentration, concentration).sample())
        generator.set_state(torch.get_rng_state())
    return value
