"""Hot reload of what teams may spend and where their requests go: the teams'
budgets, the models' prices, the aliases (top level and the teams' own) and
the models' fallbacks, read again from the config file when it changes, on
the keys file's tick, so a budget or a split changes without a restart.

A changed file is checked whole, as at start (`load_config`: a bad field is
named), then against what runs: an alias's target or a fallback must be a
model this gateway serves, or an alias (models come and go with a restart). A
bad file is refused: an error naming the field is logged, and what was in
force stays. Any other field that changed is logged as waiting for the next
restart; the rest of the file applies. Usage already counted stays: a
budget's counter is named by its team, window and dates, never by its limit,
so a new limit applies to what the window already used (a new `start_hour`
or `start_day` is a new window). A reservation made before a reload settles at
the prices it was made at.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields, replace

from gateway.config import Config, ConfigError, load_config
from gateway.fleet.aliases import Aliases
from gateway.teams.budgets import Budgets
from gateway.teams.keys import file_stamp
from gateway.teams.team import Team

log = logging.getLogger("furnace.reload")


def _rest(config: Config) -> Config:
    """`config` without what a reload applies: what must equal for no restart."""
    return replace(
        config,
        aliases=(),
        models=tuple(replace(m, fallbacks=(), prices=None) for m in config.models),
        teams=tuple(replace(t, budgets=(), aliases=()) for t in config.teams),
    )


def check_served(config: Config, served: frozenset[str]) -> None:
    """Raises `ConfigError`, naming the field, where `config`'s aliases or fallbacks
    name a model this gateway does not serve (the file's models may differ from the
    running ones until a restart)."""
    top = {alias.name for alias in config.aliases}
    scopes = [("aliases", config.aliases, top)]
    scopes += [
        (f"teams.{t.name}.aliases", t.aliases, top | {a.name for a in t.aliases})
        for t in config.teams
    ]
    for where, aliases, known in scopes:
        for alias in aliases:
            if alias.name in served:
                raise ConfigError(f"{where}.{alias.name}: a served model has this name")
            for i, (target, _) in enumerate(alias.targets):
                if target not in served and target not in known:
                    raise ConfigError(
                        f"{where}.{alias.name}[{i}].model: {target!r} is not served by this "
                        "gateway (models change with a restart)"
                    )
    for i, model in enumerate(config.models):
        for j, target in enumerate(model.fallbacks if model.name in served else ()):
            if target not in served and target not in top:
                raise ConfigError(
                    f"models[{i}].fallbacks[{j}]: {target!r} is not served by this gateway "
                    "(models change with a restart)"
                )


class SettingsReload:
    """The config file, read again when it changes; what a reload may change, applied."""

    def __init__(
        self,
        path: str,
        served: Iterable[str],
        teams: Mapping[str, Team],
        budgets: Budgets,
        aliases: Aliases,
        share: Callable[[Config], Config] | None = None,
    ) -> None:
        self.path = path
        #: This process's share of what the file says (one of several processes).
        self.share = share or (lambda config: config)
        self.served = frozenset(served)
        self.teams = teams
        self.budgets = budgets
        self.aliases = aliases
        self._stamp = file_stamp(path)
        #: What the file said last (what runs, as far as a reload goes).
        self._last = self.share(load_config(path))
        #: Reloads applied, and refused (for tests and the log).
        self.applied = 0
        self.refused = 0

    def reload_if_changed(self) -> None:
        """Reads the file again if it changed, and applies it (or refuses it, logged)."""
        stamp = file_stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            config = self.share(load_config(self.path))
            check_served(config, self.served)
        except ConfigError as error:
            log.error("config file not reloaded, the settings in force stay: %s", error)
            self.refused += 1
            return
        self.apply(config)

    def apply(self, config: Config) -> None:
        """Puts `config`'s budgets, prices, aliases and fallbacks in force."""
        restart = [
            f.name
            for f in fields(Config)
            if getattr(_rest(config), f.name) != getattr(_rest(self._last), f.name)
        ]
        if restart:
            log.warning(
                "config file: %s changed; that takes effect at the next restart",
                ", ".join(restart),
            )
        self._last = config
        self.aliases.load(config)
        self.budgets.configure(config)
        for new in config.teams:
            team = self.teams.get(new.name)
            if team is None:
                continue  # a new team comes with a restart (logged above)
            if team.config.budgets != new.budgets:
                team.budget = {}  # its levels, as headers and metrics show them, anew
            team.config = replace(team.config, budgets=new.budgets, aliases=new.aliases)
        log.info("config file reloaded: budgets, prices, aliases and fallbacks in force")
        self.applied += 1
