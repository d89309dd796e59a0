"""Stream-K against the tuned plans at rollout / prefill row counts: `quarl bench gemm --sweep` restricted to the
plans `quarl.kernels.tuning.MEASURED` holds for each M bucket (any shape) plus the stream-K candidates of the
sweep, int8 and fp8, so one short run shows what the stream-K schedule of the persistent TMA kernel gains.

    PYTHONPATH=. python3 bench/streamk_probe.py [--m 256,512,1024] [--codes-given] [other quarl bench gemm options]
"""

from __future__ import annotations

import sys

from quarl.bench import gemm
from quarl.kernels import tuning


def _restricted(full):
    """family -> {bucket -> [MEASURED plans of the bucket] + [the stream-K candidates]} for int8 / fp8."""
    def wanted():
        out = {}
        for fam in ("int8", "fp8"):
            out[fam] = {}
            for bucket, plans in full()[fam].items():
                measured = [row[bucket][0] for row in tuning.MEASURED[fam].values() if bucket in row]
                sk = [p for p in plans if p.cfg is not None and p.cfg.stream_k]
                out[fam][bucket] = list(dict.fromkeys(measured + sk))
        return out
    return wanted


if __name__ == "__main__":
    gemm._sweep_candidates = _restricted(gemm._sweep_candidates)
    argv = sys.argv[1:]
    if "--m" not in argv:
        argv += ["--m", "256,512,1024"]
    sys.exit(gemm.main(["--sweep", "--formats", "int8,fp8", "--no-save"] + argv))
