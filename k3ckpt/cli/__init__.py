"""The ``k3ckpt`` command line: a thin click layer over the library.

Conventions: quiet success, one-line precise failure on stderr, ``--json`` for machines.
Exit codes: 0 ok, 1 problems found, 2 could not run.

Every command parses its options, calls one library function and prints what that function's
renderer (or ``to_json``) returns. One module per command group: ``_inspect`` (inspect, synth),
``_manifest`` (manifest build/pull/diff/keygen/sign, verify), ``_fetch`` (fetch), ``_deploy``
(plan, reshard, unshard, preflight), ``_mx`` (mx inspect/error/dequant/quantize); ``_main`` is
the root group, ``_options`` the options several commands share (``--json``, ``--jobs``,
sizes, the topology selection) and the error handler, ``_output`` JSON and progress output.
"""

from ._main import main

__all__ = ["main"]
