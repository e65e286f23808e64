"""Load functions out of the pinned inference-engine wheels, so the engines' own code judges what
k3ckpt writes (tests/test_engine_conformance.py; findings in docs/engines.md).

The wheels are downloaded without dependencies by ``scripts/engines.sh`` (run by
``scripts/test.sh``) into a cache outside the repository and never installed: they pull torch,
CUDA libraries and more. Instead a file is read out of the wheel (a zip) and either

- executed whole as a module (:meth:`Wheel.module`) when it imports nothing heavy, with stand-ins
  for those few imports placed in ``sys.modules`` only while it executes; or
- one definition - a function, a class, a method, a module-level assignment - is cut out of the
  file with :mod:`ast` and executed alone (:meth:`Wheel.definition`) in a namespace that holds
  exactly the names its body uses. The rest of the file, and its imports, never run.

Every stand-in is documented where it is made, with why it is faithful for the call made. No
engine code is copied into this repository: it is read from the wheel at test time.
"""

from __future__ import annotations
import __future__

import ast
import copy
import os
import re
import sys
import types
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any

ENGINES = {"vllm": "0.33.0", "sglang": "0.5.23"}
"""The pinned releases (keep in step with ``scripts/engines.sh``)."""


def engine_cache() -> Path:
    """Where ``scripts/engines.sh`` puts the wheels: ``$K3CKPT_ENGINE_CACHE`` (a test-only
    setting, not one of the package's registered variables), else ``~/.cache/k3ckpt/engines``."""
    return Path(os.environ.get("K3CKPT_ENGINE_CACHE") or Path.home() / ".cache" / "k3ckpt" / "engines")


def find_wheel(engine: str) -> Path | None:
    """The cached wheel of ``engine`` at its pinned version, or None."""
    version = ENGINES[engine]
    found = sorted(engine_cache().glob(f"{engine}-{version}-*.whl"))
    return found[0] if found else None


def missing_reason(engine: str) -> str:
    """The one-line skip reason when :func:`find_wheel` finds nothing."""
    return (f"{engine}=={ENGINES[engine]} wheel not in {engine_cache()} "
            f"(scripts/engines.sh downloads it; the package index was not reachable?)")


