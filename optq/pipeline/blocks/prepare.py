"""What a run works on: a model's blocks, the linears to quantize, the calibration batches.

:func:`prepare` is shared by ``optq.quantize`` (a model in memory) and ``quantize_pretrained``
(a skeleton on the meta device whose blocks are streamed): it checks what only the model can
tell (a linear to quantize, calibration ids inside the vocabulary, windows within the model's
positions), splits fused experts into linears, and returns a :class:`Run`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.formats.experts import ExpertLinears, is_router, unfuse_experts
from optq.formats.linears import find_linears, get_weight, is_linear
from optq.pipeline.blocks.calibration import calibration_samples, make_batches, max_positions, tensor_digest
from optq.pipeline.discovery import drop_routers, expert_parts, find_blocks, select_names
from optq.pipeline.distributed.ranks import Dist, current
from optq.pipeline.schemes import LayerSchemes, resolve
from optq.pipeline.settings import RunSettings

__all__ = ["Run", "prepare", "check_finite_weights"]

log = logging.getLogger("optq.pipeline")


@dataclass
class Run:
    """A prepared run: the settings it was asked for and what they resolved to on this model.

    ``linears``: every linear of every block by full name; ``targets``: those to quantize;
    ``batches``: this rank's calibration batches; ``device``: where blocks are computed;
    ``skipped``: what stays float, by name, with the reason; ``facts``: what the run found out
    (actual sample count and length, token count, thread count, the ranks' sample shares), for
    the report beside the settings.
    """

    config: QuantConfig
    settings: RunSettings
    blocks_name: str
    blocks: nn.ModuleList
    linears: dict[str, nn.Module]
    targets: set[str]
    batches: list[torch.Tensor]
    device: torch.device
    skipped: dict[str, str]
    facts: dict[str, Any]
    dist: Dist = field(default_factory=Dist)
    calibration_digest: str = ""  # of every rank's samples: the same on all ranks
    schemes: LayerSchemes | None = None  # each target's own config (None: ``config`` for all)

    def config_of(self, name: str) -> QuantConfig:
        """The ``QuantConfig`` linear ``name`` is quantized with (``optq.pipeline.schemes``)."""
        return self.config if self.schemes is None else self.schemes.of(name)

    def options(self) -> dict[str, Any]:
        """The report's ``options``: the settings (``RunSettings.to_dict``) and the facts."""
        return {**self.settings.to_dict(), **self.facts}

    def block_name(self, i: int) -> str:
        return f"{self.blocks_name}.{i}"

    @property
    def weights_only(self) -> bool:
        """Whether every target is quantized from its weight alone, with no calibration forward:
        the method reads no Hessian nor a float chain (round-to-nearest), no ``target_bits``
        allocation measures the layers, and the run is one process (ranks would meet at each
        group). Then nothing captures block 0's inputs, no block runs, no Hessian is collected,
        and the report's errors are null (``Report.unmeasured`` says why)."""
        return not self.settings.reads_calibration and not self.dist.active


def prepare(
    model: nn.Module, calibration: Any, config: QuantConfig, settings: RunSettings, tokenizer: Any = None
) -> Run:
    """Check a run against ``model`` and derive its blocks, targets, batches and device (the model
    may be on the meta device). Raises ValueError/TypeError before any work.

    Fused mixture-of-experts modules are replaced by ``ExpertLinears`` here (in place); what
    stays float is returned in ``Run.skipped`` by name: fused experts optq cannot unfuse, and
    routers that ``include`` does not name."""
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be an optq.QuantConfig, not {type(config).__name__}")
    if not isinstance(settings, RunSettings):
        raise TypeError(f"settings must be an optq RunSettings, not {type(settings).__name__}")
    _, left_fused = unfuse_experts(model)
    skipped = {name: f"{why}: left in float" for name, why in left_fused.items()}
    blocks_name, blocks = find_blocks(model)
    linears = {
        name: lin for i, blk in enumerate(blocks) for name, lin in find_linears(blk, f"{blocks_name}.{i}").items()
    }
    if not linears:
        raise ValueError(f"{type(model).__name__} has no linear layers in its decoder blocks")
    targets = set(select_names(list(linears), settings.include, settings.exclude))
    _float_parameters(blocks_name, blocks, skipped)
    targets, routers = drop_routers(list(linears), targets, settings.include)
    for name in routers:
        skipped[name] = "router: kept in float (name it in include to quantize it)"
    if not targets:
        raise ValueError("include/exclude left no linear layer to quantize")
    settings.method_object.check_experts(_own_experts(model, targets))
    schemes = resolve(
        linears,
        sorted(targets),
        config,
        settings.overrides,
        serve=settings.serve,
        strict_groups=settings.strict_groups,
        fmt=settings.format,
    )
    for line in schemes.notes:
        log.info(line)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    samples = calibration_samples(
        calibration,
        tokenizer=tokenizer,
        nsamples=settings.nsamples,
        seqlen=settings.seqlen,
        seed=settings.seed,
        vocab_size=getattr(emb, "num_embeddings", None),
        max_positions=max_positions(model),
    )
    dist = current()
    shares = [list(Dist(dist.world_size, r).share(len(samples))) for r in range(dist.world_size)]
    if dist.active and len(samples) < dist.world_size:
        raise ValueError(
            f"{len(samples)} calibration samples cannot be shared by {dist.world_size} processes; "
            "give at least one per process"
        )
    lo, hi = shares[dist.rank]  # data-parallel calibration: each rank its contiguous share
    batches = make_batches(samples[lo:hi], settings.batch_size)
    device = settings.torch_device(next(blocks[0].parameters()).device)
    facts = {
        "nsamples": len(samples),
        "seqlen": max(s.numel() for s in samples),
        "tokens": sum(s.numel() for s in samples),
        "device": str(device),
        # Float summation order, hence the last bits of the weights, can depend on it: the same
        # bytes are promised for the same inputs, seed, versions and thread count.
        "num_threads": torch.get_num_threads(),
        "blocks": blocks_name,
        "max_hessian_memory": settings.hessian_budget,
        "world_size": dist.world_size,
        "calibration_shares": shares,
    }
    run = Run(config, settings, blocks_name, blocks, linears, targets, batches, device, skipped, facts, dist)
    run.schemes = schemes
    dist.same_everywhere(
        "the arguments (calibration, settings, targets)",
        [
            {k: v for k, v in run.options().items() if k != "device"},
            sorted(targets),
            config.to_dict(),
            schemes.to_dict(),
            [s.tolist() for s in samples],
        ],
    )
    run.calibration_digest = tensor_digest(list(samples))
    return run


def _own_experts(model: nn.Module, targets: set[str]) -> list[str]:
    """The modules holding targeted experts that are the model's own code, not ExpertLinears:
    optq runs them only on the tokens their router picks, not on every token (which a method
    pairing each token's input in the float and the quantized model, GPTAQ, refuses)."""
    owners = {p[0] for n in targets if (p := expert_parts(n)) is not None}
    return sorted(o for o in owners if not isinstance(model.get_submodule(o), ExpertLinears))


def _float_parameters(blocks_name: str, blocks: nn.ModuleList, skipped: dict[str, str]) -> None:
    # Matrices of a block that are not linear layers (Mixtral's router as a bare weight, fused
    # experts left as they are) stay float, and the report says so by name.
    for i, blk in enumerate(blocks):
        for mname, mod in blk.named_modules():
            if is_linear(mod):
                continue
            for pname, p in mod.named_parameters(recurse=False):
                full = f"{blocks_name}.{i}.{mname}.{pname}" if mname else f"{blocks_name}.{i}.{pname}"
                if p.dim() >= 2 and full not in skipped:
                    skipped[full] = (
                        "router: kept in float"
                        if is_router(f"{blocks_name}.{i}.{mname}")
                        else "not a linear layer: kept in float"
                    )


def check_finite_weights(linears: dict[str, nn.Module], where: Any = None) -> None:
    """Raise ValueError naming the first weight holding a NaN or an infinity (and the file it
    was read from, ``where(name)``, when a streamed run gives it).

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
            place = f"{where(name)}: " if where is not None else ""
            raise ValueError(
                f"{place}{name}.weight has NaN/Inf values; the model is unchanged (is the checkpoint "
                "corrupt? load it again or convert it anew)"
            )
