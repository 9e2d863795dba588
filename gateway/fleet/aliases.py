"""Model aliases, traffic splits and fallbacks: which model serves a request
that names an alias, and which models serve it when that one cannot.

An alias (`aliases: {chat: [{model: llama-70b-v2, weight: 90}, {model:
llama-70b-v3, weight: 10}]}`, at the top level or a team's own) stands for its
targets, one drawn per request by weight. A request with a session key (the
`x-session-id` header, else the body's `user`: the key session affinity uses)
is drawn from a hash of the alias and that key instead of at random, so one
session stays on one target while the weights stay put, and the split of many
sessions follows the weights. A target may be an alias itself (the config
refuses cycles).

A model's `fallbacks` serve its requests, in order, when it cannot start one:
no healthy worker, every worker full or its queue refusing (at admission), or
every worker it tried failing before the first event (the fleet's retries
spent). Never after the first event: by then the answer has begun. A fallback
that is an alias is drawn as any alias is.

The draw costs a SHA-256 of the session key (~1 µs) or one `random()`; a
request naming a model pays one dict look-up.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence

from gateway.config import AliasConfig, Config


def draw(targets: Sequence[tuple[str, float]], session: str | None, salt: str = "") -> str:
    """One target by weight: from `session`'s hash (with `salt`, the alias's name) when
    there is one, so the same session draws the same target; else at random."""
    total = sum(weight for _, weight in targets)
    if session:
        digest = hashlib.sha256(f"{salt}\x00{session}".encode()).digest()
        point = int.from_bytes(digest[:8], "big") / 2**64 * total
    else:
        point = random.random() * total
    for model, weight in targets:
        if point < weight:
            return model
        point -= weight
    return next(model for model, weight in reversed(targets) if weight > 0)


class Aliases:
    """The config's aliases and fallbacks, and the draw."""

    def __init__(self, config: Config) -> None:
        self.load(config)

    def load(self, config: Config) -> None:
        """Takes `config`'s aliases and fallbacks (at start, and on a reload)."""
        self.top = {alias.name: alias for alias in config.aliases}
        self.fallbacks = {m.name: m.fallbacks for m in config.models}
        #: Every alias name, the teams' own included: what a request's model is looked up in.
        self.every = frozenset(self.top).union(a.name for t in config.teams for a in t.aliases)
        #: The models that have fallbacks.
        self.falls_back = frozenset(m.name for m in config.models if m.fallbacks)

    def named(self, name: str) -> bool:
        """Whether `name` is an alias (of the top level or of some team)."""
        return name in self.every

    def scope(self, own: Sequence[AliasConfig] = ()) -> Mapping[str, AliasConfig]:
        """The aliases a caller sees: the top-level ones, and `own` (a team's) over them."""
        if not own:
            return self.top
        return {**self.top, **{alias.name: alias for alias in own}}

    def names(self, own: Sequence[AliasConfig] = ()) -> list[str]:
        """The alias names a caller may send, in config order."""
        return list(self.scope(own))

    def resolve(
        self,
        name: str,
        session: str | None,
        own: Sequence[AliasConfig] = (),
        usable: Callable[[str], bool] | None = None,
    ) -> str:
        """The model `name` stands for: itself when it is no alias, else a target drawn
        (and drawn again while the target is an alias). With `usable` (a team's: may it
        use this model?), only targets that lead to a model it may use are drawn, by
        their weights: a team that may use some of an alias's targets is always served
        by one of those, not refused at random (when it may use none, `name` is drawn
        as it is, and its caller refuses it)."""
        aliases = self.scope(own) if own else self.top
        alias = aliases.get(name)
        while alias is not None:
            targets: Sequence[tuple[str, float]] = alias.targets
            if usable is not None:
                kept = [
                    (target, weight)
                    for target, weight in targets
                    if weight > 0 and any(usable(m) for m in self.targets(target, own))
                ]
                targets = kept or targets
            name = draw(targets, session, alias.name)
            alias = aliases.get(name)
        return name

    def chain(
        self,
        model: str,
        session: str | None,
        own: Sequence[AliasConfig] = (),
        usable: Callable[[str], bool] | None = None,
    ) -> Iterator[str]:
        """`model`'s fallbacks, each resolved (`resolve`), in order, without repeats or
        `model`."""
        seen = {model}
        for fallback in self.fallbacks.get(model, ()):
            name = self.resolve(fallback, session, own, usable)
            if name not in seen:
                seen.add(name)
                yield name

    def targets(self, name: str, own: Sequence[AliasConfig] = ()) -> list[str]:
        """Every model an alias may land on (the alias's name when it is a model)."""
        aliases = self.scope(own)
        alias = aliases.get(name)
        if alias is None:
            return [name]
        found: list[str] = []
        for target, weight in alias.targets:
            if weight > 0:
                found += [t for t in self.targets(target, own) if t not in found]
        return found
