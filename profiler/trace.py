"""The measured run as a Chrome trace-event file, which ui.perfetto.dev and chrome://tracing open: one span per
step (its plan as arguments), the timed calls nested in it (bytes, FLOPs, positions as arguments).

Written here with ``json`` (the format is public: "Trace Event Format", complete events ``ph: "X"``) rather than
through a tracing library: the spans are recorded in memory anyway for the component table, and the writers on
PyPI (keke, viztracer, pytracing) trace while the program runs, on a writer thread or through a profiling hook,
which would compete with MLX for the same cores inside the measured run; here the file is written once, after it,
and atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

from m2r2_mlx.atomic import atomic_write_text

PID, TID = 1, 1


def _ns(t: float, t0: float) -> int:
    return int(round((t - t0) * 1e9))


def trace_document(profile, summary: dict) -> dict:
    """Whole nanoseconds first, so a child never ends after its parent through rounding."""
    spans = profile.recorder.spans
    t0 = spans[0].start if spans else 0.0
    events = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": PID,
            "args": {"name": f"m2r2-profile {profile.model} {profile.label}"},
        },
        {"name": "thread_name", "ph": "M", "pid": PID, "tid": TID, "args": {"name": "decode (measured run)"}},
    ]
    for s in spans:
        start, end = _ns(s.start, t0), _ns(s.end, t0)
        args = dict(s.args)
        if s.layer is not None:
            args["layer"] = s.layer + 1
        if s.bytes:
            args["bytes"] = s.bytes
        if s.flops:
            args["flops"] = s.flops
        events.append(
            {
                "name": s.name,
                "cat": s.kind,
                "ph": "X",
                "ts": start / 1e3,
                "dur": (end - start) / 1e3,
                "pid": PID,
                "tid": TID,
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": summary}


def write_trace(path: Path, profile, summary: dict) -> Path:
    return atomic_write_text(path, json.dumps(trace_document(profile, summary), separators=(",", ":")))