class Wheel:
    """A downloaded wheel, read as a zip file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path)
        self._trees: dict[str, ast.Module] = {}  # parsed once per file: the K3 model is 2,000 lines

    def source(self, member: str) -> str:
        """The text of ``member`` (e.g. ``vllm/model_executor/model_loader/ep_weight_filter.py``)."""
        return self._zip.read(member).decode("utf-8")

    def module(self, member: str, stand_ins: Mapping[str, types.ModuleType] | None = None) -> types.ModuleType:
        """Execute ``member`` whole as a fresh module (not registered in ``sys.modules``), with
        ``stand_ins`` visible to its imports only while it executes."""
        mod = types.ModuleType(member.removesuffix(".py").replace("/", "."))
        mod.__file__ = f"{self.path}!/{member}"
        code = compile(self.source(member), mod.__file__, "exec")
        with _modules(stand_ins or {}):
            exec(code, mod.__dict__)
        return mod

    def node(self, member: str, qualname: str) -> ast.stmt:
        """The statement defining ``qualname`` in ``member``: a function or class, a method
        (``Class.method``), or a module- or class-level assignment (``Class.attribute``)."""
        body: list[ast.stmt] = self._tree(member).body
        found: ast.stmt | None = None
        for part in qualname.split("."):
            found = next((n for n in body if part in _defined_names(n)), None)
            if found is None:
                raise LookupError(f"{qualname} not found in {member} of {self.path.name}")
            body = getattr(found, "body", [])
        assert found is not None
        return found

    def definition(self, member: str, qualname: str, namespace: dict[str, Any]) -> Any:
        """Execute only the statement defining ``qualname`` in ``namespace`` and return what it
        defines. ``@staticmethod``/``@classmethod`` are dropped (the method is returned as a plain
        function); other decorators run. Annotations are not evaluated (as under ``from
        __future__ import annotations``), so their names need no stand-ins."""
        stmt = copy.deepcopy(self.node(member, qualname))  # the parsed tree is shared
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stmt.decorator_list = [d for d in stmt.decorator_list
                                   if not (isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod"))]
        module = ast.Module(body=[stmt], type_ignores=[])
        code = compile(module, f"{self.path}!/{member}:{qualname}", "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, namespace)
        return namespace[qualname.rsplit(".", 1)[-1]]

    def registered_parameters(self, member: str, qualname: str) -> list[str]:
        """The names a ``create_weights`` method registers (``layer.register_parameter("NAME",
        ...)`` calls, read from the method's syntax tree): which fused-expert parameters exist."""
        found = []
        for node in ast.walk(self.node(member, qualname)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "register_parameter" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                found.append(node.args[0].value)
        return found

    def _tree(self, member: str) -> ast.Module:
        if member not in self._trees:
            self._trees[member] = ast.parse(self.source(member))
        return self._trees[member]


def _defined_names(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, ast.Assign):
        return {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return {stmt.target.id}
    return set()


@contextmanager
def _modules(stand_ins: Mapping[str, types.ModuleType]) -> Iterator[None]:
    """Put ``stand_ins`` into ``sys.modules`` for the duration, restoring what was there."""
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def regex_stand_in() -> types.ModuleType:
    """For ``import regex as re``: the standard :mod:`re` under the name ``regex``. Faithful for
    the patterns used here (``\\.experts\\.(\\d+)\\.`` and prefix/substring rules): they use no
    syntax on which the two libraries differ."""
    mod = types.ModuleType("regex")
    mod.__dict__.update({k: getattr(re, k) for k in dir(re) if not k.startswith("__")})
    return mod


class LoggerStandIn:
    """For vLLM's ``logger`` (``init_logger``): records messages instead of printing them; the
    functions loaded here only log, never branch on the logger."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def _log(self, msg: str, *args: object, **_: object) -> None:
        self.messages.append(msg % args if args else msg)

    info = warning = debug = error = info_once = warning_once = debug_once = _log


def numpy_torch_stand_in() -> types.ModuleType:
    """For the ``torch`` calls of ``determine_expert_map`` with ``return_expert_mask=False``:
    ``torch.full``, ``torch.arange`` and ``torch.int32``, made from numpy. Faithful because those
    calls build 1-D int32 arrays and the function only fills them by slice and fancy-index
    assignment, which numpy and torch define alike. Any other torch call fails loudly
    (AttributeError), never silently."""
    import numpy as np

    mod = types.ModuleType("torch")
    mod.__dict__.update(
        int32=np.int32,
        full=lambda shape, fill, dtype=None: np.full(shape, fill, dtype=dtype),
        arange=lambda *args, dtype=None: np.arange(*args, dtype=dtype),
    )
    return mod


# -- vLLM ----------------------------------------------------------------------------------------

V_FILTER = "vllm/model_executor/model_loader/ep_weight_filter.py"
V_WEIGHT_UTILS = "vllm/model_executor/model_loader/weight_utils.py"
V_DEFAULT_LOADER = "vllm/model_executor/model_loader/default_loader.py"
V_EXPERT_MAP = "vllm/model_executor/layers/fused_moe/expert_map_manager.py"
V_MOE_CONFIG = "vllm/model_executor/layers/fused_moe/config.py"
V_MOE_LAYER = "vllm/model_executor/layers/fused_moe/layer.py"
V_ROUTED = "vllm/model_executor/layers/fused_moe/routed_experts.py"
V_EPLB = "vllm/distributed/eplb/eplb_state.py"
V_PARALLEL = "vllm/config/parallel.py"
V_UTILS = "vllm/model_executor/models/utils.py"
V_K3 = "vllm/models/kimi_k3/nvidia/model.py"
V_MXFP4_MOE = ("vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
               "compressed_tensors_moe_w4a4_mxfp4.py")


class VLLM(Wheel):
    """The vLLM functions the conformance tests call, each loaded from the wheel."""

    @cached_property
    def ep_filter(self) -> types.ModuleType:
        """``ep_weight_filter.py`` whole: ``parse_expert_id``, ``compute_local_expert_ids``,
        ``should_skip_weight``. Its only import is ``regex`` (:func:`regex_stand_in`)."""
        return self.module(V_FILTER, {"regex": regex_stand_in()})

    @cached_property
    def determine_expert_map(self) -> Any:
        """``determine_expert_map`` alone, over :func:`numpy_torch_stand_in`. Its placement
        names come from ``ExpertPlacementStrategy`` in ``vllm/config/parallel.py`` (executed
        alone too: it is a ``Literal``)."""
        from typing import Literal

        ns: dict[str, Any] = {"Literal": Literal}
        strategy = self.definition(V_PARALLEL, "ExpertPlacementStrategy", ns)
        return self.definition(V_EXPERT_MAP, "determine_expert_map",
                               {"torch": numpy_torch_stand_in(), "ExpertPlacementStrategy": strategy})

    def ep_size_and_rank(self, tp: int, dp: int, rank: int) -> tuple[int, int]:
        """vLLM's EP size and EP rank of global rank ``rank`` in a TP ``tp`` x DP ``dp`` launch
        (no PCP): ``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``, which ``make`` uses
        under expert parallelism (ep_size, ep_rank = the flattened TP). Its one outside call,
        ``get_tensor_model_parallel_rank()``, is answered with the rank's TP rank, which is what
        it returns in that process (ranks are numbered DP-major: rank = dp_rank * tp + tp_rank)."""
        dp_rank, tp_rank = divmod(rank, tp)
        flatten = self.definition(V_MOE_CONFIG, "FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp",
                                  {"get_tensor_model_parallel_rank": lambda: tp_rank})
        return flatten(tp, dp, dp_rank, 1, 0)

    @cached_property
    def filter_duplicate_safetensors_files(self) -> Any:
        """The index check (``weight_utils.py``); it uses only ``os`` and ``json``."""
        import json

        return self.definition(V_WEIGHT_UTILS, "filter_duplicate_safetensors_files", {"os": os, "json": json})

    @cached_property
    def weights_mapper_class(self) -> Any:
        """``WeightsMapper`` (a dataclass of prefix/substring/regex/suffix rules). Stand-ins: the
        dataclass helpers and ``Mapping`` it names (the real ones), ``re`` (:func:`regex_stand_in`)
        and ``logger`` (:class:`LoggerStandIn`, used only for a kv_scale deprecation warning)."""
        from dataclasses import dataclass, field, replace

        ns = {"dataclass": dataclass, "field": field, "replace": replace, "Mapping": Mapping,
              "re": regex_stand_in(), "logger": LoggerStandIn()}
        return self.definition(V_UTILS, "WeightsMapper", ns)

    @cached_property
    def k3_hf_to_vllm_mapper(self) -> Any:
        """``KimiK3ForConditionalGeneration.hf_to_vllm_mapper``: the class attribute's own
        statement, executed with the real ``WeightsMapper``."""
        ns = {"WeightsMapper": self.weights_mapper_class}
        return self.definition(V_K3, "KimiK3ForConditionalGeneration.hf_to_vllm_mapper", ns)

    @cached_property
    def fused_moe_make_expert_params_mapping(self) -> Any:
        """The expert mapping the K3 model builds when the routed experts are a fused MoE layer
        (``model.py`` calls it with ``w1``/``w2``/``w3``): ``fused_moe_make_expert_params_mapping``
        -> ``RoutedExperts.make_expert_params_mapping`` -> ``build_expert_params_mapping`` ->
        ``EplbState.build_initial_global_physical_to_logical_map``, each executed from the wheel;
        ``RoutedExperts``/``EplbState`` are namespaces holding just those static methods."""
        eplb = types.SimpleNamespace()
        eplb.build_initial_global_physical_to_logical_map = self.definition(
            V_EPLB, "EplbState.build_initial_global_physical_to_logical_map", {})
        routed = types.SimpleNamespace()
        ns = {"EplbState": eplb, "RoutedExperts": routed, "logger": LoggerStandIn()}
        routed.build_expert_params_mapping = self.definition(V_ROUTED, "RoutedExperts.build_expert_params_mapping", ns)
        routed.make_expert_params_mapping = self.definition(V_ROUTED, "RoutedExperts.make_expert_params_mapping", ns)
        return self.definition(V_MOE_LAYER, "fused_moe_make_expert_params_mapping", ns)

    @cached_property
    def k3_mega_moe_expert_params_mapping(self) -> Any:
        """The mapping the K3 model uses with DeepGEMM MegaMoE experts (pure Python)."""
        return self.definition(V_K3, "make_kimi_k3_mega_moe_expert_params_mapping", {})

    @cached_property
    def download_weights_from_hf(self) -> Any:
        """vLLM's weight download (``weight_utils.py``): ``snapshot_download(cache_dir=...,
        local_files_only=huggingface_hub.constants.HF_HUB_OFFLINE)`` under its own file lock.
        Executed from the wheel with its helpers from the wheel too (``get_lock``,
        ``DisabledTqdm``, ``repo_utils.hf_api``/``hf_fs``) over the real ``huggingface_hub``,
        ``filelock`` and ``tqdm``; stand-ins: ``logger``, vLLM's version string, and
        ``SAFE_WEIGHTS_INDEX_NAME`` (transformers' constant, ``model.safetensors.index.json``) and
        the ``@instrument`` tracing decorator (returns the function unchanged)."""
        import fnmatch
        import hashlib
        import json
        import tempfile
        import time

        import filelock
        import huggingface_hub
        from tqdm.auto import tqdm

        repo_utils = "vllm/transformers_utils/repo_utils.py"
        ns: dict[str, Any] = {"os": os, "json": json, "fnmatch": fnmatch, "time": time, "Path": Path,
                              "hashlib": hashlib, "filelock": filelock, "tqdm": tqdm, "huggingface_hub": huggingface_hub,
                              "HfApi": huggingface_hub.HfApi, "logger": LoggerStandIn(), "VLLM_VERSION": "0.33.0",
                              "SAFE_WEIGHTS_INDEX_NAME": "model.safetensors.index.json",
                              "temp_dir": tempfile.gettempdir(), "_hf_api": None,
                              "instrument": lambda **_: (lambda f: f)}
        for member, name in ((repo_utils, "hf_api"), (repo_utils, "hf_fs"), (V_WEIGHT_UTILS, "get_lock"),
                             (V_WEIGHT_UTILS, "DisabledTqdm")):
            self.definition(member, name, ns)
        return self.definition(V_WEIGHT_UTILS, "download_weights_from_hf", ns)

    @cached_property
    def maybe_download_from_modelscope(self) -> Any:
        """vLLM's ``VLLM_USE_MODELSCOPE=1`` path (``weight_utils.py``): ModelScope's
        ``snapshot_download(cache_dir=download_dir, local_files_only=HF_HUB_OFFLINE, ...)`` under
        ``get_lock`` (from the wheel), over the real ``modelscope``; ``envs`` is a stand-in with
        ``VLLM_USE_MODELSCOPE`` set."""
        ns = {"envs": types.SimpleNamespace(VLLM_USE_MODELSCOPE=True)}
        ns.update({k: v for k, v in self.download_weights_from_hf.__globals__.items()
                   if k in ("os", "huggingface_hub", "get_lock")})
        return self.definition(V_WEIGHT_UTILS, "maybe_download_from_modelscope", ns)

def load_vllm() -> VLLM | None:
    path = find_wheel("vllm")
    return VLLM(path) if path else None


# -- SGLang --------------------------------------------------------------------------------------

S_K3 = "sglang/srt/models/kimi_k3.py"
S_MOE_LAYER = "sglang/srt/layers/moe/fused_moe_triton/layer.py"
S_UTILS = "sglang/srt/models/utils.py"
S_WEIGHT_UTILS = "sglang/srt/model_loader/weight_utils.py"
S_LAYER_UTILS = "sglang/srt/layers/utils/common.py"
S_CONFIG = "sglang/srt/configs/kimi_linear.py"
S_MXFP4 = "sglang/srt/layers/quantization/mxfp4.py"


class SGLang(Wheel):
    """The SGLang functions the conformance tests call, each loaded from the wheel."""

    @cached_property
    def k3_hf_to_sglang_mapper(self) -> Any:
        """``KimiK3ForConditionalGeneration.hf_to_sglang_mapper`` with SGLang's own
        ``WeightsMapper`` (a dataclass; its methods use only builtins)."""
        from dataclasses import dataclass, field

        mapper_class = self.definition(S_UTILS, "WeightsMapper", {"dataclass": dataclass, "field": field})
        return self.definition(S_K3, "KimiK3ForConditionalGeneration.hf_to_sglang_mapper",
                               {"WeightsMapper": mapper_class})

    @cached_property
    def filter_duplicate_safetensors_files(self) -> Any:
        """SGLang's index check (``model_loader/weight_utils.py``); it uses ``os``, ``json`` and
        ``fnmatch`` only."""
        import fnmatch
        import json

        return self.definition(S_WEIGHT_UTILS, "filter_duplicate_safetensors_files",
                               {"os": os, "json": json, "fnmatch": fnmatch})

    @cached_property
    def expert_weight_name(self) -> re.Pattern[str]:
        """``_EXPERT_WEIGHT_NAME``: the fragment the K3 loader looks experts up by."""
        return self.definition(S_K3, "_EXPERT_WEIGHT_NAME", {"re": re})

    @cached_property
    def make_expert_params_mapping(self) -> Any:
        """``FusedMoE.make_expert_params_mapping`` (a classmethod that never uses ``cls``:
        called with ``None`` for it)."""
        fn = self.definition(S_MOE_LAYER, "FusedMoE.make_expert_params_mapping", {})
        return lambda **kw: fn(None, **kw)

    def k3_load_weights(self, text_config: dict[str, Any], param_names: list[str]) -> tuple[Any, list[tuple[Any, ...]]]:
        """``KimiK3LinearForCausalLM.load_weights`` (``models/kimi_k3.py``) executed from the wheel
        on a stand-in ``self``. Returns ``(load, calls)``: ``load(pairs)`` runs it on ``(name,
        tensor)`` pairs; every parameter's ``weight_loader`` appends ``(param, tensor, args,
        kwargs)`` to ``calls``.

        Stand-ins: ``self.config`` is the checkpoint's ``text_config`` with SGLang's
        ``KimiLinearConfig.is_moe``/``is_linear_attn`` (from the wheel); ``self.model`` has
        ``start_layer`` 0 and ``end_layer`` = the layer count (no pipeline parallelism);
        ``named_parameters()`` is ``param_names``; ``post_load_weights`` does nothing (it fuses
        MLA weights after loading, no name handling); ``_is_npu`` False. ``get_layer_id``,
        ``_maybe_map_fp8_pb_scale_name``, ``_EXPERT_WEIGHT_NAME``, ``FusedMoE.make_expert_params_mapping``
        and ``maybe_remap_kv_scale_name`` are the real ones."""
        import json

        cfg_class = type("KimiLinearConfig", (types.SimpleNamespace,), {})
        for prop in ("is_moe", "is_linear_attn"):
            setattr(cfg_class, prop, self.definition(S_CONFIG, f"KimiLinearConfig.{prop}", {}))
        cfg = cfg_class(**text_config)
        calls: list[tuple[Any, ...]] = []

        class Param:
            def __init__(self, name: str) -> None:
                self.name = name

            def weight_loader(self, param: Any, loaded: Any, *args: Any, **kwargs: Any) -> None:
                calls.append((self.name, loaded, args, kwargs))

        params = {n: Param(n) for n in param_names}
        model = types.SimpleNamespace(start_layer=0, end_layer=cfg.num_hidden_layers)
        stub = types.SimpleNamespace(config=cfg, model=model, named_parameters=lambda: params.items(),
                                     post_load_weights=lambda: None)
        fused_moe = types.SimpleNamespace(make_expert_params_mapping=self.make_expert_params_mapping)
        ns = {
            "FusedMoE": fused_moe, "_EXPERT_WEIGHT_NAME": self.expert_weight_name, "_is_npu": False,
            "get_layer_id": self.definition(S_LAYER_UTILS, "get_layer_id", {"re": re}),
            "_maybe_map_fp8_pb_scale_name": self.definition(S_K3, "_maybe_map_fp8_pb_scale_name", {}),
            "maybe_remap_kv_scale_name": self.definition(S_WEIGHT_UTILS, "maybe_remap_kv_scale_name",
                                                         {"logger": LoggerStandIn(), "re": re, "json": json}),
            "default_weight_loader": lambda param, loaded, **kw: calls.append(("default", loaded, (), kw)),
        }
        method = self.definition(S_K3, "KimiK3LinearForCausalLM.load_weights", ns)
        return (lambda pairs: method(stub, pairs)), calls

    def local_expert(self, num_experts: int, ep_size: int, ep_rank: int) -> Any:
        """``FusedMoE._map_global_expert_id_to_local_expert_id`` of the rank: global expert id
        -> local slot, -1 for another rank's expert (then ``weight_loader`` returns). The method
        reads four attributes that ``FusedMoE.__init__`` sets; the stand-in ``self`` holds the
        values ``__init__`` computes for K3 without fused shared experts and without elastic EP
        (fused_moe_triton/layer.py, the lines after ``self._num_global_routed = ``):
        ``_num_global_routed = num_experts``, ``_expert_storage_rank = moe_ep_rank``,
        ``_num_local_routed = _num_global_routed // moe_ep_size`` (after ``assert
        _num_global_routed % storage_ep_size == 0``, reproduced here as a ValueError)."""
        if num_experts % ep_size:
            raise ValueError(f"SGLang asserts num_experts % ep_size == 0 ({num_experts} % {ep_size})")
        method = self.definition(S_MOE_LAYER, "FusedMoE._map_global_expert_id_to_local_expert_id", {})
        stub = types.SimpleNamespace(_expert_storage_rank=ep_rank, _num_local_routed=num_experts // ep_size,
                                     _has_fused_shared=False, _num_global_routed=num_experts)
        return lambda expert_id: method(stub, expert_id)


def load_sglang() -> SGLang | None:
    path = find_wheel("sglang")
    return SGLang(path) if path else None


# -- what a rank reads at load (docs/engines.md; BENCHMARKS.md) ----------------------------------


def rank_read_bytes(vllm: VLLM, tensors: Mapping[str, int], *, tp: int, dp: int, gpus_per_node: int,
                    num_experts: int, placement: str = "linear") -> list[tuple[int, int, int]]:
    """Per global rank ``(rank, from_source, from_node_dir)``: the tensor bytes vLLM's filter
    lets the rank read (``should_skip_weight`` with vLLM's own EP size/rank and local experts)
    from the whole checkpoint ``tensors`` (name -> bytes), and from its node directory, which
    holds every non-expert tensor and all tensors of the node's ranks' experts (what test (a)
    pins). Header bytes are left out."""
    f = vllm.ep_filter
    world = tp * dp
    local = []
    for rank in range(world):
        ep_size, ep_rank = vllm.ep_size_and_rank(tp, dp, rank)
        ids = f.compute_local_expert_ids(num_experts, ep_size, ep_rank, placement)
        local.append(set(range(num_experts)) if ids is None else ids)
    out = []
    for rank in range(world):
        node = rank // gpus_per_node
        node_experts = set().union(*local[node * gpus_per_node:(node + 1) * gpus_per_node])
        kept = {n: b for n, b in tensors.items() if not f.should_skip_weight(n, local[rank])}
        held = sum(b for n, b in kept.items() if (e := f.parse_expert_id(n)) is None or e in node_experts)
        out.append((rank, sum(kept.values()), held))
    return out


# -- one node directory against vLLM's own functions (the conformance check, for the demo too) ------


INDEX = "model.safetensors.index.json"


def _weight_map(root: Path) -> dict[str, str]:
    import json

    return json.loads((root / INDEX).read_text())["weight_map"]


def local_experts(vllm: VLLM, *, tp: int, dp: int, rank: int, num_experts: int, placement: str) -> set[int]:
    """The experts vLLM's global rank ``rank`` loads under expert parallelism: its own EP
    size/rank (the flattened TP x DP), then its own ``compute_local_expert_ids``."""
    ep_size, ep_rank = vllm.ep_size_and_rank(tp, dp, rank)
    local = vllm.ep_filter.compute_local_expert_ids(num_experts, ep_size, ep_rank, placement)
    return set(range(num_experts)) if local is None else local


def node_problems(vllm: VLLM, source_names: Iterable[str], node_dir: Path, *, tp: int, dp: int, gpus_per_node: int,
                  node: int, num_experts: int, placement: str) -> list[str]:
    """What vLLM's ranks of node ``node`` would miss in ``node_dir``, or find there in excess
    (test (a)): every tensor of each rank's experts present (scales too), the heavy expert
    tensors ``should_skip_weight`` keeps exactly the rank's own, every dense tensor of the source
    present, and no expert that no rank of the node loads. Empty: the directory is exactly the
    node's."""
    f = vllm.ep_filter
    src = set(source_names)
    dense = {n for n in src if f.parse_expert_id(n) is None}
    names = set(_weight_map(node_dir))
    experts = {n for n in names if f.parse_expert_id(n) is not None}
    problems = []
    if dense - names:
        problems.append(f"node {node}: dense tensors missing: {sorted(dense - names)[:3]}")
    if names - experts - dense:
        problems.append(f"node {node}: tensors not in the source: {sorted(names - experts - dense)[:3]}")
    needed_by_node: set[str] = set()
    world = tp * dp
    for rank in range(node * gpus_per_node, min((node + 1) * gpus_per_node, world)):
        local = local_experts(vllm, tp=tp, dp=dp, rank=rank, num_experts=num_experts, placement=placement)
        needed = {n for n in src if f.parse_expert_id(n) in local}  # every tensor of its experts, scales too
        needed_by_node |= needed
        if needed - names:
            problems.append(f"node {node} rank {rank}: {len(needed - names)} expert tensors missing, "
                            f"experts {sorted({f.parse_expert_id(n) for n in needed - names})}")
        # what the filter lets this rank read of the directory's heavy expert tensors
        kept = {n for n in experts if not f.should_skip_weight(n, local) and f.should_skip_weight(n, set())}
        heavy = {n for n in needed if f.should_skip_weight(n, set())}
        if kept != heavy:
            problems.append(f"node {node} rank {rank}: filter keeps {len(kept)} heavy tensors, rank needs {len(heavy)}")
    if experts - needed_by_node:
        problems.append(f"node {node}: {len(experts - needed_by_node)} expert tensors no rank of it loads")
    return problems


def index_check(vllm: VLLM, folder: Path) -> list[str]:
    """The files vLLM's DefaultModelLoader hands on for a local directory: ``glob("*.safetensors")``
    (the first allow pattern of load formats auto/hf/safetensors), then its own
    ``filter_duplicate_safetensors_files(files, folder, "model.safetensors.index.json")``,
    which raises when the index names a file that is not there."""
    import glob

    files = glob.glob(os.path.join(str(folder), "*.safetensors"))
    return vllm.filter_duplicate_safetensors_files(files, str(folder), INDEX)


def _check(argv: list[str]) -> int:
    """``python tests/engines.py check SOURCE NODE_DIR TP DP GPUS_PER_NODE NODE [PLACEMENT]``."""
    vllm = load_vllm()
    if vllm is None:
        print(missing_reason("vllm"), file=sys.stderr)
        return 2
    source, ndir = Path(argv[0]), Path(argv[1])
    tp, dp, gpn, node = (int(a) for a in argv[2:6])
    placement = argv[6] if len(argv) > 6 else "linear"
    names = _weight_map(source)
    experts = 1 + max(e for n in names if (e := vllm.ep_filter.parse_expert_id(n)) is not None)
    try:
        kept = index_check(vllm, ndir)
    except (FileNotFoundError, OSError) as e:
        print(f"vLLM's index check refuses {ndir}: {e}")
        return 1
    problems = node_problems(vllm, names, ndir, tp=tp, dp=dp, gpus_per_node=gpn, node=node,
                             num_experts=experts, placement=placement)
    for p in problems:
        print(p)
    if problems:
        return 1
    first, last = node * gpn, min((node + 1) * gpn, tp * dp) - 1
    print(f"vLLM 0.33.0's own functions accept {ndir}: the index check keeps its {len(kept)} weight files; "
          f"under TP{tp} DP{dp} (EP{tp * dp}, {placement}) ranks {first}-{last} find every tensor of their "
          f"experts, the weight filter keeps exactly their own, and no other expert is there")
    return 0


def _main(argv: list[str]) -> int:
    """``python tests/engines.py CHECKPOINT TP DP GPUS_PER_NODE [PLACEMENT]``: the per-rank load
    reads of :func:`rank_read_bytes` for a checkpoint's headers (e.g. ``k3ckpt synth k3-full
    --preset k3-full --headers-only``), ranks with equal figures folded into one line."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if argv[:1] == ["check"]:
        return _check(argv[1:])
    from k3ckpt.format import open_checkpoint

    vllm = load_vllm()
    if vllm is None:
        print(missing_reason("vllm"), file=sys.stderr)
        return 2
    ckpt = open_checkpoint(argv[0])
    tp, dp, gpn = (int(a) for a in argv[1:4])
    experts = 1 + max(e for n in ckpt.tensors if (e := vllm.ep_filter.parse_expert_id(n)) is not None)
    rows = rank_read_bytes(vllm, {n: t.nbytes for n, t in ckpt.tensors.items()}, tp=tp, dp=dp,
                           gpus_per_node=gpn, num_experts=experts, placement=argv[4] if len(argv) > 4 else "linear")
    total = sum(t.nbytes for t in ckpt.tensors.values())
    print(f"{argv[0]}: {total:,} tensor bytes, {experts} experts; vLLM TP{tp} DP{dp} EP{tp * dp}, {gpn} GPUs per node")
    start = 0
    for i, (_, src, node) in enumerate(rows):
        if i + 1 == len(rows) or rows[i + 1][1:] != (src, node):
            print(f"ranks {start}-{i}: reads {src:,} bytes ({src / 1e9:.1f} GB) from the original layout, "
                  f"{node:,} ({node / 1e9:.1f} GB) from its node directory")
            start = i + 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
