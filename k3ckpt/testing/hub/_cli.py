"""``python -m k3ckpt.testing.hub``: serve directories from a shell until interrupted."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._hub import LoopbackHub
from ._repo import RepoSpec
from ._xet import XET_URL_TTL


def main(argv: Sequence[str] | None = None) -> int:
    """Serve directories until interrupted: ``python -m k3ckpt.testing.hub DIR --repo ID``."""
    parser = argparse.ArgumentParser(
        prog="python -m k3ckpt.testing.hub",
        description="Serve local checkpoint directories over the Hugging Face and ModelScope APIs on loopback.",
    )
    parser.add_argument("dirs", nargs="+", type=Path, help="directory to serve (one per --repo)")
    parser.add_argument("--repo", action="append", default=None,
                        help="repo id for the matching DIR (default moonshotai/Kimi-K3 for a single DIR)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=None, help="require this bearer token")
    parser.add_argument("--commit", default=None, help="pin the commit sha (single repo only)")
    parser.add_argument("--page-size", type=int, default=1000)
    parser.add_argument("--cache-dir", type=Path, default=None, help="hash cache directory")
    parser.add_argument("--xet", action="store_true",
                        help="present LFS files as Xet-backed: resolve redirects to a signed URL on a bridge port")
    parser.add_argument("--xet-url-ttl", type=float, default=XET_URL_TTL, metavar="SECONDS",
                        help=f"lifetime of the signed bridge URLs (default {XET_URL_TTL:g})")
    args = parser.parse_args(argv)

    repos_ids = args.repo or (["moonshotai/Kimi-K3"] if len(args.dirs) == 1 else [])
    if len(repos_ids) != len(args.dirs):
        parser.error("give one --repo per DIR")
    if args.commit and len(args.dirs) != 1:
        parser.error("--commit needs exactly one DIR")
    repos = {rid: RepoSpec(d, commit=args.commit) for rid, d in zip(repos_ids, args.dirs)}
    hub = LoopbackHub(repos, host=args.host, port=args.port, cache_dir=args.cache_dir, token=args.token,
                      page_size=args.page_size, xet=args.xet, xet_url_ttl=args.xet_url_ttl)
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    hub.start()
    try:
        print(f"Serving on {hub.url}", flush=True)
        if args.xet:
            print(f"Xet bridge on {hub.bridge_url}", flush=True)
        for rid in repos:
            snap = hub.snapshot(rid)
            total = sum(e.size for e in snap.files.values())
            print(f"  {rid} @ {snap.commit} ({len(snap.files)} files, {total} bytes) from {snap.spec.path}")
        print("Export:")
        for k, v in hub.env_vars().items():
            print(f"  export {k}={v}")
        print("Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        hub.stop()
    print("stopped", flush=True)
    return 0
