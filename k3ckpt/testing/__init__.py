"""Test doubles you can use too: synthetic checkpoints of every supported family (tiny, with real
headers and bytes), a loopback Hugging Face / ModelScope hub with fault injection, and the crash
campaigns that kill fetch and reshard at random points and check what survives.

Importing this package imports numpy (the synthesizer draws weights with it).
"""

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
    "reshard_campaign",
    "spec_from_preset",
    "synthesize",
]
