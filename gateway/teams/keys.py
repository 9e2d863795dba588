"""API keys: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) against
keys known by their SHA-256.

The gateway never holds a key, only the digests of the config's `keys` and of
`keys_file` (a file mounted from a Kubernetes Secret, read again when it
changes, so keys rotate without a restart). A key in both with two teams is an
error: at start the config is refused; on a reload the new file is refused (an
error logged) and the keys known stay. A file that can no longer be read
(deleted, no permission) fails closed: its keys are dropped, an error logged. A
presented key is hashed as sent, never lower-cased or trimmed inside, and its
digest compared with every known digest by `hmac.compare_digest`, without
stopping at a match, so the time taken says nothing about which digests are
near. A missing, malformed or unknown key all read the same: None.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable, Mapping

from gateway.config import (
    Config,
    ConfigError,
    KeyConfig,
    KeysFileUnreadable,
    load_keys_file,
    merge_keys,
)
from gateway.teams.team import Team

log = logging.getLogger("furnace.keys")

_BEARER = b"bearer"


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of `Authorization: Bearer <token>` (the scheme in any case), else the
    value of `x-api-key` (where Anthropic's clients send theirs), or None."""
    api_key = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            token = token.strip(b" \t")
            if scheme.lower() == _BEARER and token:
                return token
            return None
        if name == b"x-api-key" and api_key is None:
            api_key = value.strip(b" \t") or None
    return api_key


def file_stamp(path: str) -> tuple[int, int, int] | None:
    """What says a file changed: its inode, mtime and size (None: it cannot be read)."""
    try:
        stat = os.stat(path)  # follows a Secret's or ConfigMap's volume symlinks
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


class KeyRing:
    """Digests of the known keys, each with its team."""

    def __init__(self, config: Config, teams: Mapping[str, Team]) -> None:
        self._teams = teams
        self._inline = config.keys
        self._file = config.keys_file
        self._file_stamp: tuple[int, int, int] | None = None
        self._entries: tuple[tuple[bytes, Team], ...] = ()
        self._load(self._read_file() if self._file else ())

    @property
    def count(self) -> int:
        """How many keys are known."""
        return len(self._entries)

    def _load(self, from_file: tuple[KeyConfig, ...]) -> None:
        teams = merge_keys(self._inline, from_file)
        self._entries = tuple((digest, self._teams[team]) for digest, team in teams.items())

    def _read_file(self) -> tuple[KeyConfig, ...]:
        assert self._file is not None
        self._file_stamp = file_stamp(self._file)
        return load_keys_file(self._file, set(self._teams))

    def reload_if_changed(self) -> None:
        """Reads `keys_file` again if it changed; a bad file keeps the keys known,
        a file gone (or unreadable) drops its keys."""
        if self._file is None or file_stamp(self._file) == self._file_stamp:
            return
        try:
            self._load(self._read_file())
        except KeysFileUnreadable as error:
            self._load(())
            log.error("keys file dropped, keeping the %d keys of `keys`: %s", self.count, error)
            return
        except ConfigError as error:
            log.error("keys file not reloaded, keeping %d keys: %s", self.count, error)
            return
        log.info("keys file reloaded: %d keys", self.count)

    def team_of(self, headers: Iterable[tuple[bytes, bytes]]) -> Team | None:
        """The team of the request's key, or None for no key or an unknown one."""
        token = bearer_token(headers)
        if token is None:
            return None
        digest = hashlib.sha256(token).digest()
        found = None
        for known, team in self._entries:
            if hmac.compare_digest(known, digest):
                found = team
        return found
