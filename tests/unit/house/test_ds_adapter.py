"""One DeepSpeed adapter: only ``pretrain/ds_adapter/`` touches DeepSpeed's private attributes and undocumented
internals, so a DeepSpeed upgrade is checked (and fixed) in one module.

The rule, checked on the source (AST) of every ``.py`` under ``pretrain/``, ``cluster/`` and ``eval/`` except the
adapter:

* DeepSpeed is imported only for its documented public entry points (:data:`PUBLIC`): ``deepspeed.initialize``,
  ``deepspeed.zero.GatheredParameters``, the ``deepspeed.utils.safe_*`` accessors, ``zero_to_fp32``'s
  ``get_fp32_state_dict_from_zero_checkpoint``, ``deepspeed.moe.layer.MoE`` and the MoE tutorial's
  ``split_params_into_different_moe_groups_for_optimizer``; no ``deepspeed.runtime``, ``deepspeed.checkpoint``,
  ``deepspeed.utils.groups`` or other module, also not through ``importlib``;
* no attribute, nor ``getattr``/``hasattr``/``setattr`` name, from :data:`INTERNAL_NAMES` (what DeepSpeed puts on
  parameters, engines and ZeRO optimizers: ``ds_id``, ``ds_tensor``, ``averaged_gradients``, ``_hp_*``, ...);
* no private (``_x``) attribute on a DeepSpeed object: a receiver named like an engine, an optimizer, a wrapper
  or a name imported from DeepSpeed (``engine._config``, ``groups._get_expert_parallel_rank``);
* no ``.optimizer`` of an optimizer (the torch optimizer inside DeepSpeed's wrappers);
* no keyword argument only DeepSpeed's internal signatures take (:data:`INTERNAL_KEYWORDS`), no DeepSpeed
  checkpoint file name (``mp_rank_*_model_states.pt``, ...) outside a docstring.

Model code reads no DeepSpeed attribute at all (the same rule, and ``pretrain.model`` imports no DeepSpeed: the
import-linter contract that ``tests/integration/house/test_layers.py`` checks). The MoE state-dict names that
DeepSpeed's checkpoint format requires (``deepspeed_moe``, ``deepspeed_experts``) are names of our modules, not
DeepSpeed attributes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ADAPTER = ROOT / "pretrain" / "ds_adapter"
SCANNED = ("pretrain", "cluster", "eval", "benchmarks")

PUBLIC: dict[str, set[str]] = {
    "deepspeed": {"initialize", "zero.GatheredParameters"},
    "deepspeed.utils": {
        "safe_get_full_fp32_param",
        "safe_set_full_fp32_param",
        "safe_get_full_grad",
        "safe_get_full_optimizer_state",
        "safe_set_full_optimizer_state",
    },
    "deepspeed.utils.zero_to_fp32": {"get_fp32_state_dict_from_zero_checkpoint"},
    "deepspeed.moe.layer": {"MoE"},
    "deepspeed.moe.utils": {"split_params_into_different_moe_groups_for_optimizer"},
}

"""module -> the names other modules may use from it (``import deepspeed`` then ``deepspeed.<name>``)."""

INTERNAL_NAMES = {
    # ZeRO-3 parameter partitioning (deepspeed/runtime/zero/partition_parameters.py)
    "ds_id",
    "ds_tensor",
    "ds_numel",
    "ds_shape",
    "ds_status",
    "ds_persist",
    "ds_active_sub_modules",
    "partition_numel",
    "all_gather_coalesced",
    # ZeRO-1/2/3 and bf16 optimizer internals
    "averaged_gradients",
    "params_in_partition",
    "fp16_groups",
    "fp32_groups",
    "bf16_groups",
    "fp32_groups_gradients",
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
    "cpu_offload",
    "_zero_padding",
    "_hp_mapping",
    # engine internals
    "_config",
    "checkpoint_engine",
    "load_universal_checkpoint",
    # DeepSpeed MoE's parameter tags and engine hooks
    "allreduce",
    "group_name",
    "expert_group_name",
    "set_deepspeed_parallelism",
}
INTERNAL_KEYWORDS = {"load_from_fp32_weights"}

"""Keyword arguments only DeepSpeed's internal signatures take."""
_FILE_LAYOUT = re.compile(r"mp_rank_|_model_states|_optim_states")

"""DeepSpeed's checkpoint file names (not a documented format: read through the adapter)."""
_INTERNAL_PREFIXES = ("_hp_", "_lazy_init_hp")
_DS_RECEIVER = re.compile(r"engine|optim|wrapper|^opt$|deepspeed|^groups$|^zero$")


def _internal(name: str) -> bool:
    return name in INTERNAL_NAMES or name.startswith(_INTERNAL_PREFIXES)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _tokens(expr: ast.expr) -> list[str]:
    return [t for t in re.split(r"\W+", ast.unparse(expr)) if t]


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _public(module: str, name: str) -> bool:
    return name in PUBLIC.get(module, set())


