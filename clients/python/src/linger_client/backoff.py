"""Reconnect delays: exponential backoff with jitter."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backoff:
    """Delay before reconnect attempt `n` (0-based): the exponential step
    `initial * factor**n`, capped at `maximum`, then a random point in its
    upper half, so that many clients cut off together do not come back in
    one wave (the same rule as the web page)."""

    initial: float = 0.5
    maximum: float = 15.0
    factor: float = 2.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def delay(self, attempt: int) -> float:
        step = min(self.maximum, self.initial * self.factor ** min(attempt, 30))
        return step / 2 + self.rng.random() * (step / 2)
