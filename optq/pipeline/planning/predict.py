"""A plan before the work: ``optq quantize --dry-run``, computed without loading a weight.

``plan(source, config, settings)`` (the run's own ``QuantConfig`` and ``RunSettings``) reads the
model's ``config.json`` and, for a folder, its safetensors headers (exact bytes); builds the
model on the meta device; lists the decoder blocks and their linears; and predicts what
:func:`optq.pipeline.stream.quantize.quantize_pretrained` will need, as named terms:

peak RAM = max(capture, blocks phase, assembly), where (T = nsamples x seqlen calibration
tokens, b = min(batch_size, nsamples) x seqlen tokens per forward, h hidden, i intermediate, c
the compute dtype's bytes, K the input width and R the stacked rows of a group of linears
sharing an input; a group here is the linears of one parent module with one input width, never
smaller than the group the pipeline discovers, so the solve terms are upper bounds)

  capture        runtime (RUNTIME_BYTES, measured: python, torch, transformers, the skeleton)
               + embeddings: every tensor outside the blocks and the untied head, in c
                 (released once the first block's inputs are captured)
               + one block + activations + batch temporaries (as below)
  blocks phase   runtime
               + one block                the largest block's parameters in c
               + activations              T x h x c  (each batch's inputs replaced by its outputs)
               + recorded outputs         T x h x c  strategy "replay" (the attention's, replayed)
               + original outputs         T x h x c  propagate "original"
               + float chain and twin     2 T x h x c + one block, method "gptaq" (one more forward per block)
               + paused forwards          T x (i + 2h) x c  strategy "pause"
               + batch temporaries        b x (3i + 3h) x 4
               + hessians + solve workspace   at the group with the largest sum:
                                          hessians K^2 x e (x 2 with normalize_tokens: the
                                          solver's and the plain one; e = 4, or 8 for
                                          hessian_dtype float64; an expert stage holds all its
                                          experts' within max_hessian_memory), and the solve
                                          workspace (5 R K + 4 K^2) x 4 (measured on this machine
                                          for optq.gptq: the factor, its inverse and the working
                                          copies of the stacked rows)
  assembly       runtime + twice the largest output tensor (written one tensor at a time:
                 each is read from its mapped file and copied out)
disk = the output (packed tensors: qweight bits/8 per weight, scales float16 and qzeros per
group, g_idx int32 per input, bias float16; every other tensor as stored; headers, index,
config and copied files) + the journal (the packed blocks, and two activation files of
T x h x c while one is replaced), which is still there when the output shards are assembled.

A run from the weights alone (round-to-nearest without ``target_bits``, ``Run.weights_only``)
captures nothing and runs no block: no capture phase, no activations, Hessians or forwards.

The time is an estimate, rough by design (+-50%): forward FLOPs at this machine's measured
matmul rate, Hessian accumulation at 2 T K^2 per group, and solves scaled from one timed
``optq.gptq`` on a 1024 x 1024 weight by K^3 + R K^2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.formats.expert_slices import fused_slices
from optq.formats.experts import checkpoint_namer, layer_namer, unfuse_experts
from optq.formats.files import split_shards, tensor_nbytes
from optq.formats.layout import Scheme, packed_layout, quantization_config
from optq.formats.linears import find_linears, get_weight
from optq.pipeline.blocks.calibration import DEFAULT_NSAMPLES, DEFAULT_SEQLEN
from optq.pipeline.blocks.moe.stages import hessian_bytes
from optq.pipeline.discovery import drop_routers, expert_parts, find_blocks, select_names, siblings
from optq.pipeline.planning.runplan import RUNTIME_BYTES, RunPlan, machine_speed
from optq.pipeline.planning.sizes import header_bytes, json_len, small_files
from optq.pipeline.schemes import LayerSchemes, resolve
from optq.pipeline.settings import RunSettings, dtype_name

__all__ = ["plan"]


def plan(
    source: Any,
    config: QuantConfig,
    settings: RunSettings | None = None,
    *,
    source_dtype: torch.dtype | None = None,
    speed: dict[str, float] | None = None,
    **options: Any,
) -> RunPlan:
    """The plan of quantizing ``source`` (a model folder, built-in name, config dict or
    transformers config) with ``config`` and ``settings`` (the run's own ``RunSettings``, with
    ``options`` replacing its fields as in ``optq.quantize``): reads no tensor data.
    ``source_dtype`` is needed only for a config (default: its ``torch_dtype``/``dtype``, else
    bfloat16); ``speed`` as returned by :func:`machine_speed` (measured when None)."""
    s = RunSettings.of(settings, **options)
    model, cfg, src = _skeleton(source)
    unfuse_experts(model)  # as the run does: one linear per expert matrix
    blocks_name, blocks = find_blocks(model)
    tensors = _persistent(model)
    if src is not None:
        source_dtype = src.dtype
        # A fused GPT-OSS source counts as its per-expert slices, as the run reads and writes it.
        src.use_slices(fused_slices(model, src.index, checkpoint_namer(model)))
        stored = src.entries()
    else:
        name = cfg.get("torch_dtype") or cfg.get("dtype")
        source_dtype = source_dtype or (getattr(torch, name) if isinstance(name, str) else torch.bfloat16)
        stored = {k: (tuple(t.shape), source_dtype if t.is_floating_point() else t.dtype) for k, t in tensors.items()}
    compute_dtype = s.compute(s.torch_device(torch.device("cpu")), source_dtype)
    c = compute_dtype.itemsize
    h = int(cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model"))
    inter = int(cfg.get("intermediate_size") or cfg.get("ffn_dim") or cfg.get("n_inner") or 4 * h)
    nsamples, seqlen = s.nsamples or DEFAULT_NSAMPLES, s.seqlen or DEFAULT_SEQLEN
    T, b = nsamples * seqlen, min(s.batch_size, nsamples) * seqlen
    names = {f"{blocks_name}.{i}": find_linears(blk, f"{blocks_name}.{i}") for i, blk in enumerate(blocks)}
    all_names = [n for lin in names.values() for n in lin]
    targets, _ = drop_routers(all_names, set(select_names(all_names, s.include, s.exclude)), s.include)
    every = {n: m for lin in names.values() for n, m in lin.items()}
    schemes = resolve(
        every, sorted(targets), config, s.overrides, serve=s.serve, strict_groups=s.strict_groups, fmt=s.format
    )
    tally = _Tally(
        schemes,
        s,
        T,
        int(cfg.get("num_experts_per_tok") or cfg.get("moe_topk") or 1),
        targets,
        layer_namer(checkpoint_namer(model)),
        source_dtype,
    )
    for i, blk in enumerate(blocks):
        tally.block(f"{blocks_name}.{i}", blk, names[f"{blocks_name}.{i}"])
    attn_flops = 4 * T * seqlen * h * len(blocks)
    gptaq = s.method_object.float_chain  # a float copy of each block runs on the float chain too
    # As Run.weights_only (in one process): round-to-nearest without target_bits reads no
    # calibration at all, so nothing is captured, no block runs and no Hessian is held.
    weights_only = not s.reads_calibration
    replay = s.strategy == "replay" or gptaq  # GPTAQ pairs every batch with the float block's: it never pauses
    # The float copy's weights never change: it replays its finished children and runs to the
    # block's end on the last pass, one forward per block (optq.pipeline.blocks.twin).
    passes = 0 if weights_only else (2 if replay else 1) + (1 if s.propagate == "original" else 0) + gptaq

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    emb_ids = {id(p) for p in model.get_input_embeddings().parameters()}
    block_ids = {id(t) for t in [*blocks.parameters(), *blocks.buffers()]}
    outside = sum(
        t.numel() * (c if t.is_floating_point() else t.element_size())
        for t in tensors.values()
        if id(t) not in block_ids and (id(t) not in head_ids or id(t) in emb_ids)
    )
    act, one_block, temps = T * h * c, max(tally.block_params) * c, b * (3 * inter + 3 * h) * 4
    if weights_only:
        act = temps = 0
    capture = (
        {}
        if weights_only
        else {
            "runtime": RUNTIME_BYTES,
            "embeddings (+ norm)": outside,
            "one block": one_block,
            "activations": act,
            "batch temporaries": temps,
        }
    )
    ram = {
        "runtime": RUNTIME_BYTES,
        "one block": one_block,
        "activations": act,
        "recorded outputs (replay)": act if replay else 0,
        "original outputs": act if s.propagate == "original" else 0,
        "float chain, its recorded outputs and block (gptaq)": 2 * act + one_block if gptaq else 0,
        "paused forwards": T * (inter + 2 * h) * c if not (replay or weights_only) else 0,
        "batch temporaries": temps,
        "hessians": 0 if weights_only else tally.peak[0],
        "solve workspace": tally.peak[1],  # rounding alone needs less: an upper bound
    }
    ram = {k: int(v) for k, v in ram.items() if v or k in ("activations", "hessians", "solve workspace")}

    replaced = {k.rsplit(".", 1)[0] for k in tally.packed}
    entries = {k: v for k, v in stored.items() if k.rsplit(".", 1)[0] not in replaced} | tally.packed
    sizes = {k: tensor_nbytes(*v) for k, v in entries.items()}
    shards = split_shards({k: sizes[k] for k in sorted(entries)}, s.shard_bytes)
    headers = sum(header_bytes({k: entries[k] for k in shard}) for shard in shards)
    tensor_bytes = sum(sizes.values())
    small = small_files(cfg, quantization_config(Scheme.of_config(config), s.format), len(blocks), targets, src)
    if len(shards) > 1:
        weight_map = {k: f"model-00001-of-{len(shards):05d}.safetensors" for k in entries}
        small += json_len({"metadata": {"total_size": tensor_bytes}, "weight_map": weight_map})
    block_files = sum(tensor_nbytes(*v) for v in tally.packed.values()) + sum(
        header_bytes({k: v for k, v in tally.packed.items() if k.startswith(f"{blocks_name}.{i}.")})
        for i in range(len(blocks))
    )
    disk = {
        "output tensors": tensor_bytes,
        "output headers, config, report, copied files": headers + small,
        "journal: packed blocks": block_files,
        "journal: activations (2 files while replaced)": 2 * act * (1 + gptaq),
    }
    assembly = {"runtime": RUNTIME_BYTES, "largest output tensor (mapped + copied)": 2 * max(sizes.values(), default=0)}

    sp = speed or machine_speed()
    seconds = {
        "forwards": passes * (tally.flops + attn_flops) / sp["flops"],
        "hessians": 0.0 if weights_only else tally.hess_flops * (1 + gptaq) / sp["flops"],
        "solves": tally.solve_units * sp["solve_unit"],
        "assembly": (tensor_bytes + headers) / 0.5e9,
    }
    notes = []
    if weights_only:
        notes.append(
            f"method {s.method} reads no calibration: each weight is rounded alone, nothing is captured or run"
        )
    if gptaq and s.strategy == "pause":
        notes.append("strategy pause: GPTAQ pairs every batch with the float block's, so every block is replayed")
    three_d = [n for n, p in blocks[-1].named_parameters() if p.dim() >= 3]
    if three_d:
        notes.append(
            f"{len(three_d)} fused 3-D parameter(s) per block ({', '.join(three_d[:3])}) have a layout optq "
            "does not unfuse: they are kept as stored, in float, and reported (as the pipeline does)"
        )
    shown = {
        "nsamples": nsamples,
        "seqlen": seqlen,
        "batch_size": s.batch_size,
        "method": s.method,
        "bits": config.bits,
        "group_size": config.group_size,
        "strategy": s.strategy,
        "propagate": s.propagate,
        "format": s.format,
        "compute_dtype": dtype_name(compute_dtype),
        "max_shard_size": str(s.max_shard_size),
        "source_dtype": dtype_name(source_dtype),
        "hessian_dtype": s.hessian_dtype,
        "hidden": h,
        "intermediate": inter,
        "tokens": T,
        "speed": sp,
    }
    return RunPlan(
        model=str(getattr(src, "folder", cfg.get("model_type"))),
        blocks_name=blocks_name,
        blocks=tally.listing,
        settings=shown,
        capture=capture,
        ram=ram,
        assembly=assembly,
        disk=disk,
        seconds=seconds,
        notes=notes,
    )


@dataclass
class _Tally:
    """The per-block terms of a plan: the listing, packed tensors, FLOPs and the solve peak."""

    schemes: LayerSchemes
    settings: RunSettings
    tokens: int
    top_k: int
    targets: set[str]
    layer_name: Any
    source_dtype: torch.dtype
    listing: list[dict[str, Any]] = field(default_factory=list)
    packed: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    block_params: list[int] = field(default_factory=list)
    flops: float = 0.0
    hess_flops: float = 0.0
    solve_units: float = 0.0
    peak: tuple[int, int] = (0, 0)  # (Hessians, solve workspace) at the largest sum

    def _keep_peak(self, hessians: int, workspace: int) -> None:
        if hessians + workspace > sum(self.peak):
            self.peak = (hessians, workspace)

    def block(self, bname: str, blk: nn.Module, lin: dict[str, nn.Module]) -> None:
        T, s = self.tokens, self.settings
        groups = _groups(lin)
        group_of = {n: g for g, members in groups.items() for n in members}
        rows = []
        for n, mod in lin.items():
            N, K = get_weight(mod).shape
            rows.append(
                {
                    "name": n,
                    "in": int(K),
                    "out": int(N),
                    "group": group_of[n].split("@")[0].rpartition(".")[2],
                    "quantized": n in self.targets,
                }
            )
            if n in self.targets:
                layout = packed_layout(
                    s.format,
                    (int(N), int(K)),
                    bias=getattr(mod, "bias", None) is not None,
                    scheme=Scheme.of_config(self.schemes.of(n)),
                    float_dtype=self.source_dtype,
                )
                self.packed.update({f"{self.layer_name(n)}.{k}": v for k, v in layout.items()})
            self.flops += 2 * (T * self.top_k // len(siblings(lin, n)) if expert_parts(n) else T) * N * K
        stage_hessians: dict[str, int] = {}
        stage_solve: dict[str, int] = {}
        for members in groups.values():
            mine = [n for n in members if n in self.targets]
            if not mine:
                continue
            K = get_weight(lin[mine[0]]).shape[1]
            R = sum(get_weight(lin[n]).shape[0] for n in mine)
            # Measured on this machine for optq.gptq: the factor, its inverse and the working
            # copies of the stacked rows, in float32.
            solve = (5 * R * K + 4 * K * K) * 4
            held = hessian_bytes(K, self.schemes.base.normalize_tokens, s.hessian_itemsize, s.method_object.float_chain)
            parts = expert_parts(mine[0])
            if parts is not None:
                # An expert stage holds all its experts' Hessians while they are solved, up to
                # the budget; each expert sees its share of the routed tokens, or all with "all".
                key = f"{parts[0]}@{parts[2]}"
                stage_hessians[key] = stage_hessians.get(key, 0) + held
                stage_solve[key] = max(stage_solve.get(key, 0), solve)
                routed = T * self.top_k // len(siblings(lin, mine[0]))
                self.hess_flops += 2 * (T if s.moe_calibration == "all" else routed) * K * K
            else:
                self._keep_peak(held, solve)
                self.hess_flops += 2 * T * K * K
            self.solve_units += s.method_object.solve_cost(K, R)
        for key, held in stage_hessians.items():
            self._keep_peak(min(held, s.hessian_budget), stage_solve[key])
        params = sum(p.numel() for p in blk.parameters())
        self.block_params.append(params)
        self.listing.append({"name": bname, "params": int(params), "linears": rows})


def _skeleton(source: Any) -> tuple[nn.Module, dict[str, Any], Any]:
    """(meta model, config dict, SafetensorsSource or None) of a folder, name, config dict or config.

    Built under ``torch.device("meta")``: nothing is allocated, not even the fused 3-D expert
    tensors of MoE models (which accelerate's ``init_empty_weights`` creates for real first).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    from optq.pipeline.stream.source import SafetensorsSource

    src = None
    if isinstance(source, (str, Path)):
        folder = Path(source)
        if not folder.is_dir():
            from optq.data.zoo import resolve_model

            where = resolve_model(source)
            if not isinstance(where, Path):
                raise ValueError(f"{source!r} is not a local model folder or built-in name; give its folder")
            folder = where
        src = SafetensorsSource(folder)
        cfg = src.hf_config()
    else:
        cfg = source if isinstance(source, PretrainedConfig) else AutoConfig.for_model(**dict(source))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.tie_weights()
    return model.eval(), (src.config_dict if src is not None else cfg.to_dict()), src


def _persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> meta tensor of every persistent tensor, tied ones once."""
    seen: set[int] = set()
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        owner, _, leaf = name.rpartition(".")
        sub = model.get_submodule(owner) if owner else model
        if leaf in sub._non_persistent_buffers_set or id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def _groups(linears: dict[str, nn.Module]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name, mod in linears.items():
        K = get_weight(mod).shape[1]
        groups.setdefault(f"{name.rpartition('.')[0]}@{K}", []).append(name)
    return groups