def offences(source: str, filename: str = "<src>") -> list[str]:
    """The rule's violations in one file's source, as ``line: what``."""
    tree = _with_parents(ast.parse(source, filename))
    out: list[str] = []
    ds_names: set[str] = set()  # local names bound to DeepSpeed modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "deepspeed" or a.name.startswith("deepspeed."):
                    if a.name != "deepspeed" or a.asname:
                        out.append(f"{node.lineno}: import {a.name}")
                    ds_names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            for a in node.names:
                ds_names.add(a.asname or a.name)
                if not _public(node.module, a.name):
                    out.append(f"{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if (
                dotted
                and dotted.split(".")[0] == "deepspeed"
                and "deepspeed" in ds_names
                and not isinstance(getattr(node, "parent", None), ast.Attribute)
            ):
                rest = dotted.split(".", 1)[1] if "." in dotted else ""
                if not any(rest == p or rest.startswith(p + ".") for p in PUBLIC["deepspeed"]):
                    out.append(f"{node.lineno}: {dotted}")
            tokens = _tokens(node.value)
            if _internal(node.attr):
                out.append(f"{node.lineno}: .{node.attr}")
            elif _private(node.attr) and tokens and (_DS_RECEIVER.search(tokens[-1]) or tokens[0] in ds_names):
                out.append(f"{node.lineno}: {ast.unparse(node)}")
            elif node.attr == "optimizer" and tokens and re.search(r"optim|wrapper|^opt$", tokens[-1]):
                out.append(f"{node.lineno}: {ast.unparse(node)} (the optimizer inside a DeepSpeed wrapper)")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _FILE_LAYOUT.search(node.value)
            and not isinstance(getattr(node, "parent", None), ast.Expr)
        ):  # docstrings may describe it
            out.append(f"{node.lineno}: {node.value!r} (DeepSpeed's checkpoint file names)")
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            out += [
                f"{node.lineno}: {kw.arg}= (a ZeRO optimizer's load_state_dict)"
                for kw in node.keywords
                if kw.arg in INTERNAL_KEYWORDS
            ]
            fn = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            arg = (
                node.args[1]
                if fn in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
                else node.args[0]
                if fn in ("import_module", "__import__") and node.args
                else None
            )
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if fn in ("import_module", "__import__") and arg.value.split(".")[0] == "deepspeed":
                    out.append(f"{node.lineno}: {fn}({arg.value!r})")
                elif _internal(arg.value):
                    out.append(f"{node.lineno}: {fn}(..., {arg.value!r})")
    return out


def _with_parents(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]
    return tree


def _sources() -> list[Path]:
    files = sorted(f for d in SCANNED for f in (ROOT / d).rglob("*.py"))
    assert len(files) > 50, "the scan found too few files"
    return [f for f in files if ADAPTER not in f.parents]


def test_only_the_adapter_touches_deepspeed_internals():
    assert (ADAPTER / "__init__.py").is_file()
    found = []
    for f in _sources():
        found += [f"{f.relative_to(ROOT)}:{o}" for o in offences(f.read_text())]
    assert not found, "DeepSpeed internals outside pretrain/ds_adapter/:\n" + "\n".join(found)


def test_the_rule_catches_each_kind_of_access():
    bad = {
        "self.engine._config.load_universal_checkpoint = True": 2,
        "opt._hp_optimizer_states_linked = False": 1,
        "x = opt.averaged_gradients[0]": 1,
        "ok = hasattr(weight, 'ds_id')": 1,
        "shape = p.ds_shape": 1,
        "from deepspeed.utils import groups": 1,
        "from deepspeed.runtime.zero.config import ZeroStageEnum": 1,
        "import deepspeed.runtime.engine": 1,
        "import deepspeed\nx = deepspeed.runtime.zero.config": 1,
        "import importlib\nimportlib.import_module('deepspeed.utils.tensor_fragment')": 1,
        "from deepspeed.utils import groups as g\ng._get_expert_parallel_rank('ep')": 2,
        "engine.checkpoint_engine = None": 1,
        "inner = engine.optimizer.optimizer": 1,
        "opt.load_state_dict([s] * 2, load_optimizer_states=True, load_from_fp32_weights=True)": 1,
        "files = sorted(d.glob('mp_rank_*_model_states.pt'))": 1,
    }
    for src, n in bad.items():
        assert len(offences(src)) == n, (src, offences(src))
    good = (
        "import deepspeed\ndeepspeed.initialize(model=m)\nwith deepspeed.zero.GatheredParameters(ps): pass",
        "from deepspeed.utils import safe_get_full_fp32_param",
        "lr = engine.optimizer.param_groups[0]['lr']",
        "y = self._hooks\nsd = self.deepspeed_moe.experts.deepspeed_experts",
        "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint",
    )
    for src in good:
        assert offences(src) == [], (src, offences(src))


def test_model_code_reads_no_deepspeed_attribute():
    """Nothing in ``pretrain/model`` names a DeepSpeed attribute, even the public ones; partition-dependent choices
    (e.g. whether the MoE experts can run as one grouped GEMM) are set from ``pretrain.train``."""
    public = {n.split(".")[-1] for names in PUBLIC.values() for n in names}
    found = []
    for f in sorted((ROOT / "pretrain" / "model").glob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            names = (
                [node.attr]
                if isinstance(node, ast.Attribute)
                else [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if isinstance(node, ast.Call)
                else []
            )
            found += [
                f"{f.name}:{node.lineno} {n}" for n in names if _internal(n) or n in public or n.startswith("ds_")
            ]
    assert not found, found
