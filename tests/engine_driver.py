"""Run vLLM's offline ``LLM`` API on one model directory and write its greedy tokens as JSON.

Run by the engine environment's python (``scripts/engine_env.sh``), in a subprocess of
``tests/test_engine_run.py``; the test process never imports vllm, and this file imports nothing
of k3ckpt (which is not installed there). The caller sets the CPU backend's variables
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``).

Usage: python engine_driver.py REQUEST.json OUT.json, where REQUEST holds ``model`` (a directory),
``prompts`` (text), ``max_tokens``, ``logprobs`` (top-k per step), ``tensor_parallel_size`` and,
optionally, ``engine`` (more keyword arguments for ``LLM``). OUT gets, per prompt, its prompt
token ids, the generated token ids and text, and each step's top-k logprobs; plus the load and
generation times.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    t_import = time.monotonic()
    llm = LLM(model=request["model"], tensor_parallel_size=request.get("tensor_parallel_size", 1),
              enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0, **request.get("engine", {}))
    t_load = time.monotonic()
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
    with open(sys.argv[2], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
