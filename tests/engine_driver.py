"""Run vLLM's offline ``LLM`` API on one model directory and write its greedy tokens as JSON.

Run by the engine environment's python (``scripts/engine_env.sh``), in a subprocess of
``tests/test_engine_run.py``; the test process never imports vllm, and this file imports nothing
of k3ckpt (which is not installed there). The caller sets the CPU backend's variables
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``).

Usage: python engine_driver.py REQUEST.json OUT.json, where REQUEST holds ``model`` (a directory),
``prompts`` (text), ``max_tokens``, ``logprobs`` (top-k per step), ``tensor_parallel_size`` and,
optionally, ``engine`` (more keyword arguments for ``LLM``) and ``inspect_experts`` (true: ask
every worker, once the model is loaded, what its MoE layers hold - below). OUT gets, per prompt,
its prompt token ids, the generated token ids and text, and each step's top-k logprobs; plus the
load and generation times.

With ``inspect_experts``, ``OUT.load.json`` is written as soon as the load has completed (before
any forward pass, which may crash: vLLM issue 57837), holding per worker (``LLM.collective_rpc``,
vLLM's public way to run a function in every worker): its EP rank and size, the placement its
MoE layers use, the global expert ids of each MoE layer's local slots (from the layer's own
expert map), and the experts the loader's EP weight filter kept - vLLM's own
``compute_local_expert_ids`` called with the inputs ``DefaultModelLoader`` gives it (the parallel
config's ``expert_placement_strategy``; only local rank 0 logs the filter's line).

``python engine_driver.py --serve`` runs several models in one process, saving the ~10 s
import of vllm each: one JSON line ``[REQUEST, OUT, LOG]`` per model on stdin; each run's output
(fds 1 and 2) goes to its LOG, and one line ``{"ok": true|false}`` per run answers on the
original stdout. Each engine is shut down before the next starts (in-process at TP 1, vLLM frees
it: the resident memory stays flat over five engines here). After a failed run the process exits
with 1 - a refused load may leave state behind - and the caller starts a new one.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any


def experts_of_worker(worker: Any) -> dict:
    """What one worker's MoE layers hold (run in the worker by ``collective_rpc``)."""
    from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids

    layers: dict[str, list[int]] = {}
    out: dict[str, Any] = {"layers": layers}
    for name, module in worker.model_runner.get_model().named_modules():
        emap = getattr(module, "_expert_map", None)
        if emap is None or not hasattr(module, "moe_config"):
            continue
        pc = module.moe_config.moe_parallel_config
        out.update(ep_rank=pc.ep_rank, ep_size=pc.ep_size, placement=module.expert_placement_strategy,
                   num_experts=len(emap))
        slots = {int(local): g for g, local in enumerate(emap.tolist()) if local >= 0}
        layers[name] = [slots[i] for i in sorted(slots)]  # global id of local slot 0, 1, ...
    if layers:
        strategy = worker.vllm_config.parallel_config.expert_placement_strategy
        kept = compute_local_expert_ids(out["num_experts"], out["ep_size"], out["ep_rank"], placement=strategy)
        out.update(filter_placement=strategy, filter_kept=None if kept is None else sorted(kept))
    return out


def run_one(request_path: str, out_path: str) -> None:
    """Load the request's model, generate, write OUT, and shut the engine down."""
    request = json.loads(open(request_path).read())
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    t_import = time.monotonic()
    llm = LLM(model=request["model"], tensor_parallel_size=request.get("tensor_parallel_size", 1),
              enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0, **request.get("engine", {}))
    t_load = time.monotonic()
    if request.get("inspect_experts"):
        with open(out_path + ".load.json", "w") as f:
            json.dump({"workers": llm.collective_rpc(experts_of_worker)}, f, indent=1)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True,
                            logprobs=request.get("logprobs", 0))
    outputs = llm.generate(request["prompts"], params, use_tqdm=False)
    t_gen = time.monotonic()
    results = []
    for out in outputs:
        c = out.outputs[0]
        results.append({
            "prompt": out.prompt,
            "prompt_token_ids": list(out.prompt_token_ids or []),
            "token_ids": list(c.token_ids),
            "text": c.text,
            "logprobs": [{str(tid): lp.logprob for tid, lp in step.items()} for step in (c.logprobs or [])],
        })
    report = {"results": results, "seconds": {"import": t_import - t0, "load": t_load - t_import,
                                              "generate": t_gen - t_load}}
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    llm.llm_engine.engine_core.shutdown()  # the in-process engine core: frees it for the next run


def serve() -> int:
    """Run one model per stdin line until stdin closes (0) or a run fails (1)."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        request_path, out_path, log_path = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        try:
            run_one(request_path, out_path)
            ok = True
        except Exception:
            traceback.print_exc()
            ok = False
        sys.stdout.flush()
        sys.stderr.flush()
        gc.collect()
        reply.write(json.dumps({"ok": ok}) + "\n")
        if not ok:
            return 1
    return 0


def main() -> None:
    if sys.argv[1] == "--serve":
        sys.exit(serve())
    run_one(sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    main()
