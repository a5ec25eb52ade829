"""Ways a checkpoint step directory gets damaged on disk, for the tests of this folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# Orbax's metadata files of an item: everything else under ``state/`` holds array data.
_METADATA_NAMES = {"_METADATA", "_sharding", "manifest.ocdbt", "_CHECKPOINT_METADATA"}


def array_files(step_dir: Path) -> list[Path]:
    """The files that hold the state's array bytes. The damages below hit all of them:
    Orbax may spread the arrays over several data files, and a damage confined to the one
    holding the optimizer state leaves the parameters intact, so a params-only restore
    would rightly read them."""
    files = [
        p
        for p in (step_dir / "state").rglob("*")
        if p.is_file() and p.name not in _METADATA_NAMES and "array_metadatas" not in p.parts
    ]
    assert files, f"no array files under {step_dir / 'state'}"
    return files


def delete_array_file(step_dir: Path) -> None:
    for path in array_files(step_dir):
        path.unlink()


def _rewrite_array_files(step_dir: Path, change: Callable[[bytes], bytes]) -> None:
    for path in array_files(step_dir):
        path.write_bytes(change(path.read_bytes()))


def truncate_array_file(step_dir: Path) -> None:
    _rewrite_array_files(step_dir, lambda data: data[: len(data) // 2])


def _flip_middle(data: bytes) -> bytes:
    out = bytearray(data)
    mid = len(out) // 2
    for i in range(mid, min(mid + 8, len(out))):
        out[i] ^= 0xFF
    return bytes(out)


def flip_array_bytes(step_dir: Path) -> None:
    """XOR a few bytes in the middle of each array file: same size, other values."""
    _rewrite_array_files(step_dir, _flip_middle)


def delete_commit_record(step_dir: Path) -> None:
    (step_dir / "_CHECKPOINT_METADATA").unlink()


def damage_commit_record(step_dir: Path) -> None:
    path = step_dir / "_CHECKPOINT_METADATA"
    path.write_text(path.read_text()[:10])


def delete_array_metadata(step_dir: Path) -> None:
    (step_dir / "state" / "_METADATA").unlink()


def delete_meta(step_dir: Path) -> None:
    (step_dir / "meta" / "metadata").unlink()


def damage_manifest(step_dir: Path) -> None:
    """Garble the OCDBT manifest that maps array keys to the data files."""
    path = step_dir / "state" / "manifest.ocdbt"
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "delete-array-file": delete_array_file,
    "truncate-array-file": truncate_array_file,
    "flip-array-bytes": flip_array_bytes,
    "delete-commit-record": delete_commit_record,
    "damage-commit-record": damage_commit_record,
    "delete-array-metadata": delete_array_metadata,
    "delete-meta": delete_meta,
    "damage-manifest": damage_manifest,
}


def flip_bytes_everywhere(step_dir: Path) -> None:
    """Flip a byte in every 512 of every array file: whatever a restore reads, the params
    alone included, is damaged (read back as other values, or not at all)."""
    for path in array_files(step_dir):
        data = bytearray(path.read_bytes())
        for i in range(256, len(data), 512):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))
