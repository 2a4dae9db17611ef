"""Quantize a whole causal LM, one decoder block at a time: ``optq.quantize``.

For each block: find the linears and group them by the input they share (q/k/v, then o, then
gate/up, then down in a Llama block); for each group in that order, run the calibration batches
through the block up to that group, accumulate ONE Hessian of the group's input, solve all of
the group's weights together (their rows stacked: GPTQ treats rows independently and they share
H), and write the quantized weights back, so the next group sees the effect of the earlier ones.
The block's outputs then become the next block's inputs (``optq.pipeline.blocks.block`` does one block).

Memory: the model stays where it is; only the current block is moved to ``device``. With
T = nsamples x seqlen calibration tokens, b = batch_size x seqlen tokens per forward, h the
hidden size, i the MLP's intermediate size and float32 activations, the peak is about

    the runtime and the model                     (a lazily loaded model becomes resident)
  + T x h x 4                                     the block inputs, each batch's overwritten
                                                  by its outputs as soon as they exist
  + T x h x 4                                     strategy="replay": one finished child's
                                                  recorded outputs (the attention's)
  + T x h x 4                                     propagate="original": the unquantized
                                                  block's outputs, beside its inputs
  + b x (3 i + 3 h) x 4                           one batch's temporaries inside the block
  + ~6 x the largest group's weights x 4 + K^2 x 4   the solve (stacked rows, copies) and H
  + T x (i + 2 h) x 4                             strategy="pause" only: every batch's paused
                                                  forward (at worst inside the MLP)
  + one block's parameters on ``device``          when the model lives elsewhere

plus what the allocator holds between the heap trims after each pass. SmolLM2-135M at 128 x 512
tokens: 144 + 144 + 99 + ~50 MB beside the 513 MB model (pause: +528 MB); the peak measured by
benchmarks/quantize_model.py is printed next to this formula's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.formats.experts import is_router, unfuse_experts
from optq.formats.linears import find_linears, get_weight, is_linear
from optq.pipeline.blocks import capture
from optq.pipeline.blocks.block import quantize_block
from optq.pipeline.blocks.calibration import calibration_samples, make_batches, max_positions
from optq.pipeline.blocks.discovery import drop_routers, find_blocks, select_names
from optq.pipeline.distributed.ranks import Dist, current
from optq.pipeline.moe.stages import MOE_CALIBRATION, MOE_WEIGHTING, default_hessian_budget
from optq.pipeline.report import Report

__all__ = ["quantize", "Report"]

log = logging.getLogger("optq.pipeline")

PROPAGATE = ("quantized", "original")
METHODS = ("gptq", "rtn")
STRATEGIES = ("pause", "replay")


def quantize(
    model: nn.Module,
    calibration: Any,
    config: QuantConfig,
    *,
    propagate: str = "quantized",
    tokenizer: Any = None,
    nsamples: int | None = None,
    seqlen: int | None = None,
    seed: int = 0,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    batch_size: int = 8,
    method: str = "gptq",
    strategy: str = "replay",
    moe_calibration: str = "all",
    moe_min_tokens: int | None = None,
    max_hessian_memory: int | None = None,
    moe_weighting: str = "none",
    hessian_dtype: str = "float32",
) -> Report:
    """Quantize the linears of ``model``'s decoder blocks in place; returns a ``Report``.

    Example::

        >>> report = optq.quantize(model, token_ids, optq.QuantConfig(bits=4, group_size=128))
        >>> report.totals["mean_objective_ratio"]   # GPTQ / round-to-nearest, below 1

    Args:
        calibration: token ids (LongTensor [n, seqlen], a list of 1-D LongTensors, or a 1-D
            token stream to draw ``nsamples`` windows of ``seqlen`` from with ``seed``), or text
            (a string or list of strings) together with ``tokenizer``.
        propagate: "quantized" (each block calibrates on the outputs of the already quantized
            blocks, so later layers compensate earlier errors) or "original" (every block's
            inputs come from the unquantized model, the plain layer-wise method). Inside a block
            the groups are sequential either way. "original" costs one more block forward per
            block (the unquantized block's outputs, computed first) and holds them beside the
            inputs.
        include / exclude: module-name patterns (wildcards like ``*.mlp.*``, or ``re:REGEX``)
            selecting which block linears to quantize. Embeddings and the head are never touched.
        device: where each block is computed ("cuda" quantizes a CPU-resident model on a GPU);
            default: where the model's blocks are.
        batch_size: calibration samples per block forward (results depend on it only through
            floating-point summation order).
        method: "gptq", or "rtn" (round-to-nearest; the report still measures it on H).
        strategy: "replay" (default: the block is re-run from its inputs for each group, each
            run stopping at the group's input; once a child module such as the attention is
            fully quantized its outputs are recorded and replayed instead of recomputed, so a
            Llama block costs about two forwards, and memory stays at the activations) or
            "pause" (every batch's forward pauses at each group's input while the group is
            solved, then resumes: one forward per block, about 13% less time on SmolLM2, but all
            batches' intermediate tensors stay alive: several times the activations). Both
            give the same weights. Blocks with mixture-of-experts experts are always replayed.
        moe_calibration: where each mixture-of-experts expert's Hessian comes from: "all"
            (default: every calibration token, for the Hessians only; the block's output keeps
            the true routing) or "routed" (the tokens routed to it; an expert routed fewer than
            ``moe_min_tokens`` tokens gets the "all" Hessian instead). Experts in a model's own
            ``nn.ModuleList`` are always "routed", and rounded to nearest when starved.
            Fused transformers experts are replaced by one ``nn.Linear`` per expert matrix
            (``optq.formats.experts.ExpertLinears``, the same function); routers stay float
            unless ``include`` names them. See docs/moe.md.
        moe_min_tokens: the starved-expert threshold (default: the layer's input width, below
            which an expert's Hessian is singular).
        max_hessian_memory: bytes the Hessians of one stage of experts may take; more experts
            are collected in chunks, one block forward each (default: a quarter of the RAM).
        moe_weighting: "none" (every routed token weighs the same in an expert's Hessian) or
            "routing" (each by its squared routing weight, since the expert's output is scaled by
            it); measured in docs/moe.md.
        hessian_dtype: "float32", or "float64": Hessians summed in double precision (products
            of float32 inputs are exact in it), so the weights no longer depend on the order in
            which tokens were summed (batch order, batch size) but for a value falling within
            ~1e-16 of a float32 rounding boundary; costs the Hessian products' double-precision
            speed and twice their memory.
    """
    start = time.perf_counter()
    run = prepare(model, calibration, config, propagate=propagate, tokenizer=tokenizer, nsamples=nsamples,
                  seqlen=seqlen, seed=seed, include=include, exclude=exclude, device=device,
                  batch_size=batch_size, method=method, strategy=strategy, moe_calibration=moe_calibration,
                  moe_min_tokens=moe_min_tokens, max_hessian_memory=max_hessian_memory,
                  moe_weighting=moe_weighting, hessian_dtype=hessian_dtype)
    check_finite_weights({n: m for n, m in run.linears.items() if n in run.targets})
    blocks_name, blocks, targets, batches, device, options = (
        run.blocks_name, run.blocks, run.targets, run.batches, run.device, run.options)
    log.info("quantizing %d linears in %d blocks of %s on %d x %d tokens (%s, %s)",
             len(targets), len(blocks), blocks_name, options["nsamples"], options["seqlen"], method, propagate)
    was_training = model.training
    model.eval()
    report = Report(layers={}, config=config.to_dict(), options=options, versions=_versions(),
                    seconds=0.0, block_seconds=[], skipped=dict(run.skipped))
    try:
        with torch.no_grad():
            hidden, calls = capture.capture_inputs(model, blocks, batches, device)
            opts = {**options, "device": device, "dist": current()}
            _loop(blocks_name, blocks, hidden, calls, targets, config, opts, progress and opts["dist"].rank == 0, report)
    except ValueError as exc:
        # Found inside the loop (non-finite activations, a Hessian that cannot be factorised):
        # say what state the model is left in, since it is quantized in place.
        raise _with_state(exc, _state(report, len(targets))) from exc
    finally:
        model.train(was_training)
    report.seconds = time.perf_counter() - start
    t = report.totals
    ratio = t["mean_objective_ratio"]
    log.info("done in %.1f s: %d layers, mean objective ratio to round-to-nearest %s",
             report.seconds, t["layers"], "n/a" if ratio is None else f"{ratio:.4f}")
    return report


@dataclass
class Run:
    """What a run works on, checked and derived from the arguments (see :func:`prepare`)."""

    blocks_name: str
    blocks: nn.ModuleList
    linears: dict[str, nn.Module]
    targets: set[str]
    batches: list[torch.Tensor]
    device: torch.device
    options: dict[str, Any]
    skipped: dict[str, str]
    calibration_digest: str = ""  # of every rank's samples: the same on all ranks


def prepare(model: nn.Module, calibration: Any, config: QuantConfig, *, propagate: str, tokenizer: Any,
            nsamples: int | None, seqlen: int | None, seed: int, include: Any, exclude: Any,
            device: torch.device | str | None, batch_size: int, method: str, strategy: str,
            moe_calibration: str = "all", moe_min_tokens: int | None = None,
            max_hessian_memory: int | None = None, moe_weighting: str = "none",
            hessian_dtype: str = "float32") -> Run:
    """Check the arguments of a run and derive its blocks, targets, batches, device and options
    (shared by ``optq.quantize`` and the streaming ``quantize_pretrained``; the model may be on
    the meta device). Raises ValueError/TypeError before any work.

    Fused mixture-of-experts modules are replaced by ``ExpertLinears`` here (in place); what
    stays float is returned in ``Run.skipped`` by name: fused experts optq cannot unfuse, and
    routers that ``include`` does not name."""
    if propagate not in PROPAGATE:
        raise ValueError(f"propagate={propagate!r} is not one of {PROPAGATE}")
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be an optq.QuantConfig, not {type(config).__name__}")
    if moe_calibration not in MOE_CALIBRATION:
        raise ValueError(f"moe_calibration={moe_calibration!r} is not one of {MOE_CALIBRATION}")
    if hessian_dtype not in ("float32", "float64"):
        raise ValueError(f"hessian_dtype={hessian_dtype!r} is not 'float32' or 'float64'")
    if moe_weighting not in MOE_WEIGHTING:
        raise ValueError(f"moe_weighting={moe_weighting!r} is not one of {MOE_WEIGHTING}")
    if moe_min_tokens is not None and (not isinstance(moe_min_tokens, int) or moe_min_tokens < 0):
        raise ValueError(f"moe_min_tokens={moe_min_tokens!r} must be a non-negative integer")
    if max_hessian_memory is not None and (not isinstance(max_hessian_memory, int) or max_hessian_memory <= 0):
        raise ValueError(f"max_hessian_memory={max_hessian_memory!r} must be a positive number of bytes")
    _, left_fused = unfuse_experts(model)
    skipped = {name: f"{why}: left in float" for name, why in left_fused.items()}
    blocks_name, blocks = find_blocks(model)
    all_linears = {
        name: lin
        for i, blk in enumerate(blocks)
        for name, lin in find_linears(blk, f"{blocks_name}.{i}").items()
    }
    if not all_linears:
        raise ValueError(f"{type(model).__name__} has no linear layers in its decoder blocks")
    targets = set(select_names(list(all_linears), include, exclude))
    for i, blk in enumerate(blocks):
        for mname, mod in blk.named_modules():
            if is_linear(mod):
                continue
            for pname, p in mod.named_parameters(recurse=False):
                full = f"{blocks_name}.{i}.{mname}.{pname}" if mname else f"{blocks_name}.{i}.{pname}"
                if p.dim() >= 2 and full not in skipped:  # e.g. Mixtral's router, a bare weight
                    skipped[full] = ("router: kept in float" if is_router(f"{blocks_name}.{i}.{mname}")
                                     else "not a linear layer: kept in float")
    targets, routers = drop_routers(list(all_linears), targets, include)
    for name in routers:
        skipped[name] = "router: kept in float (name it in include to quantize it)"
    if not targets:
        raise ValueError("include/exclude left no linear layer to quantize")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    samples = calibration_samples(
        calibration,
        tokenizer=tokenizer,
        nsamples=nsamples,
        seqlen=seqlen,
        seed=seed,
        vocab_size=getattr(emb, "num_embeddings", None),
        max_positions=max_positions(model),
    )
    dist = current()
    shares = [list(Dist(dist.world_size, r).share(len(samples))) for r in range(dist.world_size)]
    if dist.active:
        # Data-parallel calibration: each rank captures and forwards its contiguous share.
        if len(samples) < dist.world_size:
            raise ValueError(f"{len(samples)} calibration samples cannot be shared by {dist.world_size} "
                             "processes; give at least one per process")
        lo, hi = shares[dist.rank]
        batches = make_batches(samples[lo:hi], batch_size)
    else:
        batches = make_batches(samples, batch_size)
    home = next(blocks[0].parameters()).device
    try:
        device = torch.device(device) if device is not None else (home if home.type != "meta" else torch.device("cpu"))
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc}); use e.g. 'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} asked, but this torch has no usable CUDA; use 'cpu'")
    options = {
        "method": method,
        "propagate": propagate,
        "strategy": strategy,
        "nsamples": len(samples),
        "seqlen": max(s.numel() for s in samples),
        "tokens": sum(s.numel() for s in samples),
        "seed": seed,
        "batch_size": batch_size,
        "device": str(device),
        # Float summation order, hence the last bits of the weights, can depend on it: the same
        # bytes are promised for the same inputs, seed, versions and thread count.
        "num_threads": torch.get_num_threads(),
        "include": include,
        "exclude": exclude,
        "blocks": blocks_name,
        "moe_calibration": moe_calibration,
        "moe_min_tokens": moe_min_tokens,  # None: each layer's input width
        "max_hessian_memory": max_hessian_memory or default_hessian_budget(),
        "moe_weighting": moe_weighting,
        "hessian_dtype": hessian_dtype,
        "world_size": dist.world_size,
        "calibration_shares": shares,
    }
    dist.same_everywhere("the arguments (calibration, settings, targets)",
                         [{k: v for k, v in options.items() if k != "device"}, sorted(targets), config.to_dict(),
                          [s.tolist() for s in samples]])
    from optq.pipeline.stream.journal import tensor_digest

    return Run(blocks_name, blocks, all_linears, targets, batches, device, options, skipped,
               tensor_digest(list(samples)))


def _loop(
    blocks_name: str,
    blocks: nn.ModuleList,
    hidden: list[torch.Tensor],
    calls: list[list[capture.Call]],
    targets: set[str],
    config: QuantConfig,
    opts: dict[str, Any],
    progress: bool,
    report: Report,
) -> None:
    from tqdm.auto import tqdm

    bar = tqdm(total=len(blocks), desc="optq", unit="block", disable=not progress)
    try:
        for i, block in enumerate(blocks):
            t0 = time.perf_counter()
            home = next(block.parameters()).device
            block.to(opts["device"])
            # The outputs replace the inputs: activations are held once, never per layer.
            quantize_block(f"{blocks_name}.{i}", block, hidden, calls[i], targets, config, opts, report, bar)
            block.to(home)
            _settle_solutions(f"{blocks_name}.{i}", block, home, report)
            report.block_seconds.append(time.perf_counter() - t0)
            log.debug("block %d done in %.2f s", i, report.block_seconds[-1])
            bar.update(1)
    finally:
        bar.close()


def check_finite_weights(linears: dict[str, nn.Module]) -> None:
    """Raise ValueError naming the first weight holding a NaN or an infinity.

    Run on every layer to quantize before any weight changes (one min/max reduction per
    weight): a bad value found later, in a Hessian or the solver, would leave the model
    half-quantized.
    """
    for name, module in linears.items():
        w = get_weight(module).detach()
        if w.is_meta or w.numel() == 0:
            continue
        low, high = torch.aminmax(w)  # a NaN propagates to both, an infinity to one
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            raise ValueError(
                f"{name}.weight has NaN/Inf values; the model is unchanged (is the checkpoint "
                "corrupt? load it again or convert it anew)"
            )


def _with_state(exc: ValueError, state: str) -> ValueError:
    # The same type (a FactorizationError stays one) when it can be built from a message.
    try:
        return type(exc)(f"{exc}; {state}")
    except Exception:
        return ValueError(f"{exc}; {state}")


def _state(report: Report, targets: int) -> str:
    done = len(report.layers)
    if done == 0:
        return "no weight was changed"
    return (f"the model is left partly quantized ({done} of {targets} layers, up to "
            f"{list(report.layers)[-1]}): load it again before using it")


def _settle_solutions(prefix: str, block: nn.Module, home: torch.device, report: Report) -> None:
    # Solutions live beside the model, not on the compute device, and their dequantized weight
    # is the module's own weight tensor (a view): no second copy of the model is kept.
    for name, mod in find_linears(block, prefix).items():
        sol = report.solutions.get(name)
        if sol is None:
            continue
        # The view shares the parameter's version counter: a later in-place change of the
        # model's weight is noticed by the solution (see Solution.drop_codes).
        sol.weight = get_weight(mod)
        for field in ("scales", "zeros", "g_idx", "perm"):
            setattr(sol, field, getattr(sol, field).to(home))
        # The codes are the weight's, exactly: recomputed when a checkpoint is written instead
        # of held (one byte per weight, a quarter of an fp32 model) for the whole run.
        if not sol.drop_codes():
            sol.codes = sol.codes.to(home)


def _versions() -> dict[str, str]:
    from optq import __version__

    out = {"optq": __version__, "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out
