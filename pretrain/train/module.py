"""The TrainModule: model, DeepSpeed engine (optimizer, ZeRO partitions, expert groups) and LR schedule of one
run, built by :func:`build_module` — the one copy of the recipe "build model -> load weights -> parallelize
(``pretrain/parallel``) -> parameter groups -> ``deepspeed.initialize``" that training (and its validation), growth's
rebuilds, the benchmarks and the tests use. Export and offline evaluation, which need no optimizer, load a
checkpoint's full weights into :func:`pretrain.model.build_model` (``weights=``), the model construction used here.

It can hand out the full model state dict (gathered from any ZeRO stage and expert layout, on every rank), and
rebuild itself inside a running job on a new model config plus given weights (and, for an unchanged shape,
the optimizer state), re-initializing DeepSpeed without restarting the process or Ray — what growth needs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as tdist

from pretrain import ds_adapter
from pretrain.checkpoint.layout import DS_TAG
from pretrain.checkpoint.snapshot import FileJob, HostCopy, save_hashed
from pretrain.checkpoint.store import BadCheckpoint
from pretrain.checkpoint.writer import EngineState, FullWeights
from pretrain.config import ConfigError, RunConfig, RunPlan, make_plan
from pretrain.model import Transformer, build_model, param_groups
from pretrain.model.compile import compile_blocks, compile_supported
from pretrain.model.layerdrop import inference_scales
from pretrain.model.moe import moe_layers
from pretrain.parallel.apply import full_state, local_state, parallelize
from pretrain.train.engine import initialize, resolve_precision, set_lr
from pretrain.train.schedule import lr_at

StateDict = dict[str, torch.Tensor]


class TrainModule:
    """What one worker trains. ``engine`` is the DeepSpeed engine; ``model`` the module inside it."""

    def __init__(self, cfg: RunConfig, plan: RunPlan, engine: Any, *, rank: int, device: torch.device, precision: str):
        self.cfg, self.plan, self.engine = cfg, plan, engine
        self.rank, self.device, self.precision = rank, device, precision
        self._readers: list[Callable[[], None]] = []

    # -- background readers of the live state -------------------------------------------------------------

    def hold(self, wait: Callable[[], None]) -> None:
        """Register a background reader of the live engine state: ``wait()`` returns once it no longer reads
        it (an asynchronous checkpoint copying its snapshot to host memory while the next forward and backward
        run, which change none of it). Whatever changes the state calls :meth:`settle` first: the optimizer
        update (:func:`~pretrain.train.step.run_step`), loading and rebuilding."""
        self._readers.append(wait)

    def settle(self) -> None:
        """Wait for every background reader of the live state (:meth:`hold`)."""
        readers, self._readers = self._readers, []
        for wait in readers:
            wait()

    @property
    def model(self) -> Transformer:
        return self.engine.module

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    # -- the schedule ---------------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        """Scheduled LR of optimizer step ``step`` (0-based)."""
        return lr_at(step, self.cfg.train)

    def set_lr(self, lr: float) -> None:
        set_lr(self.engine, lr)

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    # -- state ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> StateDict:
        """The whole model's weights on every rank (CPU tensors, experts under global ids). Collective: every
        rank must call it. ZeRO-3 partitions are gathered; under bf16 the fp32 master weights are returned."""
        model = self.model
        params = list(model.parameters())
        if params and ds_adapter.is_partitioned(params[0]):  # ZeRO-3: gather the partitions
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        else:
            state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if self.precision != "fp32":  # the module holds bf16 copies: take the fp32 masters
            from deepspeed.utils import safe_get_full_fp32_param

            names = {id(p): n for n, p in model.named_parameters()}
            unfused = ds_adapter.unfused_fp32_masters(self.engine)
            for p in params:
                full = safe_get_full_fp32_param(p) if id(p) not in unfused else unfused[id(p)]
                if full is not None:
                    state[names[id(p)]] = full.detach().cpu().clone()
            if self.cfg.model.tie_embeddings and "lm_head.weight" in state:
                state["lm_head.weight"] = state["embed_tokens.weight"]
        return full_state(model, state)

    def checkpoint_state(self) -> EngineState | FullWeights:
        """What a checkpoint of this module holds: the DeepSpeed engine state (``save``/``snapshot``), or under tensor
        parallelism the whole weights and AdamW moments (AutoTP shards gathered; collective), which resume on any
        layout and export as they are."""
        if self.plan.dims.tensor == 1:
            return EngineState(cast(Any, self.save), self.snapshot)
        from pretrain.train.optimizer_state import gather_moments

        return FullWeights(self.full_state_dict(), gather_moments(self))

    def optimizer_state(self) -> dict:
        """This rank's optimizer state (its ZeRO partition): valid for a module of the same shapes and layout."""
        return self.engine.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        """Restore :meth:`optimizer_state` of a module with the same shapes and layout (this rank's part)."""
        self.settle()
        opt = self.engine.optimizer
        if self.zero_stage == 0:  # whole state: a torch optimizer, or (bf16) DeepSpeed's unfused wrapper of one
            opt.load_state_dict(state)
            return
        world = tdist.get_world_size() if tdist.is_initialized() else 1
        ds_adapter.load_partitioned_optimizer_state(opt, state, world)

    def live_state(self) -> tuple[dict, dict | None]:
        """The engine's module and optimizer state dicts as they are (live tensors, nothing copied): what an
        asynchronous snapshot will copy, for sizing its host memory."""
        opt = self.engine.optimizer
        return self.engine.module_state_dict(), (opt.state_dict() if opt is not None else None)

    def save(
        self, directory: Path, on_file: Callable[[Path, dict[Path, str] | None], None] | None = None
    ) -> list[Path]:
        """Write the engine state (weights, optimizer partitions, experts) as a DeepSpeed checkpoint (collective).
        Returns the files this rank wrote (for it to hash them itself): every file DeepSpeed's checkpoint engine
        saved on this rank, and on rank 0 the recovery scripts DeepSpeed copies next to the tag directory.
        ``on_file(path, hashed)`` is called as each engine file is written, with its sha256 (``{path: hex}``)
        when it was hashed as it was written (DeepSpeed's own checkpoint engine), else None. The engine files
        are written two at a time, as ``save_checkpoint`` hands them over (the state it hands over stays as it
        is until the next step, unless an optimizer's checkpoint epilogue swaps it out: then one at a time,
        within ``save_checkpoint``): a rank writing several files (rank 0: the model states besides its
        optimizer partition) is not the one all others wait for."""
        into_file, direct = ds_adapter.saves_into_files(self.engine), self.cfg.checkpoint.direct_io
        deferred = ds_adapter.checkpoint_state_stays_live(self.engine)
        written: list[Path] = []
        pending: list[Future] = []

        def write(state: Any, path: Path, save: ds_adapter.Save) -> None:
            hashed = _save_without_crc(save, state, path, into_file, direct)
            if on_file is not None:
                on_file(path, hashed)

        with ThreadPoolExecutor(2, thread_name_prefix="ckpt-write") as pool:

            def route(state: Any, path: Path, save: ds_adapter.Save) -> None:
                written.append(path)
                if deferred:
                    pending.append(pool.submit(write, state, path, save))
                else:
                    write(state, path, save)

            with ds_adapter.routing_checkpoint_files(self.engine, route):
                self.engine.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False)
            for done in pending:
                done.result()
        if self.engine.global_rank == 0:  # only rank 0 writes at the top of the DeepSpeed directory
            written += [p for p in Path(directory).iterdir() if p.is_file()]
        return written

    def snapshot(self, directory: Path, host_copy: HostCopy) -> tuple[list[Path], list[FileJob]]:
        """:meth:`save` with the files held in host memory (``host_copy``) instead of written (collective): the
        files already written (rank 0's recovery scripts) and one job per engine file, to run later (in the
        background) while training continues. The same files as :meth:`save`, byte for byte; each job returns
        its file's sha256 when it hashed it as it wrote it."""
        into_file, direct = ds_adapter.saves_into_files(self.engine), self.cfg.checkpoint.direct_io
        captured: list[tuple[Path, Any, ds_adapter.Save]] = []
        with ds_adapter.routing_checkpoint_files(
            self.engine, lambda state, path, save: captured.append((path, host_copy(state), save))
        ):
            self.engine.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False)
        written = [p for p in Path(directory).iterdir() if p.is_file()] if self.engine.global_rank == 0 else []
        jobs = [
            FileJob(
                [path], functools.partial(_save_without_crc, save, state, path, into_file, direct), hashes=into_file
            )
            for path, state, save in captured
        ]
        return written, jobs

    def load(self, directory: Path, universal: bool = False) -> None:
        """Load :meth:`save`'s output, or its DeepSpeed universal form (another worker count) when ``universal``."""
        self.settle()
        ds_adapter.set_universal_load(self.engine, universal)
        with ds_adapter.weights_only_loads():  # the optimizers' own loads of the universal form too
            load_path, _ = self.engine.load_checkpoint(str(directory), tag=DS_TAG, load_module_strict=True)
        if load_path is None:
            raise BadCheckpoint(f"{directory}: DeepSpeed could not load the engine state")

    # -- rebuilding -----------------------------------------------------------------------------------

    def rebuild(
        self, cfg: RunConfig | None = None, weights: StateDict | None = None, optimizer_state: dict | None = None
    ) -> None:
        """Replace model and engine in place: a new model of ``cfg`` (default: the current config) holding
        ``weights`` (a full state dict, e.g. a transformed :meth:`full_state_dict`; default: the current
        weights) and a fresh DeepSpeed engine; ``optimizer_state`` (:meth:`optimizer_state` of a module with
        the same shapes) restores the optimizer too, otherwise it starts empty. Collective."""
        self.settle()
        cfg = cfg or self.cfg
        if weights is None:
            weights = self.full_state_dict()
        world = tdist.get_world_size() if tdist.is_initialized() else 1
        self.engine.destroy()
        self.engine = None
        new = build_module(cfg, make_plan(cfg, world), rank=self.rank, device=self.device, weights=weights)
        if optimizer_state is not None:
            new.load_optimizer_state(optimizer_state)
        self.cfg, self.plan, self.engine, self.precision = new.cfg, new.plan, new.engine, new.precision


