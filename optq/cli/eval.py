"""``optq eval``: perplexity of a model on named corpora or text files, and its KL divergence and
top-token agreement against the float model it was quantized from."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from . import CliError, check_text_source, check_writable


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand."""
    p = subparsers.add_parser(
        "eval",
        help="perplexity of a model on evaluation text",
        description="Perplexity over consecutive non-overlapping windows of the evaluation part "
        "of each corpus (exp of the mean NLL of the predicted tokens; a window of L tokens "
        "predicts L-1).",
    )
    p.add_argument("model", help="built-in name (smollm2-135m, gemma3-270m), model folder, .gguf file or hub id")
    p.add_argument(
        "--data",
        default="enwiki",
        help="comma-separated corpora or files: enwiki, news, pydoc, code, debref-<lang>, "
        "FILE.txt, FILE.jsonl, hf:DATASET[:CONFIG] (default: enwiki)",
    )
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--windows", type=int, default=40, help="windows per corpus; 0 = all (default 40)")
    p.add_argument(
        "--bos",
        choices=("auto", "yes", "no"),
        default="auto",
        help="start each window with BOS; auto = what the model needs (Gemma yes, SmolLM2 no)",
    )
    p.add_argument(
        "--part",
        choices=("eval", "calib", "all"),
        default="eval",
        help="which part of each corpus (default eval; 'all' only for files)",
    )
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl files")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument(
        "--reference",
        default="auto",
        metavar="MODEL",
        help="the float model to measure KL(float || model) and top-token agreement against, on the "
        "same windows; auto (default): the model an optq checkpoint's quantization_report.json names "
        "(none for other models); none: perplexity only",
    )
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate, print a table, optionally write JSON."""
    import torch

    from optq.data.corpora import CorpusError
    from optq.data.tokens import eval_windows, load_tokens
    from optq.data.zoo import ModelNotInstalledError, eval_bos_id, load_model
    from optq.eval.divergence import FIELDS, perplexity_and_divergence
    from optq.eval.perplexity import NonFiniteLogitsError, perplexity_detail
    from optq.pipeline.blocks.calibration import check_seqlen, max_positions

    corpora = [c.strip() for c in args.data.split(",") if c.strip()]
    if not corpora:
        raise CliError("--data names no corpus; e.g. --data enwiki,debref-de")
    if args.seqlen < 2 or args.windows < 0 or args.batch_size < 1:
        raise CliError("--seqlen must be >= 2, --windows >= 0 and --batch-size >= 1")
    for name in corpora:
        check_text_source(name)
    if args.json is not None:
        check_writable(args.json, "--json")  # before the evaluation, not after it
    started = time.perf_counter()
    try:
        model, tokenizer = load_model(args.model, dtype=torch.float32, device=args.device)
    except (ModelNotInstalledError, FileNotFoundError, ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from exc
    try:  # before any text is read: the same check as optq quantize's
        check_seqlen(args.seqlen, max_positions(model))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    reference, ref_name, ref_note = _reference(args, load_model, torch)
    load_s = time.perf_counter() - started
    if args.bos == "auto":
        bos_id = eval_bos_id(args.model, tokenizer, getattr(model, "config", None))
    elif args.bos == "yes":
        if tokenizer.bos_token_id is None:
            raise CliError("--bos yes: this tokenizer has no BOS token")
        bos_id = int(tokenizer.bos_token_id)
    else:
        bos_id = None
    rows = []
    for name in corpora:
        try:
            tokens = load_tokens(name, tokenizer, args.part, field=args.text_field)
        except (CorpusError, ValueError, OSError) as exc:
            raise CliError(str(exc)) from exc
        t0 = time.perf_counter()
        div = dict.fromkeys(FIELDS)
        try:
            if reference is None:
                result = perplexity_detail(
                    model,
                    tokens,
                    seqlen=args.seqlen,
                    windows=args.windows or None,
                    bos_id=bos_id,
                    batch_size=args.batch_size,
                    progress=not args.no_progress,
                    device=args.device,
                )
            else:  # the same windows; perplexity from the forward KL reads: one forward of each model
                windows = eval_windows(tokens, args.seqlen, args.windows or None, bos_id)
                result, d = perplexity_and_divergence(
                    reference,
                    model,
                    windows,
                    bos_id=bos_id,
                    batch_size=args.batch_size,
                    progress=not args.no_progress,
                    device=args.device,
                )
                div = {f: getattr(d, f) for f in FIELDS}
        except NonFiniteLogitsError as exc:
            what = "NaN" if math.isnan(exc.value) else "infinite"
            raise CliError(f"perplexity on {name} is {what}: {exc}") from exc
        except ValueError as exc:
            raise CliError(f"{name}: {exc}") from exc
        if not math.isfinite(result.perplexity):
            raise CliError(
                f"perplexity on {name} is {result.perplexity}: the mean NLL of "
                f"{result.mean_nll:.4g} nats overflows; the checkpoint may be corrupt"
            )
        rows.append(
            {
                "corpus": name,
                "part": args.part,
                "text_tokens": int(tokens.numel()),
                **result.to_dict(),
                **div,
                "seconds": round(time.perf_counter() - t0, 2),
            }
        )
    print(f"model {args.model}   seqlen {args.seqlen}   BOS per window: {'yes' if bos_id is not None else 'no'}")
    if ref_note:
        print(ref_note)
    kl_head = f" {'KL':>8} {'KL p99':>8} {'top1':>7}" if reference is not None else ""
    print(f"{'corpus':<22} {'windows':>7} {'tokens':>9} {'perplexity':>11}{kl_head} {'seconds':>8}")
    for r in rows:
        kl = f" {r['kl']:>8.4f} {r['kl_p99']:>8.3f} {r['top1']:>7.1%}" if reference is not None else ""
        print(f"{r['corpus']:<22} {r['windows']:>7} {r['tokens']:>9} {r['perplexity']:>11.3f}{kl} {r['seconds']:>8.1f}")
    if args.json:
        payload = {
            "model": str(args.model),
            "seqlen": args.seqlen,
            "bos_id": bos_id,
            "reference": ref_name,  # the float model of kl, kl_p99, top1 (None: not measured)
            "load_seconds": round(load_s, 2),
            "results": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _reference(args: argparse.Namespace, load_model, torch) -> tuple[object, str | None, str | None]:
    """(the float reference model or None, its name, a line saying why there is none, or None).

    ``--reference MODEL`` that cannot be loaded is an error; the model ``auto`` finds in an optq
    checkpoint's report (its ``options.model``, as given to ``optq quantize``), when it cannot be
    loaded from here, leaves the KL columns out and says why."""
    name = args.reference
    if name == "none":
        return None, None, None
    if name == "auto":
        folder = Path(args.model)
        try:
            options = json.loads((folder / "quantization_report.json").read_text()).get("options", {})
        except (OSError, ValueError, AttributeError):
            options = None
        name = options.get("model") if isinstance(options, dict) else None
        if not name:
            why = "is not an optq checkpoint" if options is None else "has a report naming no source model"
            return None, None, f"no KL against a float model: {args.model} {why} (--reference MODEL names one)"
    try:
        model, _ = load_model(name, dtype=torch.float32, device=args.device)
    except Exception as exc:  # noqa: BLE001 - any failure to load the reference is said, in one line
        if args.reference != "auto":
            raise CliError(f"--reference {name}: {exc}") from exc
        return (
            None,
            None,
            f"no KL: the float model the checkpoint names, {name}, cannot be loaded here ({exc}); "
            "give --reference MODEL",
        )
    return model, str(name), None
