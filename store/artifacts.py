"""Policy artifacts: the bytes a version is made of, their checksum, and where they are unpacked to run.

* A **rule** version (a ``CachePolicy``'s knobs) is its YAML policy file, ``cache_policy:`` with sorted keys: every
  field with a value, so the version means the same thing after confkv's defaults change; unset optional fields
  are left out, so a version stays readable by an older confkv as long as it does not use a newer field.
* A **learned** version is a gzip tar of the exported folder (``policy.yaml`` with ``learned_path: .``,
  ``policy.json``, ``policy.safetensors`` and anything else the folder held), built deterministically (sorted
  names, zero times and owners) so the same folder always has the same sha256.

The sha256 of those bytes is recorded at registration and checked every time they are read back, before anything
is parsed: a corrupted row, a truncated upload or a replaced file at the URI is refused, never served. Learned
artifacts unpack once per checksum under ``$CONFKV_CACHE/registry/<sha256>/`` (default ``~/.cache/confkv``), the
folder ``confkv.config.load_policy_file`` then reads.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from confkv.config import CachePolicy, load_policy_file, make_policy
from confkv.errors import ConfkvError
from store.errors import ArtifactError, ArtifactUnavailable, RegistryError
from store.models import KIND_LEARNED, KIND_RULE

_COMPLETE = ".confkv-complete"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cache_root() -> Path:
    """Where learned artifacts are unpacked: ``$CONFKV_CACHE/registry`` (default ``~/.cache/confkv/registry``)."""
    return Path(os.environ.get("CONFKV_CACHE") or Path.home() / ".cache" / "confkv") / "registry"


@dataclass(frozen=True)
class PackedPolicy:
    """A policy ready to be stored: its kind, its parameters (JSON), its artifact bytes and their checksum."""

    kind: str
    parameters: dict[str, Any]
    artifact: bytes
    sha256: str
    policy: CachePolicy


# ------------------------------------------------------------------------------------------------ packing
def policy_yaml(parameters: dict[str, Any]) -> bytes:
    return yaml.safe_dump({"cache_policy": parameters}, sort_keys=True).encode()


def tar_folder(folder: Path) -> bytes:
    """A gzip tar of ``folder``'s contents whose bytes depend only on the files' names and contents."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                continue
            info = tar.gettarinfo(str(path), arcname=path.relative_to(folder).as_posix())
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755 if path.is_dir() else 0o644
            if path.is_file():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


def untar(data: bytes, dest: Path) -> None:
    """Unpack an artifact tar; the ``data`` filter refuses absolute paths, ``..`` and links out of ``dest``."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise ArtifactError(f"artifact is not a readable policy archive: {err}") from None


def pack_policy(policy: CachePolicy) -> PackedPolicy:
    """Turn a loaded policy (a YAML file's, or an exported folder's) into the bytes the registry stores."""
    if policy.controller != "learned":
        params = policy.model_dump(mode="json", exclude={"learned_path"}, exclude_none=True)
        data = policy_yaml(params)
        return PackedPolicy(KIND_RULE, params, data, sha256_hex(data), policy)
    from confkv.controllers.learned import MLPPolicy

    src = Path(policy.learned_path or "")
    if not src.is_dir():
        raise RegistryError(f"learned policy folder not found: {src}")
    params = policy.model_dump(mode="json", exclude_none=True)
    params["learned_path"] = "."
    with tempfile.TemporaryDirectory(prefix="confkv-pack-") as tmp:
        folder = Path(tmp) / "policy"
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("policy.yaml", _COMPLETE, "__pycache__"))
        (folder / "policy.yaml").write_bytes(policy_yaml(params))
        MLPPolicy.load(folder)  # refuse to register what would not load
        data = tar_folder(folder)
    return PackedPolicy(KIND_LEARNED, params, data, sha256_hex(data), policy)


def pack_path(path: str | Path) -> PackedPolicy:
    """Pack a YAML policy file or an exported policy folder."""
    return pack_policy(load_policy_file(path))


# ------------------------------------------------------------------------------------------------ storage at a URI
def _local_path(uri: str) -> Path | None:
    if uri.startswith("file://"):  # what ``Path.as_uri`` wrote: percent-encoded (a space is %20)
        return Path(urllib.request.url2pathname(urllib.parse.urlparse(uri).path))
    if "://" not in uri:
        return Path(uri)
    return None


def store_at(location: str, sha256: str, kind: str, data: bytes) -> str:
    """Write an artifact under ``location`` (a folder path, ``file://`` or any fsspec URL); return its URI."""
    name = f"{sha256}.{'yaml' if kind == KIND_RULE else 'tar.gz'}"
    local = _local_path(location)
    try:
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
            target = local.resolve() / name
            target.write_bytes(data)
            return target.as_uri()
        import fsspec

        uri = location.rstrip("/") + "/" + name
        with fsspec.open(uri, "wb") as f:
            f.write(data)
        return uri
    except Exception as err:  # OSError, or the object store's own (botocore's errors are not OSErrors)
        raise RegistryError(f"cannot write the artifact to {location}: {err}") from None


def fetch_uri(uri: str) -> bytes:
    local = _local_path(uri)
    try:
        if local is not None:
            return local.read_bytes()
        import fsspec

        with fsspec.open(uri, "rb") as f:
            return f.read()
    except Exception as err:  # OSError, or the object store's own (botocore's errors are not OSErrors)
        raise ArtifactUnavailable(f"cannot read the artifact at {uri}: {err}") from None


# ------------------------------------------------------------------------------------------------ loading
def verify(data: bytes | None, sha256: str, what: str) -> bytes:
    if data is None:
        raise ArtifactError(f"{what} has no artifact")
    actual = sha256_hex(data)
    if actual != sha256:
        raise ArtifactError(f"{what}: artifact checksum mismatch (recorded sha256 {sha256[:12]}..., "
                            f"stored bytes hash to {actual[:12]}...): refusing to load it")  # fmt: skip
    return data


def materialise(kind: str, data: bytes, sha256: str, what: str) -> tuple[CachePolicy, Path | None]:
    """The policy an artifact holds (checked against ``sha256`` first); learned ones are unpacked to the cache.

    Raises ``ArtifactError`` when the checksum fails or the artifact does not load as a policy, so that callers
    (``resolve_ref``, the watcher) can refuse the version and keep what they run.
    """
    verify(data, sha256, what)
    try:
        if kind == KIND_RULE:
            doc = yaml.safe_load(data)
            if not isinstance(doc, dict) or not isinstance(doc.get("cache_policy"), dict):
                raise ArtifactError(f"{what}: artifact holds no cache_policy mapping")
            return make_policy(doc["cache_policy"]), None
        if kind != KIND_LEARNED:
            raise ArtifactError(f"{what}: unknown policy kind {kind!r}")
        folder = _unpack_cached(data, sha256)
        from confkv.controllers.learned import MLPPolicy

        policy = load_policy_file(folder)
        MLPPolicy.load(folder)
        return policy, folder
    except ArtifactError:
        raise
    except (ConfkvError, yaml.YAMLError, OSError) as err:
        raise ArtifactError(f"{what}: artifact does not load: {err}") from None


def _unpack_cached(data: bytes, sha256: str) -> Path:
    """Unpack once per checksum; a half-written folder (a crash, a concurrent unpack) is never used."""
    root = cache_root()
    folder = root / sha256
    if (folder / _COMPLETE).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha256[:12]}-", dir=root))
    try:
        untar(data, tmp)
        (tmp / _COMPLETE).write_text(sha256 + "\n")
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier attempt
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / _COMPLETE).is_file():  # not another process winning the same unpack
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
