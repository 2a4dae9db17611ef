"""Does the benchmark's evaluator read each peer's checkpoint as the peer's own loader does?

    python benchmarks/peers_loader.py [--work DIR] [--windows 1]

For every finished cell under WORK/cells/ of a peer with its own loader (GPTQModel's
``GPTQModel.load`` for gptqmodel*, transformers' compressed-tensors path for llm-compressor*),
the logits of the first enwiki evaluation windows through that loader (in the peer's venv)
against ``optq.load`` (this checkout; float embeddings): the mean KL between the two, the share
of positions whose top token agrees, and the largest logit difference. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import common  # noqa: F401 - this checkout first on the path
import peers
from common import md_table

LOADERS = {"gptqmodel": "gptqmodel", "llm-compressor": "transformers"}  # venv -> loader


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path)
    ap.add_argument("--windows", type=int, default=1)
    args = ap.parse_args(argv)
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    import optq
    from optq.data.corpora import cache_dir
    from optq.data.tokens import eval_windows, load_tokens

    work = (args.work or cache_dir() / "bench" / "peers").resolve()
    rows = []
    for cell in sorted((work / "cells").glob("*")):
        peer = next((p for p in peers.PEERS.values() if f"-{p.name}-" in cell.name and p.venv in LOADERS), None)
        ckpt = cell / "checkpoint"
        if peer is None or not (cell / "quantize.json").exists() or not ckpt.is_dir():
            continue
        tok = AutoTokenizer.from_pretrained(str(ckpt))
        ids = eval_windows(load_tokens("enwiki", tok, "eval"), 512, args.windows)
        ids_file = cell / "loader-ids.safetensors"
        peers.write_calibration(ids_file, ids)
        python = work / "venvs" / peer.venv / "bin" / "python"
        out = cell / "loader-logits.safetensors"
        loader = LOADERS[peer.venv]
        try:
            peers.run_child(
                python,
                peers.Peer(peer.name, peer.venv, "logits_child.py", "-"),
                ["--loader", loader, "--model", str(ckpt), "--ids", str(ids_file), "--out", str(out)],
                cell / "loader.log",
                False,
            )
        except RuntimeError as exc:
            rows.append([peer.name, loader, "error: " + str(exc).splitlines()[-1][:100], "", ""])
            continue
        theirs = load_file(str(out))["logits"]
        model = optq.load(ckpt, embeddings="model")
        with torch.no_grad():
            ours = model(ids).logits.float()
        lp, lq = torch.log_softmax(theirs.double(), -1), torch.log_softmax(ours.double(), -1)
        kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
        top1 = float((theirs.argmax(-1) == ours.argmax(-1)).double().mean())
        rows.append([peer.name, loader, f"{kl:.2e}", f"{top1:.2%}", f"{float((theirs - ours).abs().max()):.3f}"])
        print(json.dumps({"cell": cell.name, "kl": kl, "top1": top1}), file=sys.stderr)
    print(md_table(["peer", "its loader", "KL(theirs || optq.load)", "top-1 agreement", "max |logit diff|"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
