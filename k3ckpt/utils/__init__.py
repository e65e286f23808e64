"""Small helpers every package shares: atomic writes, directory fsync, path containment, JSON
files, and how sizes and sets are written for people."""

from ._format import format_ranges, human_bytes, human_count
from ._fs import fsync_dir, is_within
from ._jsonfile import load_json, write_atomic
from ._parse import parse_size

__all__ = [
    "format_ranges", "fsync_dir", "human_bytes", "human_count", "is_within", "load_json", "parse_size", "write_atomic",
]
