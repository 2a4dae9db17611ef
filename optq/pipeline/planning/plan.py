"""A plan before the work: ``optq quantize --dry-run``, computed without loading a weight.

``plan(source, nsamples=..., seqlen=..., config=...)`` reads the model's ``config.json`` and, for
a folder, its safetensors headers (exact bytes); builds the model on the meta device; lists the
decoder blocks and their linears; and predicts what :func:`optq.pipeline.stream.quantize.quantize_pretrained`
will need, as named terms:

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
               + paused forwards          T x (i + 2h) x c  strategy "pause"
               + batch temporaries        b x (3i + 3h) x 4
               + hessian + solve          max over groups of K^2 x 4 + (5 R K + 4 K^2) x 4
                                          (measured on this machine for optq.gptq: the factor,
                                          its inverse and the working copies of the stacked rows)
  assembly       runtime + twice the largest output tensor (written one tensor at a time:
                 each is read from its mapped file and copied out)
disk = the output (packed tensors: qweight bits/8 per weight, scales float16 and qzeros per
group, g_idx int32 per input, bias float16; every other tensor as stored; headers, index,
config and copied files) + the journal (the packed blocks, and two activation files of
T x h x c while one is replaced), which is still there when the output shards are assembled.

The time is an estimate, rough by design (+-50%): forward FLOPs at this machine's measured
matmul rate, Hessian accumulation at 2 T K^2 per group, and solves scaled from one timed
``optq.gptq`` on a 1024 x 1024 weight by K^3 + R K^2.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.formats.checkpoint import layer_namer
from optq.formats.experts import checkpoint_namer, unfuse_experts
from optq.formats.files import SAFETENSORS_DTYPES, parse_size, safetensors_header, split_shards
from optq.formats.linears import find_linears, get_weight
from optq.formats.packing import packed_length
from optq.pipeline.blocks.discovery import drop_routers, find_blocks, select_names
from optq.pipeline.moe.stages import default_hessian_budget, expert_parts, hessian_bytes, siblings

__all__ = ["RUNTIME_BYTES", "Plan", "machine_speed", "plan"]

GB = 1e9
# RSS after importing torch, transformers, safetensors, optq and building a skeleton (0.40-0.45 GB measured).
RUNTIME_BYTES = int(0.45 * GB)
_INT32, _FP16 = 4, 2
# quantization_report.json: a layer's row (plus its name twice), a block's seconds, the rest.
_REPORT_BYTES_PER_LAYER, _REPORT_BYTES_PER_BLOCK, _REPORT_BYTES = 495, 26, 2900


@dataclass
class Plan:
    """What a run will need; byte values are bytes, ``seconds`` a rough estimate."""

    model: str
    blocks_name: str
    blocks: list[dict[str, Any]]  # per block: name, params, linears [{name, in, out, group, quantized}]
    settings: dict[str, Any]
    capture: dict[str, int]  # the capture's terms (the embeddings are released after it)
    ram: dict[str, int]  # the blocks phase's terms
    assembly: dict[str, int]  # the assembly phase's terms
    disk: dict[str, int]
    seconds: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def peak_ram(self) -> int:
        return max(sum(self.capture.values()), sum(self.ram.values()), sum(self.assembly.values()))

    @property
    def output_bytes(self) -> int:
        """The finished checkpoint folder's size."""
        return sum(v for k, v in self.disk.items() if k.startswith("output"))

    @property
    def journal_bytes(self) -> tuple[int, int]:
        """(packed blocks, activation files) of the journal at its largest."""
        return tuple(v for k, v in self.disk.items() if k.startswith("journal"))  # type: ignore[return-value]

    @property
    def disk_peak(self) -> int:
        # The activations are gone before the output is assembled beside the packed blocks.
        blocks, acts = self.journal_bytes
        return max(blocks + acts, self.output_bytes + blocks)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(peak_ram=self.peak_ram, output_bytes=self.output_bytes, disk_peak=self.disk_peak,
                   total_seconds=sum(self.seconds.values()))
        return out

    def format(self, max_blocks: int = 2) -> str:
        """A readable table for ``optq quantize --dry-run``."""
        s = self.settings
        n_lin = sum(len(b["linears"]) for b in self.blocks)
        n_q = sum(x["quantized"] for b in self.blocks for x in b["linears"])
        head = f"model {self.model}: {len(self.blocks)} blocks in {self.blocks_name}, {n_lin} linears ({n_q} to quantize)"
        calib = (f"calibration {s['nsamples']} x {s['seqlen']} tokens, batch {s['batch_size']}, "
                 f"compute {s['compute_dtype']}, source {s['source_dtype']}, {s['bits']}-bit g{s['group_size']}, "
                 f"{s['strategy']}, propagate {s['propagate']}")
        lines = [head, calib, ""]
        kinds: dict[tuple, list[dict[str, Any]]] = {}
        for b in self.blocks:
            sig = tuple((x["name"][len(b["name"]) + 1:], x["in"], x["out"], x["quantized"]) for x in b["linears"])
            kinds.setdefault(sig, []).append(b)
        for sig, members in list(kinds.items())[:max_blocks]:
            b = members[0]
            lines.append(f"{b['name']} and {len(members) - 1} more like it ({b['params'] / 1e6:.1f}M params each)")
            for rel, k, n, q in sig:
                lines.append(f"  {rel:<40} {k:>7} -> {n:<7}{'' if q else '  (kept)'}")
        if len(kinds) > max_blocks:
            lines.append(f"  ... {len(kinds) - max_blocks} more kinds of block")
        lines.append("")

        def table(title: str, terms: dict[str, int]) -> None:
            lines.append(title)
            for k, v in terms.items():
                lines.append(f"  {k:<32} {v / GB:10.3f} GB")
            lines.append(f"  {'total':<32} {sum(terms.values()) / GB:10.3f} GB")

        table("peak RAM while capturing the first block's inputs", self.capture)
        table("peak RAM while quantizing blocks", self.ram)
        table("peak RAM while assembling the output", self.assembly)
        lines.append(f"predicted peak RAM {self.peak_ram / GB:.2f} GB")
        lines.append("")
        lines.append("disk")
        for k, v in self.disk.items():
            lines.append(f"  {k:<48} {v / GB:10.3f} GB")
        lines.append(f"output {self.output_bytes / GB:.3f} GB; needed at the peak (output + packed blocks, "
                     f"or the journal while running) {self.disk_peak / GB:.3f} GB")
        lines.append("")
        total = sum(self.seconds.values())
        lines.append("time (rough, +-50%): " + ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())
                     + f"; total {total:.0f} s = {total / 3600:.2f} h")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


