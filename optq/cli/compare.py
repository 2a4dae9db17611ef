"""``optq compare MODEL``: fp vs round-to-nearest vs GPTQ and GPTAQ variants, side by side, per corpus."""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

from . import CliError, check_writable

__all__ = ["register", "run", "table", "plot"]


def register(subparsers: Any) -> None:
    """Add the ``compare`` subcommand."""
    from optq.eval.compare import VARIANT_HELP

    p = subparsers.add_parser(
        "compare",
        help="perplexity of fp, round-to-nearest and GPTQ variants side by side",
        description="Quantize fresh copies of MODEL with each variant on the same calibration "
        "windows and evaluate all of them on the same evaluation windows of each corpus.",
    )
    p.add_argument("model", metavar="MODEL", help="built-in name, model folder, .gguf file or hub id")
    p.add_argument(
        "--variants", default="fp,rtn,gptq,gptaq", help=f"comma-separated; {VARIANT_HELP} (default fp,rtn,gptq,gptaq)"
    )
    g = p.add_argument_group("base settings of the quantized variants")
    g.add_argument("--bits", type=int, default=4)
    g.add_argument("--group-size", type=int, default=128)
    g.add_argument("--asym", dest="sym", action="store_false", default=True, help="asymmetric grid")
    g.add_argument("--damp", type=float, default=0.01)
    c = p.add_argument_group("data")
    c.add_argument(
        "--calib",
        default="enwiki",
        help="calibration corpus or file, or several joined by commas (equal shares of --nsamples) (default enwiki)",
    )
    c.add_argument("--data", default="enwiki", help="comma-separated evaluation corpora (default enwiki)")
    c.add_argument("--nsamples", type=int, default=128, help="calibration windows (default 128)")
    c.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    c.add_argument("--windows", type=int, default=40, help="evaluation windows per corpus (default 40)")
    c.add_argument("--seed", type=int, default=0, help="seed of the calibration draw (default 0)")
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--device", default=None)
    c.add_argument(
        "--json", type=Path, help="write the results here (default compare.json)", default=Path("compare.json")
    )
    c.add_argument("--plot", type=Path, help="write a PNG bar chart here (default: beside --json)")
    c.add_argument(
        "--no-kl",
        dest="kl",
        action="store_false",
        help="skip KL(fp || variant) and top-token agreement (they cost one more forward of fp per "
        "evaluation window; the variant's perplexity comes from the forward they read)",
    )
    c.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the comparison; prints a table as each variant finishes, then writes JSON and PNG."""
    from optq.core.config import QuantConfig
    from optq.data import tokens as data
    from optq.data import zoo
    from optq.eval.compare import compare, parse_variant

    try:
        base = QuantConfig(bits=args.bits, group_size=args.group_size, sym=args.sym, damp=args.damp)
        variants = [parse_variant(v, base) for v in args.variants.split(",") if v.strip()]
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if not variants:
        raise CliError("--variants names no variant")
    corpora = [c.strip() for c in args.data.split(",") if c.strip()]
    check_writable(args.json, "--json")  # before minutes of work, not after them
    if args.plot is not None:
        check_writable(args.plot, "--plot")
    try:
        model, tokenizer = zoo.load_model(args.model)
        bos = zoo.eval_bos_id(args.model, tokenizer, model.config)
        calib = data.calibration_windows(args.calib, tokenizer, args.nsamples, args.seqlen, args.seed)
        evaluation = {
            c: data.eval_windows(data.load_tokens(c, tokenizer, "eval"), args.seqlen, args.windows, bos_id=bos)
            for c in corpora
        }
    except (OSError, ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    print(
        f"{args.model}: calibration {args.calib} {tuple(calib.shape)}, evaluation "
        + ", ".join(f"{c} {tuple(w.shape)}" for c, w in evaluation.items())
        + f", BOS per window: {'yes' if bos is not None else 'no'}"
    )
    rows: list[dict[str, Any]] = []

    def show(res: Any, _model: Any) -> None:
        rows.append(res.to_dict())
        print(table(rows, corpora), flush=True)

    t0 = time.perf_counter()
    compare(
        model if args.kl else lambda: copy.deepcopy(model),  # a loader: no KL against fp
        variants,
        calib,
        evaluation,
        batch_size=args.batch_size,
        device=args.device,
        progress=not args.no_progress,
        on_result=show,
    )
    result = {
        "model": args.model,
        "calib": args.calib,
        "nsamples": args.nsamples,
        "seqlen": args.seqlen,
        "seed": args.seed,
        "windows": args.windows,
        "bos": bos,
        "corpora": corpora,
        "variants": rows,
        "seconds": time.perf_counter() - t0,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    png = args.plot or args.json.with_suffix(".png")
    if plot(result, png):
        print(f"wrote {args.json} and {png}")
    else:
        print(f"wrote {args.json} (install matplotlib for the PNG plot)")
    return 0


def table(rows: list[dict[str, Any]], corpora: list[str]) -> str:
    """Perplexity per corpus and its increase over fp (when an fp row is present); with KL measured,
    per corpus too: the mean KL(fp || variant) per token, its 99th percentile and the top-1
    agreement with fp."""
    fp = next((r["perplexity"] for r in rows if r["method"] == "fp"), None)
    kl = any(r.get("kl") for r in rows)
    width = max(12, *(len(r["name"]) + 2 for r in rows))
    extra = f"{'KL':>9}{'KL p99':>9}{'top1':>8}" if kl else ""
    head = f"{'variant':<{width}}" + "".join(f"{c:>22}{extra}" for c in corpora) + f"{'quantize s':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for c in corpora:
            ppl = r["perplexity"][c]
            delta = f" (+{ppl - fp[c]:.2f})" if fp and r["method"] != "fp" else ""
            cells.append(f"{ppl:>12.3f}{delta:>10}")
            if kl and r.get("kl"):
                cells.append(f"{r['kl'][c]:>9.4f}{r['kl_p99'][c]:>9.3f}{r['top1'][c]:>8.1%}")
            elif kl:
                cells.append(f"{'-':>9}{'-':>9}{'-':>8}")
        lines.append(f"{r['name']:<{width}}" + "".join(cells) + f"{r['quantize_s']:>12.1f}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    """A grouped bar chart of the perplexity increase over fp per corpus; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["variants"]
    fp = next((r["perplexity"] for r in rows if r["method"] == "fp"), None)
    quant = [r for r in rows if r["method"] != "fp"]
    corpora = result["corpora"]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(corpora), 3.6))
    width = 0.8 / max(len(quant), 1)
    for i, r in enumerate(quant):
        values = [r["perplexity"][c] - (fp[c] if fp else 0.0) for c in corpora]
        ax.bar([k + i * width for k in range(len(corpora))], values, width, label=r["name"])
    ax.set_xticks([k + width * (len(quant) - 1) / 2 for k in range(len(corpora))], corpora)
    ax.set_ylabel("perplexity increase over fp" if fp else "perplexity")
    ax.set_title(f"{result['model']}, calibrated on {result['calib']}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