def compile_wanted(setting: str, device: torch.device, zero_stage: int = 0) -> bool:
    """``train.compile`` resolved for ``device``: ``auto`` compiles on CUDA only, and not under ZeRO-3 (whose
    parameter hooks run inside the blocks; ``yes`` is refused there at config load); ``yes`` where inductor cannot
    run is refused with the reason."""
    if setting == "no" or (setting == "auto" and (device.type != "cuda" or zero_stage == 3)):
        return False
    ok, why = compile_supported(device)
    if not ok and setting == "yes":
        raise ConfigError(f"train.compile: {why}")
    return ok


def build_module(
    cfg: RunConfig,
    plan: RunPlan | None = None,
    *,
    rank: int | None = None,
    device: torch.device | None = None,
    weights: StateDict | None = None,
    load_universal: bool = False,
) -> TrainModule:
    """The module of ``cfg`` on this worker: the seeded model (or ``weights``, a full state dict with every
    expert), its parallel layout ``plan.dims`` applied (``pretrain.parallel.apply.parallelize``), wrapped in
    DeepSpeed. torch.distributed must be initialized; ``plan`` defaults to the plan for the current world size,
    ``rank`` to this process's rank, ``device`` to CPU.
    ``load_universal``: the engine will load a universal checkpoint (resume on another worker count)."""
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    plan = plan or make_plan(cfg, world)
    rank = tdist.get_rank() if rank is None and tdist.is_initialized() else (rank or 0)
    device = device or torch.device("cpu")
    precision = resolve_precision(cfg.train.precision, device)
    if weights is not None:  # copied (the engine updates its parameters in place), in fp32 like a seeded model
        weights = {
            k: v.detach().to(torch.float32 if v.is_floating_point() else v.dtype, copy=True) for k, v in weights.items()
        }
    model = build_model(cfg.model, cfg.train.seed, cfg.moe, weights=weights)
    model.activation_checkpointing = cast(str, cfg.train.activation_checkpointing)  # str after __post_init__
    model.branch_scales = inference_scales(cfg.layer_drop, cfg.model.num_layers)
    parallelize(model, plan.dims, rank)  # pretrain/parallel: experts, sequence shards (AutoTP: in the engine)
    model.to(device)
    if not plan.dims.enabled and compile_wanted(cfg.train.compile, device, cfg.zero.stage):
        compile_blocks(model)
    # DeepSpeed casts the module to bf16 before it copies the fp32 master weights: given weights would lose their
    # low bits, so their fp32 values are set into the masters afterwards.
    masters = (
        {n: p.detach().clone() for n, p in model.named_parameters()}
        if weights is not None and precision != "fp32"
        else None
    )
    # MoE selection biases stay fp32 (DeepSpeed's bf16 cast would lose the small per-step updates)
    biases = [
        (layer, layer.selection_bias.clone()) for _, layer in moe_layers(model) if layer.selection_bias is not None
    ]
    engine = initialize(
        model,
        param_groups(model, cfg.train.weight_decay),
        cfg,
        plan,
        precision,
        load_universal=load_universal,
        device=device,
    )
    for layer, bias in biases:
        layer.deepspeed_moe.gate.selection_bias = bias
    if masters is not None:
        from deepspeed.utils import safe_set_full_fp32_param

        unfused = ds_adapter.unfused_fp32_masters(engine)
        masters = local_state(engine.module, masters)  # tensor parallelism: this rank's shards
        with torch.no_grad():
            for n, p in engine.module.named_parameters():
                if id(p) in unfused:
                    unfused[id(p)].copy_(masters[n])
                else:
                    safe_set_full_fp32_param(p, masters[n])
    # ZeRO-3 gathers a partitioned weight only when its own module runs: such experts run module by module.
    for _, layer in moe_layers(engine.module):
        layer.grouped_experts = not any(ds_adapter.is_partitioned(p) for p in layer.experts.parameters())
    return TrainModule(cfg, plan, engine, rank=rank, device=device, precision=precision)


def _save_without_crc(
    save: ds_adapter.Save, state: Any, path: Path, into_file: bool, direct: bool
) -> dict[Path, str] | None:
    """:func:`save_hashed` of one engine file, without the zip CRC (a per-thread setting: set in the writing
    thread)."""
    with ds_adapter.without_zip_crc():
        return save_hashed(save, state, path, into_file, direct)
