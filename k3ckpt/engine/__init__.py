"""Code that runs inside an inference engine: the ``k3ckpt`` load format (vLLM plugin,
:mod:`k3ckpt.engine.vllm`) and what it checks (:mod:`k3ckpt.engine.guard`: topology and
tensor digests, pure Python).

Nothing here is imported by the CLI; ``import k3ckpt.engine`` imports neither torch nor vLLM.
"""

from .guard import TensorDigests, check_topology, fitting_launch, spans

__all__ = ["TensorDigests", "check_topology", "fitting_launch", "spans"]
