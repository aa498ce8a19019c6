"""A built-in synthetic task with a verifiable reward: close the digit pattern.

A prompt is an arithmetic progression of digits modulo 10 followed by "?", e.g. "2468?" or
"975?"; the answer is the next term ("0", "3"). The reward of a completion is 1.0 when its
text (up to the end-of-sequence token) is exactly the answer, 0.5 when it begins with the
answer digit but goes on, and 0.0 otherwise, so it lies in [0, 1] and is checked from the prompt
alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class PatternTask:
    """Progressions of `min_terms`..`max_terms` digits with a step drawn from `steps`."""

    min_terms: int = 3
    max_terms: int = 4
    steps: tuple[int, ...] = (1, 9)

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(
                f"min_terms: expected 2 <= min_terms <= max_terms; got {self.min_terms}, "
                f"{self.max_terms}"
            )
        if not self.steps or any(not 0 <= s <= 9 for s in self.steps):
            raise ValueError(f"steps: expected a non-empty tuple of digits; got {self.steps!r}")

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        """n random prompts such as "2468?"."""
        out = []
        for _ in range(n):
            start, step = rng.randrange(10), rng.choice(self.steps)
            terms = rng.randint(self.min_terms, self.max_terms)
            out.append("".join(str((start + k * step) % 10) for k in range(terms)) + "?")
        return out

    @staticmethod
    def answer(prompt: str) -> str:
        """The digit that closes the pattern (the last term plus the step, modulo 10)."""
        digits = [int(c) for c in prompt if c.isdigit()]
        return str((2 * digits[-1] - digits[-2]) % 10)

    def reward(self, prompts: list[str], completions: list[str]) -> list[float]:
        """1.0 exact answer, 0.5 answer digit followed by more text, 0.0 otherwise."""
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            text, want = completion.strip(), self.answer(prompt)
            out.append(1.0 if text == want else 0.5 if text[:1] == want else 0.0)
        return out

    def preference_pairs(self, n: int, rng: random.Random) -> list[dict[str, str]]:
        """n preference pairs {"prompt", "chosen", "rejected"}: the answer vs a wrong digit."""
        pairs = []
        for prompt in self.prompts(n, rng):
            want = self.answer(prompt)
            wrong = rng.choice([d for d in "0123456789" if d != want])
            pairs.append({"prompt": prompt, "chosen": want, "rejected": wrong})
        return pairs