_SPEED: dict[str, float] = {}


def machine_speed() -> dict[str, float]:
    """This machine's float32 matmul rate (FLOP/s) and GPTQ solve rate, measured once (~1 s)."""
    if _SPEED:
        return dict(_SPEED)
    from optq.core.solver import gptq

    a, b = torch.randn(1024, 1024), torch.randn(1024, 2048)
    best = math.inf
    for _ in range(4):
        t = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t)
    x = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))
    H, W = x.T @ x / 4096, torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))
    solve = math.inf
    for _ in range(2):
        t = time.perf_counter()
        gptq(W, H, QuantConfig())
        solve = min(solve, time.perf_counter() - t)
    _SPEED.update(flops=2 * 1024 * 1024 * 2048 / best, solve_unit=solve / (2 * 1024**3))
    return dict(_SPEED)


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


def _packed_bytes(K: int, N: int, bias: bool, config: QuantConfig) -> dict[str, tuple[tuple[int, ...], str, int]]:
    g = 1 if config.group_size == -1 else math.ceil(K / config.group_size)
    out = {"qweight": ((packed_length(K, config.bits), N), "I32", packed_length(K, config.bits) * N * _INT32),
           "qzeros": ((g, packed_length(N, config.bits)), "I32", g * packed_length(N, config.bits) * _INT32),
           "scales": ((g, N), "F16", g * N * _FP16),
           "g_idx": ((K,), "I32", K * _INT32)}
    if bias:
        out["bias"] = ((N,), "F16", N * _FP16)
    return out


_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
       torch.float64: "F64", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}


def _header_bytes(entries: dict[str, tuple[tuple[int, ...], str, int]]) -> int:
    """Bytes of a safetensors header for these tensors, as optq writes it."""
    specs = {k: (shape, SAFETENSORS_DTYPES[code]) for k, (shape, code, _) in entries.items()}
    return len(safetensors_header(specs, {"format": "pt"})[1])


