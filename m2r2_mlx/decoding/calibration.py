"""Step costs measured once per machine and model, kept in the cache folder, refined while decoding.

A profile (costs.CostProfile) is valid for one model (its name and configuration), weight dtype, BLAS, MLX
device and machine; its file is named by a hash of all of them, so a change of any one is a different file and
is measured anew. Measuring takes about a second, when the speculative decoder is built (a chat's or a server's
start), so a first answer pays nothing for it. The file carries the sha256 of its content: a corrupt file (a
changed digit parses, so only the checksum tells) is ignored with one log line and measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..atomic import atomic_write_text
from ..checksums import digest_matches, with_digest
from ..models.blas import blas_info
from ..models.registry import cache_home
from .costs import CostProfile, measure_profile
from .prompt_cache import PromptCache

log = logging.getLogger("m2r2")
VERSION = 2  # 2: the file carries the sha256 of its content
SAVE_EVERY_S = 60.0  # refinements reach the file at the end of an answer, at most this often
SCRATCH_PROMPT = 64  # positions in the throwaway cache a calibration times its forwards after


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def identity(lm) -> dict:
    """What the costs depend on: the model, its weights' dtype, the BLAS, the device and the machine."""
    dtype = str(tree_flatten(lm.model.parameters())[0][1].dtype)
    config = json.dumps(lm.config, sort_keys=True, default=str)
    return {
        "model": lm.name,
        "config": hashlib.sha256(config.encode()).hexdigest()[:16],
        "dtype": dtype,
        "blas": blas_info().name,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "machine": f"{platform.system()} {platform.machine()}, {_cpu()}, {os.cpu_count()} cores",
    }


@dataclass
class Calibration:
    """A profile and the file it lives in; ``refine`` writes what decoding learnt back, now and then."""

    path: Path
    identity: dict
    profile: CostProfile
    saved_at: float = 0.0

    def save(self, profile: CostProfile | None = None) -> None:
        self.profile = profile or self.profile
        doc = with_digest({"version": VERSION, "identity": self.identity, "profile": self.profile.to_json()})
        try:
            atomic_write_text(self.path, json.dumps(doc, indent=1))
        except OSError as e:  # a read-only cache folder costs the next session a calibration, nothing more
            log.warning("could not save step costs to %s (%s)", self.path, e.strerror)
        self.saved_at = time.monotonic()

    def refine(self, profile: CostProfile) -> None:
        if time.monotonic() - self.saved_at >= SAVE_EVERY_S:
            self.save(profile)


def profile_path(ident: dict) -> Path:
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return cache_home() / "calibration" / f"{ident['model']}-{key}.json"


def read_profile(path: Path, ident: dict) -> CostProfile | None:
    """The profile in ``path`` if it is this identity's and well formed; None (and one log line for a damaged
    file) otherwise."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != VERSION or doc.get("identity") != ident:
            return None
        if not digest_matches(doc):
            raise ValueError("its content does not match its sha256")
        return CostProfile.from_json(doc["profile"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        why = str(e) if isinstance(e, ValueError) and not isinstance(e, json.JSONDecodeError) else type(e).__name__
        log.warning("ignoring the damaged step-cost file %s (%s); measuring again", path, why)
        return None


def calibrate(lm) -> Calibration:
    """The machine's profile for ``lm``: read from the cache folder, or measured now and saved."""
    ident = identity(lm)
    path = profile_path(ident)
    profile = read_profile(path, ident)
    if profile is not None:
        return Calibration(path, ident, profile)
    cache = PromptCache(lm.model)
    mx.eval(cache.forward(list(range(1, SCRATCH_PROMPT + 1))))
    calibration = Calibration(path, ident, measure_profile(cache, token=1))
    calibration.save()
    return calibration
