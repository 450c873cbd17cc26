"""The transformers versions batchgen is verified with, and the check that keeps state-mixer
families off any other.

batchgen runs HF's own modules, so a new transformers can change what a model computes. For
attention layers that shows at once (the attention call is batchgen's); a state mixer's cache
code is HF's, and batchgen hands it per-sequence state of its own: 5.25 changed Mamba-2's and
Jamba's, and an unchecked release gave wrong tokens without an error. So a model with state
mixers is refused, before weights load, on a transformers outside the verified range (an
environment variable lifts that, for trying a new release); any other model runs with one
warning. The range is raised deliberately, after the whole suite passes on the new version
(scripts/check_latest.sh tries the newest release), together with pyproject.toml's bound.
"""

from __future__ import annotations

import os

from batchgen.log import logger

VERIFIED = ("5.24.0", "5.25.0")  # the oldest and newest transformers the suite passed with
ALLOW_ENV = "BATCHGEN_UNVERIFIED_TRANSFORMERS"  # "1": run state mixers on another version
_warned: set[str] = set()


def installed() -> str:
    """The installed transformers' version string."""
    import transformers

    return transformers.__version__


def is_verified(version: str) -> bool:
    """Whether `version` lies in the verified range (pre-releases of its ends do not)."""
    from packaging.version import Version

    return Version(VERIFIED[0]) <= Version(version) <= Version(VERIFIED[1])


def check_transformers(family: str, mixers: set[str], version: str | None = None) -> None:
    """ValueError for a model with state mixers on an unverified transformers (unless
    ALLOW_ENV is "1"); one warning per version for any other model."""
    version = version or installed()
    if is_verified(version):
        return
    span = f"{VERIFIED[0]} to {VERIFIED[1]}"
    if mixers and os.environ.get(ALLOW_ENV) != "1":
        raise ValueError(
            f"model family {family!r} has state-mixer layers ({', '.join(sorted(mixers))}), "
            f"which batchgen has verified on transformers {span} only; transformers {version} "
            "is installed (a release can change these mixers' cache code, and outputs would "
            f"be wrong without an error). Install a verified one: pip install "
            f"'transformers>={VERIFIED[0]},<={VERIFIED[1]}'; or set {ALLOW_ENV}=1 to run it "
            "anyway")
    if version not in _warned:
        _warned.add(version)
        logger.warning("transformers %s is installed; batchgen is verified on %s "
                       "(outputs are checked against HF on those only)", version, span)
