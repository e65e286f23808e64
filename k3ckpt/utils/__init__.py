"""Small helpers every package shares: atomic writes, directory fsync, path containment, JSON
files, and how sizes, fractions and sets are written for people (and sizes read back)."""

from ._format import format_percent, format_ranges, format_some, human_bytes, human_count
from ._fs import (
    atomic_output,
    copy_file,
    copy_files,
    fsync_dir,
    is_within,
    pwrite_all,
    read_in_order,
    release_pages,
    temp_name,
    write_atomic,
)
from ._jsonfile import load_json
from ._parse import parse_rate, parse_size

__all__ = ["atomic_output", "copy_file", "copy_files", "format_percent", "format_ranges", "format_some",
           "fsync_dir", "human_bytes", "human_count", "is_within", "load_json", "parse_rate", "parse_size", "pwrite_all",
           "read_in_order", "release_pages", "temp_name", "write_atomic"]
