"""``registry://`` references: a registered policy named wherever a policy file is accepted.

    registry://NAME@production     the version an alias points at now
    registry://NAME@3              a fixed version
    registry://NAME                the same as registry://NAME@production

``confkv.config.load_policy_file`` hands such a reference here, so ``confkv generate --policy-file
registry://NAME@production``, ``LLM(policy_file=...)`` and the server accept one. The registry is the one at
``registry_url``, else ``$CONFKV_REGISTRY_URL``, else the user's SQLite file (``store.db``).

Resolving checks the artifact's sha256 and loads the policy fully (a learned network included, and the engine's
controller for it is built once) before returning, so a caller either gets a policy it can swap in or a
``ConfkvError`` saying why not; it never gets half of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from confkv.config import CachePolicy
from confkv.errors import ConfkvError
from store.errors import ArtifactError, RegistryError

SCHEME = "registry://"


@dataclass(frozen=True)
class ResolvedPolicy:
    """A registered version, loaded: the policy plus which version it is (for logs, stats and the watcher)."""

    policy: CachePolicy
    name: str
    version: int
    alias: str | None  # the alias it was reached through; None when the reference named a version
    sha256: str
    path: Path | None  # the unpacked folder of a learned policy; None for rule policies

    @property
    def ref(self) -> str:
        return f"{SCHEME}{self.name}@{self.alias if self.alias is not None else self.version}"

    @property
    def label(self) -> str:
        """``NAME@3`` (or ``NAME@3 (production)``): how logs and the engine's policy info name it."""
        return f"{self.name}@{self.version}" + (f" ({self.alias})" if self.alias else "")


def is_registry_ref(s: object) -> bool:
    """True for a string of the form ``registry://...`` (a ``Path`` never is one)."""
    return isinstance(s, str) and s.startswith(SCHEME)


def parse_ref(ref: str) -> tuple[str, int | str]:
    """``registry://NAME@X`` -> (NAME, version number or alias name); the alias defaults to ``production``."""
    from store.names import DEFAULT_ALIAS, check_alias, split_ref

    if not is_registry_ref(ref):
        raise RegistryError(f"{ref!r} is not a registry reference (registry://NAME@ALIAS or registry://NAME@VERSION)")
    body = ref[len(SCHEME) :]
    try:
        name, target = split_ref(body)
    except RegistryError as err:
        raise RegistryError(f"invalid registry reference {ref!r}: {err}") from None
    if target is None:
        target = DEFAULT_ALIAS
    if isinstance(target, str) and target != "latest":
        check_alias(target)
    return name, target


def resolve_ref(ref: str, registry_url: str | None = None) -> ResolvedPolicy:
    """Load the version a reference names now; ``ConfkvError`` when it cannot be found, checked or loaded."""
    from store.registry import Registry

    name, target = parse_ref(ref)
    info, policy, path = Registry(registry_url).load(name, target)
    validate_policy(policy, f"{info.policy}@{info.version}")
    alias = target if isinstance(target, str) and target != "latest" else None
    return ResolvedPolicy(policy, info.policy, info.version, alias, info.sha256, path)


def validate_policy(policy: CachePolicy, what: str) -> None:
    """Build the engine's controller for ``policy`` once, so a policy that cannot run is refused here."""
    from confkv.controllers import make_controller

    try:
        make_controller(policy)
    except ConfkvError as err:
        raise ArtifactError(f"{what}: policy does not load: {err}") from None
    except Exception as err:  # a broken learned network can fail in torch or safetensors
        raise ArtifactError(f"{what}: policy does not load: {type(err).__name__}: {err}") from None
