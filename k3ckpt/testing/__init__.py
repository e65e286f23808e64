"""Test doubles you can use too: synthetic checkpoints of every supported family (tiny, with real
headers and bytes), a loopback Hugging Face / ModelScope hub with fault injection, the crash
campaigns that kill fetch and reshard at random points and check what survives, and
:func:`inject_fault`, the in-process seam that makes a named step of a run fail
(:mod:`k3ckpt.faults` lists the points).

Importing this package imports numpy (the synthesizer draws weights with it).
"""

from ..faults import inject as inject_fault
from .crash import CrashStats, fetch_campaign, reshard_campaign
from .hub import LoopbackHub, RepoSpec
from .synth import PRESETS, SynthResult, SynthSpec, spec_from_preset, synthesize

__all__ = [
    "PRESETS",
    "CrashStats",
    "LoopbackHub",
    "RepoSpec",
    "SynthResult",
    "SynthSpec",
    "fetch_campaign",
    "inject_fault",
    "reshard_campaign",
    "spec_from_preset",
    "synthesize",
]