def plan(source: Any, *, nsamples: int, seqlen: int, config: QuantConfig, batch_size: int = 8,
         compute_dtype: torch.dtype = torch.float32, propagate: str = "quantized", strategy: str = "replay",
         include: Any = None, exclude: Any = None, format: str = "gptq", max_shard_size: int | str = "5GB",
         source_dtype: torch.dtype | None = None, method: str = "gptq", speed: dict[str, float] | None = None,
         moe_calibration: str = "all", max_hessian_memory: int | None = None) -> Plan:
    """The plan of quantizing ``source`` (a model folder, built-in name, config dict or
    transformers config) with these settings; reads no tensor data. ``source_dtype`` is needed
    only for a config (default: its ``torch_dtype``/``dtype``, else bfloat16); ``speed`` as
    returned by :func:`machine_speed` (measured when None)."""
    from optq.formats.gptq_config import describe_gptq

    model, cfg, src = _skeleton(source)
    unfuse_experts(model)  # as the run does: one linear per expert matrix
    layer_name = layer_namer(checkpoint_namer(model))  # packed tensors named as optq.save names them
    blocks_name, blocks = find_blocks(model)
    tensors = _persistent(model)
    if src is not None:
        stored = {k: (tuple(shape), _ST.get(dt, "F32"), int(torch.Size(shape).numel()) * dt.itemsize)
                  for k, (_, shape, dt) in src.index.items()}
        source_dtype = src.dtype
    else:
        name = cfg.get("torch_dtype") or cfg.get("dtype")
        source_dtype = source_dtype or (getattr(torch, name) if isinstance(name, str) else torch.bfloat16)
        stored = {k: (tuple(t.shape), _ST[source_dtype if t.is_floating_point() else t.dtype],
                      t.numel() * (source_dtype.itemsize if t.is_floating_point() else t.element_size()))
                  for k, t in tensors.items()}
    c = torch.empty(0, dtype=compute_dtype).element_size()
    h = int(cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model"))
    inter = int(cfg.get("intermediate_size") or cfg.get("ffn_dim") or cfg.get("n_inner") or 4 * h)
    T, b = nsamples * seqlen, min(batch_size, nsamples) * seqlen

    names = {f"{blocks_name}.{i}": find_linears(blk, f"{blocks_name}.{i}") for i, blk in enumerate(blocks)}
    all_names = [n for lin in names.values() for n in lin]
    targets, _ = drop_routers(all_names, set(select_names(all_names, include, exclude)), include)
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("moe_topk") or 1)
    listing, packed, block_params, flops, solve_units, hess_flops, solve_peak = [], {}, [], 0.0, 0.0, 0.0, 0
    for i, blk in enumerate(blocks):
        bname = f"{blocks_name}.{i}"
        lin = names[bname]
        groups = _groups(lin)
        group_of = {n: g for g, members in groups.items() for n in members}
        rows = []
        for n, mod in lin.items():
            N, K = get_weight(mod).shape
            rows.append({"name": n, "in": int(K), "out": int(N), "group": group_of[n].split("@")[0].rpartition(".")[2],
                         "quantized": n in targets})
            if n in targets:
                bias = getattr(mod, "bias", None) is not None
                packed.update({f"{layer_name(n)}.{k}": v for k, v in _packed_bytes(int(K), int(N), bias, config).items()})
            flops += 2 * (T * top_k // len(siblings(lin, n)) if expert_parts(n) else T) * N * K
        stage_hessians: dict[str, int] = {}
        stage_solve: dict[str, int] = {}
        for members in groups.values():
            mine = [n for n in members if n in targets]
            if not mine:
                continue
            K = get_weight(lin[mine[0]]).shape[1]
            R = sum(get_weight(lin[n]).shape[0] for n in mine)
            solve = (5 * R * K + 4 * K * K) * 4
            parts = expert_parts(mine[0])
            if parts is not None:
                # An expert stage holds all its experts' Hessians (solver's and plain, float32)
                # while they are solved, up to the budget; each expert sees its share of the
                # routed tokens, or all of them with "all".
                key = f"{parts[0]}@{parts[2]}"
                stage_hessians[key] = stage_hessians.get(key, 0) + hessian_bytes(K, config.normalize_tokens)
                stage_solve[key] = max(stage_solve.get(key, 0), solve)
                hess_flops += 2 * (T if moe_calibration == "all" else T * top_k // len(siblings(lin, mine[0]))) * K * K
            else:
                solve_peak = max(solve_peak, K * K * 4 + solve)
                hess_flops += 2 * T * K * K
            solve_units += K**3 + R * K * K if method == "gptq" else 0
        budget = max_hessian_memory or default_hessian_budget()
        for key, held in stage_hessians.items():
            solve_peak = max(solve_peak, min(held, budget) + stage_solve[key])
        params = sum(p.numel() for p in blk.parameters())
        block_params.append(params)
        listing.append({"name": bname, "params": int(params), "linears": rows})
    attn_flops = 4 * T * seqlen * h * len(blocks)
    passes = (2 if strategy == "replay" else 1) + (1 if propagate == "original" else 0)

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    emb_ids = {id(p) for p in model.get_input_embeddings().parameters()}
    block_ids = {id(t) for t in [*blocks.parameters(), *blocks.buffers()]}
    outside = sum(t.numel() * (c if t.is_floating_point() else t.element_size()) for t in tensors.values()
                  if id(t) not in block_ids and (id(t) not in head_ids or id(t) in emb_ids))
    act = T * h * c
    capture = {"runtime": RUNTIME_BYTES, "embeddings (+ norm)": outside, "one block": max(block_params) * c,
               "activations": act, "batch temporaries": b * (3 * inter + 3 * h) * 4}
    ram = {"runtime": RUNTIME_BYTES, "one block": max(block_params) * c, "activations": act, "recorded outputs (replay)": act if strategy == "replay" else 0,
           "original outputs": act if propagate == "original" else 0,
           "paused forwards": T * (inter + 2 * h) * c if strategy == "pause" else 0,
           "batch temporaries": b * (3 * inter + 3 * h) * 4, "hessian + solve": solve_peak}
    ram = {k: int(v) for k, v in ram.items() if v or k in ("activations", "hessian + solve")}

    replaced = {k.rsplit(".", 1)[0] for k in packed}
    entries = {k: v for k, v in stored.items() if k.rsplit(".", 1)[0] not in replaced}
    entries.update(packed)
    shards = split_shards({k: entries[k][2] for k in sorted(entries)}, parse_size(max_shard_size))
    headers = sum(_header_bytes({k: entries[k] for k in s}) for s in shards)
    tensor_bytes = sum(v[2] for v in entries.values())
    natural = not config.act_order or bool(config.static_groups)
    qconfig = describe_gptq(bits=config.bits, group_size=config.group_size, sym=config.sym, natural=natural,
                            static_groups=bool(config.static_groups), damp=config.damp, checkpoint_format=format)
    conf = {k: v for k, v in cfg.items() if k != "quantization_config"} | {"quantization_config": qconfig}
    small = (_json_len(conf) + _json_len(qconfig) + _REPORT_BYTES + len(blocks) * _REPORT_BYTES_PER_BLOCK
             + sum(_REPORT_BYTES_PER_LAYER + 2 * len(n) for n in targets))
    if len(shards) > 1:
        index = {"metadata": {"total_size": tensor_bytes}, "weight_map": {k: f"model-00001-of-{len(shards):05d}.safetensors"
                                                                           for k in entries}}
        small += _json_len(index)
    if src is not None:
        from optq.pipeline.stream.quantize import _COPIED, _NOT_COPIED

        small += sum(p.stat().st_size for pat in _COPIED for p in src.folder.glob(pat)
                     if p.name not in _NOT_COPIED and p.is_file())
    block_files = sum(v[2] for v in packed.values()) + sum(
        _header_bytes({k: v for k, v in packed.items() if k.startswith(f"{blocks_name}.{i}.")}) for i in range(len(blocks)))
    disk = {"output tensors": tensor_bytes, "output headers, config, report, copied files": headers + small,
            "journal: packed blocks": block_files, "journal: activations (2 files while replaced)": 2 * act}
    largest = max((v[2] for v in entries.values()), default=0)
    assembly = {"runtime": RUNTIME_BYTES, "largest output tensor (mapped + copied)": 2 * largest}

    sp = speed or machine_speed()
    seconds = {"forwards": passes * (flops + attn_flops) / sp["flops"], "hessians": hess_flops / sp["flops"],
               "solves": solve_units * sp["solve_unit"], "assembly": (tensor_bytes + headers) / 0.5e9}
    notes = []
    three_d = [n for n, p in blocks[-1].named_parameters() if p.dim() >= 3]
    if three_d:
        notes.append(f"{len(three_d)} fused 3-D parameter(s) per block ({', '.join(three_d[:3])}) have a layout optq "
                     "does not unfuse: they are kept as stored, in float, and reported (as the pipeline does)")
    settings = {"nsamples": nsamples, "seqlen": seqlen, "batch_size": batch_size, "bits": config.bits,
                "group_size": config.group_size, "strategy": strategy, "propagate": propagate, "format": format,
                "compute_dtype": str(compute_dtype).removeprefix("torch."), "max_shard_size": str(max_shard_size),
                "source_dtype": str(source_dtype).removeprefix("torch."), "hidden": h, "intermediate": inter,
                "tokens": T, "speed": sp}
    return Plan(model=str(getattr(src, "folder", cfg.get("model_type"))), blocks_name=blocks_name, blocks=listing,
                settings=settings, capture=capture, ram=ram, assembly=assembly, disk=disk, seconds=seconds, notes=notes)


def _json_len(obj: Any) -> int:
    return len((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
