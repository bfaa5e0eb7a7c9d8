"""Which faults fire for one backend call: the rules in force, their fire counts and the seeded draws."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from .rules import DATA_OPS, FaultRule

__all__ = ["CallFaults", "RuleBook"]


@dataclass(slots=True)
class CallFaults:
    """What one call suffers: a delay, hangs (event, longest wait), an exception, codes per key index."""

    delay_s: float = 0.0
    hangs: list[tuple[threading.Event, float]] = field(default_factory=list)
    exception: BaseException | None = None
    codes: dict[int, int] = field(default_factory=dict)  # key index -> injected code


class RuleBook:
    """The rules of one wrapper, in order, with how often each fired; draws from ``random.Random(seed)``.

    Thread-safe: every method takes the book's own lock, so that draws are atomic across threads.
    """

    def __init__(self, seed: int | None) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rules: list[FaultRule] = []
        self._fired: dict[int, int] = {}

    def add(self, rule: FaultRule) -> FaultRule:
        if not isinstance(rule, FaultRule):
            raise TypeError(f"rules must be FaultRule objects, got {type(rule).__name__}")
        with self._lock:
            self._rules.append(rule)
            self._fired.setdefault(id(rule), 0)
        return rule

    def remove(self, rule: FaultRule) -> None:
        with self._lock:
            self._rules = [r for r in self._rules if r is not rule]

    def clear(self) -> None:
        with self._lock:
            self._rules = []

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        with self._lock:
            return tuple(self._rules)

    def fired(self, rule: FaultRule) -> int:
        with self._lock:
            return self._fired.get(id(rule), 0)

    def draw(self, op: str, keys: list[str] | None) -> CallFaults:
        """Decide, under the lock, which rules fire for this call and on which keys."""
        plan = CallFaults()
        with self._lock:
            for rule in self._rules:
                if not rule.applies_to(op):
                    continue
                budget = self._budget(rule)
                if budget == 0:
                    continue
                if keys is None:
                    targeted: list[int] = []
                elif rule.keys is None:
                    targeted = list(range(len(keys)))
                else:
                    targeted = [i for i, key in enumerate(keys) if rule.targets(key)]
                if keys is not None and not targeted:
                    continue
                if rule.per_key and keys is not None:
                    fired = []
                    for i in targeted:
                        if budget == 0:
                            break
                        if self._chance(rule):
                            fired.append(i)
                            budget -= 1
                    self._fired[id(rule)] += len(fired)
                    if not fired:
                        continue
                else:
                    if not self._chance(rule):
                        continue
                    self._fired[id(rule)] += 1
                    fired = targeted
                plan.delay_s += rule.delay_s
                if rule.hang is not None:
                    plan.hangs.append((rule.hang, rule.max_hang_s))
                if rule.exception is not None and plan.exception is None:
                    plan.exception = rule.make_exception(f"batch_{op}" if op in DATA_OPS else op)
                if rule.code is not None:
                    for i in fired:
                        plan.codes.setdefault(i, rule.code)
        return plan

    def _budget(self, rule: FaultRule) -> int:
        if rule.times is None:
            return -1  # unlimited: never reaches 0 by decrementing
        return max(0, rule.times - self._fired[id(rule)])

    def _chance(self, rule: FaultRule) -> bool:
        return rule.probability >= 1.0 or self._rng.random() < rule.probability
