"""What every peer's child script shares (it runs in the peer's own virtualenv, without optq):
its command line, the calibration ids, the clock and the closing ``PEER_RESULT {json}`` line."""

from __future__ import annotations

import argparse
import json
import resource
import time


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True)
    ap.add_argument("--model", required=True, help="the float model's folder")
    ap.add_argument("--ids", required=True, help="safetensors file holding ids: [nsamples, seqlen] int64")
    ap.add_argument("--out", required=True, help="the checkpoint folder to write")
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    return ap.parse_args()


def calibration_ids(path: str):
    from safetensors.torch import load_file

    return load_file(path)["ids"]


class Clock:
    """Wall time from the peer library's import (after the ids are read) to the checkpoint's last byte."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def finish(self, version: str, notes: str, **extra) -> None:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        result = {
            "quantize_s": round(time.perf_counter() - self.start, 2),
            "peak_rss_mb": round(peak_mb, 1),
            "version": version,
            "notes": notes,
            **extra,
        }
        print("PEER_RESULT " + json.dumps(result), flush=True)
