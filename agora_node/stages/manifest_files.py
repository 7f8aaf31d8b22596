"""Run manifests on disk: the builtin ones shipped in `stages/manifests/` and TOML files.

protocol/manifest.py parses and validates text and stays free of I/O; finding
and reading files (and checking that a manifest's data files exist) is here.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from agora_node.protocol.manifest import (
    BUILTIN_DATA_PREFIX,
    BUILTIN_MANIFESTS,
    Manifest,
    ManifestError,
    parse_manifest,
)


def builtin_manifest_text(name: str) -> str:
    """The TOML text of a builtin manifest (`tiny`, `demo`, `bench`, `gpu-1b`, `long`, `cells`)."""
    return resources.files("agora_node.stages").joinpath(f"manifests/{name}.toml").read_text()


def load_manifest(name_or_path: str) -> Manifest:
    """Load a builtin manifest by name (`tiny`, `demo`, `bench`, `gpu-1b`, `long`, `cells`) or a TOML file by path."""
    if name_or_path in BUILTIN_MANIFESTS:
        return parse_manifest(builtin_manifest_text(name_or_path), origin=name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise ManifestError(
            f"manifest {name_or_path!r} not found: give a path to a TOML file "
            f"or one of {', '.join(BUILTIN_MANIFESTS)}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = "it is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror
        raise ManifestError(f"manifest {name_or_path!r} cannot be read: {reason}") from None
    return parse_manifest(text, origin=str(path))


def check_data_available(manifest: Manifest) -> None:
    """Raise ManifestError if this node cannot read the data source (heads need it)."""
    data = manifest.data
    if not data.source.startswith(BUILTIN_DATA_PREFIX) and not Path(data.source).is_file():
        _missing("data.source", data.source)
    if data.tokenizer.endswith(".json") and not Path(data.tokenizer).is_file():
        _missing("data.tokenizer", data.tokenizer)


def _missing(name: str, value: str) -> None:
    raise ManifestError(f"manifest field {name} = {value!r} is invalid: file not found")
