"""The files a run-batch writes beside its output, and the checks on the paths a run is given
(plain paths: the command runs them before it loads anything)."""

from __future__ import annotations

from pathlib import Path


def progress_path(out: Path) -> Path:
    """Answers appended as they finish, each with its request's fingerprint (`.OUT.partial`;
    removed once the output is written)."""
    return out.with_name(f".{out.name}.partial")


def fingerprints_path(out: Path) -> Path:
    """The fingerprint of each answer in the output, by answer id (`.OUT.fingerprints`): what
    a resume compares a line's request with before reusing its answer."""
    return out.with_name(f".{out.name}.fingerprints")


PYTHON_NAMES = ("input_path", "output_path", "resume=True", "overwrite=True")
CLI_NAMES = ("-i", "-o", "--resume", "--overwrite")


def check_paths(src: Path, out: Path, resume: bool, overwrite: bool,
                names: tuple[str, str, str, str] = PYTHON_NAMES) -> None:
    """The input is a file; the output is not a folder, and is not replaced unless asked:
    an existing output (or a stopped run's progress) needs `resume` to reuse its answers or
    `overwrite` to replace them. ValueError naming the argument as the caller calls it
    (`names`: input, output, resume, overwrite; the command's are CLI_NAMES)."""
    src_name, out_name, resume_name, overwrite_name = names
    if not src.is_file():
        raise ValueError(f"{src_name} {str(src)!r} is not a file")
    if out.is_dir():
        raise ValueError(f"{out_name} {str(out)!r} is a folder: give a file path")
    if resume and overwrite:
        raise ValueError(f"pass {resume_name} (reuse the answers in {out_name}) or "
                         f"{overwrite_name} (replace them), not both")
    if resume or overwrite:
        return
    found = out if out.exists() else progress_path(out) if progress_path(out).exists() else None
    if found is not None:
        what = "exists" if found == out else "has a stopped run's answers in " + found.name
        raise ValueError(f"{out_name} {str(out)!r} {what}: pass {resume_name} to reuse the "
                         f"answers whose request is unchanged, or {overwrite_name} to replace "
                         "them")
